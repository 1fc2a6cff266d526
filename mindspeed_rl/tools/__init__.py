"""Tools that a policy calls in multi-turn rollouts (ReTool's code interpreter), read from MindSpeed-RL's own
tool config files (``configs/tools/*.yaml``).

The modules: :mod:`.base_tool` (the interface a tool implements), :mod:`.schemas` (its OpenAI function schema),
:mod:`.registry` (a tool config file -> tools), :mod:`.parser` (tool calls in a response), :mod:`.turns` (running
them and the tool turn's text), :mod:`.sandbox` / :mod:`.sandbox_fusion` (where code runs) and the tools
:mod:`.sandbox_fusion_tool` and :mod:`.retool`. Nothing heavy is imported here: the trainer imports what it uses.
"""
