"""Multi-turn tool use without generation: the config's checks, a sample's tool turn by MindSpeed-RL's rules (real
parser, real local sandbox, the demo's real tokenizer), the batch's loss mask, retool_reward's tool-call bonus, and
the turns' seed keys. Runs where: this process (the sandbox starts a Python child per call); seconds."""
import math

import pytest
import torch

from mindspeed_rl.config import ConfigError
from mindspeed_rl.protocol import LOSS_MASK, RolloutBatch
from mindspeed_rl.trainer.multi_turn import TOOL_CALLS, ToolTurns, _Sample, _turn_seed_key, with_tool_call_bonus
from tests.test_config import load

RETOOL = "dapo_tiny_retool_cpu"
CALL = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}</tool_call><|im_end|>'


def _error_lines(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(RETOOL, *overrides)
    return [str(error) for error in info.value.all()]


def test_every_bad_multi_turn_key_is_reported_at_once() -> None:
    lines = _error_lines("rl_config.tool_parser_format=xml", "rl_config.tool_response_truncate_side=top",
                         "rl_config.max_parallel_calls=0", "rl_config.max_total_response_length=8",
                         "rl_config.tool_config_path=missing.yaml")
    assert lines[:4] == [
        "rl_config.tool_parser_format: must be one of hermes, got 'xml'",
        "rl_config.tool_response_truncate_side: must be one of left, right, middle, got 'top'",
        "rl_config.max_parallel_calls: must be >= 1, got 0",
        "rl_config.max_total_response_length: must be >= generate_config.sampling_config.max_tokens=16, got 8",
    ]
    assert len(lines) == 5 and lines[4].startswith("rl_config.tool_config_path: missing.yaml")


def test_the_tool_file_is_checked_at_load() -> None:
    lines = _error_lines("rl_config.tool_config_path=missing.yaml")
    assert len(lines) == 1 and lines[0].startswith("rl_config.tool_config_path: missing.yaml")


def test_tool_keys_without_multi_turn_are_errors_not_silent() -> None:
    lines = _error_lines("rl_config.multi_turn_enable=false")
    assert "rl_config.max_tool_calls: is read only with rl_config.multi_turn_enable: true; remove it or enable " \
           "multi-turn tool use" in lines
    assert len(lines) == 7  # every tool key the demo sets


def test_multi_turn_is_refused_with_a_critic() -> None:
    tool_keys = ["rl_config.multi_turn_enable=true", "rl_config.tool_config_path=configs/tools/retool_local.yaml",
                 "rl_config.tool_parser_format=hermes", "rl_config.max_parallel_calls=1",
                 "rl_config.max_total_response_length=64", "rl_config.max_tool_response_length=64",
                 "rl_config.tool_response_truncate_side=middle", "generate_config.max_model_len=72"]
    with pytest.raises(ConfigError) as info:
        load("ppo_tiny_cpu", *tool_keys)
    assert str(info.value) == ("rl_config.multi_turn_enable: is not implemented with a critic (adv_estimator gae): its "
                               "value targets would span the tool outputs")


def test_the_response_width_is_the_total_response_length() -> None:
    config = load(RETOOL)
    assert config.response_length_limit == 64 == config.rl_config.max_total_response_length


@pytest.fixture(scope="module")
def tool_turns():
    from transformers import PreTrainedTokenizerFast

    from mindspeed_rl.data.tiny_tool_call import build_tool_call_tokenizer

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tool_call_tokenizer())
    return ToolTurns(load(RETOOL), tokenizer)


def _sample(tool_turns, text: str, *, tool_calls: int = 0, response_length: int = 0) -> _Sample:
    ids = tool_turns.tokenizer(text, add_special_tokens=False)["input_ids"]
    sample = _Sample(prompt=[1, 2], response=[0] * response_length, tool_calls=tool_calls)
    sample.add_turn(ids, [-0.5] * len(ids))
    return sample


def test_a_tool_call_runs_and_its_output_is_appended_unsampled(tool_turns) -> None:
    sample = _sample(tool_turns, CALL)
    going, _ = tool_turns._after_turn([sample])
    assert going == [sample] and sample.tool_calls == 1
    appended = sample.response[4:]
    assert tool_turns.tokenizer.decode(appended) == ("<|im_start|>user\n<tool_response>\n42\n\n</tool_response>"
                                                     "<|im_end|>\n<|im_start|>assistant\n")
    assert sample.sampled == [1.0] * 4 + [0.0] * len(appended) and sample.logprobs[4:] == [0.0] * len(appended)


@pytest.mark.parametrize("text, tool_calls, response_length", [
    ("\\boxed{42}<|im_end|>", 0, 0),  # no call: the sample ends
    (CALL, 1, 0),  # max_tool_calls (1) reached
    (CALL, 0, 50),  # the tool turn would pass max_total_response_length (64)
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', 0, 0),  # an unknown tool: MindSpeed-RL ends it
])
def test_a_sample_ends_by_mindspeed_rl_rules(tool_turns, text, tool_calls, response_length) -> None:
    sample = _sample(tool_turns, text, tool_calls=tool_calls, response_length=response_length)
    before = list(sample.response)
    going, _ = tool_turns._after_turn([sample])
    assert going == [] and sample.response == before


def test_the_loss_mask_leaves_out_tool_outputs() -> None:
    batch = RolloutBatch.from_token_lists([[5, 6]], [[1, 2, 3, 4, 5]], pad_id=0, response_width=7)
    batch.columns[LOSS_MASK] = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    assert batch.loss_mask().tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    assert batch.response_mask.sum().item() == 5  # the tool outputs stay in the response (and in its length)
    mb = batch.micro_batches(1, torch.device("cpu"))[0]
    assert torch.equal(mb.loss_mask(), batch.loss_mask())


def test_retool_rewards_get_the_tool_call_bonus_of_mindspeed_rl() -> None:
    from mindspeed_rl.data.rewards import RuleRewards

    rl = load(RETOOL).rl_config
    scores = torch.tensor([1.0, -1.0, -1.0])
    rewards = RuleRewards(total=scores.clone(), per_verifier={"retool_reward": scores})
    batch = RolloutBatch.from_token_lists([[1]] * 3, [[2]] * 3, pad_id=0, response_width=1)
    batch.columns[TOOL_CALLS] = torch.tensor([1, 0, 1])
    bonus = with_tool_call_bonus(rewards, batch, rl)
    # min(0, score + 0.1 x calls) for a wrong answer; a right one keeps 1.
    assert bonus.per_verifier["retool_reward"].tolist() == pytest.approx([1.0, -1.0, -0.9])
    assert bonus.total.tolist() == pytest.approx([1.0, -1.0, -0.9])


def test_each_turn_samples_from_its_own_seed_stream() -> None:
    from mindspeed_rl.workers.actor_steps import sampling_seed

    keys = [(3, 0), _turn_seed_key((3, 0), 1), _turn_seed_key((3, 0), 2), _turn_seed_key((3, 1), 1)]
    assert len({sampling_seed(7, key, 0) for key in keys}) == 4
    assert _turn_seed_key(None, 1) is None and _turn_seed_key(3, 1) == (3, 0, 1)
    assert not math.isnan(sampling_seed(7, _turn_seed_key(3, 1), 1))
