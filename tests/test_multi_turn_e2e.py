"""End to end: `python cli/train_dapo.py --config-name dapo_tiny_retool_cpu` runs multi-turn tool use (ReTool) on
two ranks (Ray; inference DP 2, so a turn's continuations are split unevenly): real vLLM turns, the code
interpreter run in the local sandbox, real Megatron updates, and the evaluation before training with the tools too.
Runs where: subprocesses; ~1 min on 2 cores.

The oracle is the demo model itself (mindspeed_rl/data/tiny_tool_call.py): a programmed bigram policy whose every
turn opens with a 50/50 choice (entropy ln 2) and is deterministic after it (entropy 0), and whose tool turn is
always the same T tokens (the sandbox prints 42). So the update's token-mean entropy over the sampled tokens is
exactly ln 2 x (turns) / (response tokens - T x tool turns): any tool-output token in the loss would change it.
"""
import json
import math

from cli_runner import run_cli


def _tool_turn_tokens() -> int:
    from mindspeed_rl.data.tiny_tool_call import build_tool_call_tokenizer
    from mindspeed_rl.tools.turns import tool_turn_text, wrap_tool_output

    text = tool_turn_text([wrap_tool_output("42\n", max_length=256, truncate_side="middle")])
    return len(build_tool_call_tokenizer().encode(text, add_special_tokens=False).ids)


def test_the_retool_demo_calls_the_tool_and_trains_only_on_sampled_tokens(tmp_path):
    done = run_cli(tmp_path, "dapo_tiny_retool_cpu", "megatron_training.train_iters=2",
                   "rl_config.actor_resource.num_npus=2", "runtime.local_single_rank=false",
                   "rl_config.eval_before_train=true",  # on the generated task's evaluation split
                   "rl_config.eval_sampling=train", "rl_config.eval_n_samples=4",
                   script="cli/train_dapo.py", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    evaluation, *records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tool_tokens = _tool_turn_tokens()
    # The evaluation runs the tools too: tool turns in its responses (an answer at once is 2 tokens, a call 4) and
    # retool_reward with the bonus.
    assert evaluation["iteration"] == 0 and evaluation["eval/prompts"] == 6
    assert evaluation["eval/response_length/mean"] > 4
    accuracy = evaluation["eval/accuracy"]
    assert math.isclose(evaluation["eval/retool_reward/mean"], accuracy - 0.9 * (1 - accuracy), abs_tol=1e-6)
    assert len(records) == 2
    for r in records:
        calls, length = r["tool_call_num/mean"], r["response_length/mean"]
        assert 0.1 < calls < 0.9 and r["tool_call_num/max"] == 1  # max_tool_calls: 1
        assert r["multi_turn/turns"] == 2
        # A call (4 tokens) + the tool turn + a second turn (2 or 4 tokens); an answer at once is 2 tokens.
        assert r["response_length/max"] <= 4 + tool_tokens + 4 and r["response_length/min"] == 2
        sampled_tokens = length - tool_tokens * calls
        assert math.isclose(r["actor/entropy"], math.log(2) * (1 + calls) / sampled_tokens, rel_tol=1e-3)
        # vLLM's log-probs over the sampled tokens only (tool outputs have none) equal Megatron's.
        assert r["rollout/logprob_max_abs_diff"] < 1e-4
        # retool_reward: a box at the end scores 1; else two calls and no box: -1 + 0.1 (one tool turn).
        assert math.isclose(r["reward/mean"], r["reward/accuracy"] - 0.9 * (1 - r["reward/accuracy"]), abs_tol=1e-6)


def test_the_search_demo_calls_their_search_tool_against_the_shipped_server(tmp_path):
    """dapo_tiny_search_cpu: the demo's model calls MindSpeed-RL's SearchTool (configs/tools/search_local.yaml), the run
    serves the retrieval server from its own process, and the passages come back as a tool turn."""
    done = run_cli(tmp_path, "dapo_tiny_search_cpu", "megatron_training.train_iters=2", script="cli/train_dapo.py",
                   timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert 0.1 < r["tool_call_num/mean"] < 0.9 and r["multi_turn/turns"] == 2
        # A call (4 tokens) then the passages' tool turn: far longer than an answer at once (2 tokens).
        assert r["response_length/max"] > 20 and r["response_length/min"] == 2
