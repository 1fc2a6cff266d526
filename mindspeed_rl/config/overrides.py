"""Command lines as MindSpeed-RL users type them, turned into what Hydra needs.

Two Hydra behaviours would otherwise surprise them:
- Hydra overrides only keys the YAML lists (``runtime.device=cpu`` on a recipe without a ``runtime`` block
  fails with a multi-line message; ``+runtime.device=cpu`` works). Every section of ours is optional, so a
  plain ``a.b=v`` becomes ``++a.b=v`` (set, or add when absent); a key the schema does not know is then
  named by load_config, with every other error of the run.
- ``--config-dir DIR`` puts DIR *after* the entry point's own configs/, so a user's ``grpo_qwen25_7b_A3``
  or ``model/qwen25_7b`` would silently load ours. Here DIR becomes the primary config path and ours is
  searched after it: the user's files win, ours fill in only what DIR lacks.
"""

import os

_CONFIG_DIR_FLAGS = ("--config-dir", "-cd")
_SEARCHPATH_KEY = "hydra.searchpath"


# ROLL's top-level keys (config/grpo.py's root scalars): set or added like a section's, though they have no dot.
ROOT_SCALARS = ("async_generation_ratio", "num_gpus_per_node")


def as_upsert(override: str) -> str:
    """``a.b=v`` -> ``++a.b=v``; Hydra's own keys, group choices (no dot, but ROOT_SCALARS) and prefixed overrides
    are kept."""
    key, equals, _ = override.partition("=")
    if not equals or override.startswith(("+", "~", "-")) or key.startswith("hydra."):
        return override
    if "." not in key and key not in ROOT_SCALARS:
        return override
    return f"++{override}"


def search_path_override(config_dir: str) -> str:
    return f"{_SEARCHPATH_KEY}=[file://{os.path.abspath(config_dir)}]"


def hydra_argv(argv: list[str], *, our_config_dir: str) -> list[str]:
    """The argv Hydra gets (argv[0] kept): overrides as upserts, ``--config-dir`` made the primary path."""
    rewritten, user_dir = [argv[0]], None
    arguments = iter(argv[1:])
    for argument in arguments:
        flag, equals, value = argument.partition("=")
        if flag in _CONFIG_DIR_FLAGS:
            user_dir = value if equals else next(arguments, "")
        else:
            rewritten.append(as_upsert(argument))
    if user_dir is None:
        return rewritten
    if not any(argument.startswith(_SEARCHPATH_KEY) for argument in rewritten):
        # Hydra's parser takes the overrides as one run of positionals: this one joins the first of them.
        first_override = next((i for i, arg in enumerate(rewritten) if i and "=" in arg and arg[0] != "-"),
                              len(rewritten))
        rewritten.insert(first_override, search_path_override(our_config_dir))
    # Hydra resolves a relative --config-path against the entry point's file, --config-dir against the cwd.
    return rewritten[:1] + ["--config-path", os.path.abspath(user_dir)] + rewritten[1:]
