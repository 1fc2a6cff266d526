"""The switch obeys the residency table: for every combination of the three `offload_train_*` flags,
entering each phase through the sharding manager (generate through the real weight push into vLLM)
leaves exactly the table's row of state groups on the device, and leaving it what the table keeps.

Runs where: in the pytest process (world of 1 rank, gloo): real Megatron actor and reference, real
vLLM engine, a Megatron reward model, a Megatron critic (PPO's two critic phases), the offloader over all of
their states.
"""
import itertools

import pytest
import torch

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.data.tiny_reward_model import create_tiny_reward_checkpoint
from mindspeed_rl.memory.residency import REWARD_PARAMS, STATE_GROUPS, ResidencyPolicy
from mindspeed_rl.parallel import megatron_state

FLAG_COMBINATIONS = list(itertools.product([True, False], repeat=3))


@pytest.fixture(scope="module")
def manager(world, tmp_path_factory):
    from mindspeed_rl.engines.critic import CriticEngine, register_critic_states
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.engines.reward_model import RewardModelEngine, register_reward_states
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.memory.megatron_states import register_megatron_states
    from mindspeed_rl.memory.offload import Offloader
    from mindspeed_rl.memory.vllm_states import register_inference_states
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout
    from mindspeed_rl.resharding.weight_push import colocated_push
    from mindspeed_rl.workers.sharding_manager import ShardingManager

    checkpoint = str(tmp_path_factory.mktemp("residency") / "model")
    create_tiny_qwen2_checkpoint(checkpoint, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=3)
    spec, state = load_hf_checkpoint(checkpoint)
    adam = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             clip_grad=1.0)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                           parallel=megatron_state.current(), optimizer=adam)
    reference = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                               parallel=megatron_state.current(), optimizer=None)
    reward_spec, reward_state = load_hf_checkpoint(str(create_tiny_reward_checkpoint(
        tmp_path_factory.mktemp("residency") / "reward", base_model_dir=checkpoint, seed=4)))
    reward = RewardModelEngine(spec=reward_spec, hf_state=reward_state, params_dtype=torch.float32, accelerator=world,
                               parallel=megatron_state.current())
    critic = CriticEngine(spec=reward_spec, hf_state=reward_state, params_dtype=torch.float32, accelerator=world,
                          parallel=megatron_state.current(),
                          optimizer=adam)
    inference_model = VLLMEngine(VLLMEngineConfig(
        model_dir=checkpoint, tensor_parallel_size=1, dtype="float32", max_model_len=32, max_num_seqs=8,
        max_num_batched_tokens=256, seed=0, enforce_eager=True, gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=0.03, on_cpu=True))
    offloader = Offloader(world)
    register_megatron_states(offloader, actor, reference)
    register_reward_states(offloader, reward)
    register_critic_states(offloader, critic)
    register_inference_states(offloader, inference_model, world)
    push = colocated_push(actor=actor, inference_model=inference_model, train=TrainLayout(tp=1, pp=1),
                          infer=InferLayout(tp=1), rank=0, world_size=1, bucket_bytes=2**20, check_weights=True)
    return ShardingManager(offloader=offloader, policy=ResidencyPolicy.offloading(), weight_push=push)


def _resident(manager) -> set[str]:
    return {name for name in STATE_GROUPS if name in manager.offloader.states and manager.offloader.is_resident(name)}


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=lambda f: "param%d-grad%d-optim%d" % f)
def test_each_phase_leaves_exactly_the_tables_row_on_the_device(manager, flags):
    param, grad, optimizer = flags
    manager.policy = ResidencyPolicy(offload_train_param=param, offload_train_grad=grad,
                                     offload_train_optimizer=optimizer, has_reward_model=True, has_critic=True)
    # An iteration's calls, in order, each entering its phase and leaving it as the worker's RPCs do.
    manager.enter("idle")
    assert _resident(manager) == manager.policy.resident("idle")
    for phase in manager.policy.recorded_phases():
        manager.enter(phase)
        assert _resident(manager) == manager.policy.resident(phase), phase
        manager.leave(phase)
        assert _resident(manager) == manager.policy.after(phase), phase
    assert manager.pop_metrics()["resharding/ranges_verified"] > 0, "generate went through the checked push"
    assert manager.offloader.resident_bytes()["kv_cache"] == 0
    assert manager.offloader.resident_bytes()[REWARD_PARAMS] == 0
