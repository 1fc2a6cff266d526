"""Context parallelism's pieces that need no process group: the chunks a rank holds, the config's checks and the
planner's layout (the engine itself: tests/test_context_parallel_multiprocess.py, tests/test_context_parallel_e2e.py)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.config import ConfigError
from mindspeed_rl.models.context_parallel import local_offsets, split_sequence
from tests.test_config import load


def test_a_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    positions = torch.arange(16)
    assert split_sequence(positions, dim=0, cp_rank=0, cp=2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert split_sequence(positions, dim=0, cp_rank=1, cp=2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_local_offsets_find_each_position_where_split_sequence_put_it():
    """The log-prob step finds a scored position in a rank's logits by local_offsets; the model got the rank's tokens
    from split_sequence: the two must agree, each of a rank's slots named once."""
    sequence = torch.arange(24).reshape(2, 12)
    positions = torch.arange(12)
    for cp_rank in range(3):
        local = split_sequence(sequence, dim=1, cp_rank=cp_rank, cp=3)
        offsets = local_offsets(positions, torch.full_like(positions, 12), cp_rank, 3)
        held = offsets >= 0
        assert sorted(offsets[held].tolist()) == list(range(4))
        assert torch.equal(local[:, offsets[held]], sequence[:, positions[held]])


def test_the_cp2_demo_has_one_data_parallel_rank_on_two_ranks():
    config = load("grpo_tiny_cpu_cp2")
    assert (config.world_size, config.actor_config.context_parallel_size, config.train_data_parallel_size) == (2, 2, 1)


def test_context_parallel_that_does_not_divide_the_ranks_is_a_config_error():
    with pytest.raises(ConfigError, match=r"actor_config.context_parallel_size: tensor_model_parallel_size \* "
                                          r"pipeline_model_parallel_size \* context_parallel_size = 1 \* 1 \* 3 = 3 "
                                          r"must divide"):
        load("grpo_tiny_cpu_cp2", "actor_config.context_parallel_size=3")


def test_what_context_parallelism_does_not_cover_is_refused_by_name():
    with pytest.raises(ConfigError, match="actor_config.context_parallel_size: .*attention dropout"):
        load("grpo_tiny_cpu_cp2", "megatron_training.attention_dropout=0.1")


@pytest.mark.parametrize("config_name, overrides", [
    ("grpo_tiny_cpu_reward_model", ("actor_config.tensor_model_parallel_size=1",)), ("ppo_tiny_cpu", ())])
def test_a_reward_model_and_a_critic_run_under_context_parallelism(config_name, overrides):
    """Their trunks split like the actor's (test_critic_engine_multiprocess, test_reward_model_engine: = HF)."""
    config = load(config_name, "actor_config.context_parallel_size=2", *overrides)  # both on 2 ranks
    assert config.actor_config.context_parallel_size == 2


def test_the_planner_gives_each_cp_rank_half_of_a_micro_batchs_tokens():
    from mindspeed_rl.planner.from_config import plan_inputs, resolve_hf_config, architecture

    config = load("grpo_tiny_cpu_cp2")
    inputs = plan_inputs(config, architecture(resolve_hf_config(config)), device="cpu")
    # DP is Megatron's (CP excluded), as the config's and the ranks'; the ranks holding the same weights are DP x CP.
    assert inputs.dp == config.train_data_parallel_size == 1 and inputs.dp_cp == 2
    assert inputs.train_layout == config.layout.train
    assert inputs.tokens_per_micro_batch == inputs.micro_batch_size * inputs.padded_seq_length // 2
    assert inputs.padded_seq_length % 4 == 0
