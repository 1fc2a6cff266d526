"""The memory planner (mindspeed_rl/planner/, cli/plan.py): parameter counts of the shipped specs against the
published sizes, the phase table against the residency policy, per-rank bytes against hand computations and
against a live Megatron engine's tensors, the switch against the resharding plan, and the CLI.

Runs where: in the pytest process (the live-engine checks use the 1-rank gloo world of conftest), plus three
short `python cli/plan.py` subprocesses (no Ray, no vLLM; a few seconds each).
"""
import itertools
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mindspeed_rl.engines.vllm_cpu_linears import packs_linears
from mindspeed_rl.memory.residency import PHASES, ResidencyPolicy
from mindspeed_rl.planner.arch import from_hf_config
from mindspeed_rl.planner.activations import activation_bytes, activation_terms
from mindspeed_rl.planner.inputs import KVCacheSpec, PlanInputs
from mindspeed_rl.planner.memory import ACTIVATIONS, kv_needed_bytes, plan_memory
from mindspeed_rl.planner.params import megatron_params, train_state_bytes, vllm_numel
from mindspeed_rl.models.layouts import parameter_shapes, vllm_layout, vllm_pp_layers
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.sizes import parse_bytes
from mindspeed_rl.resharding.plan import InferLayout
from mindspeed_rl.planner.switch import plan_switch

REPO = Path(__file__).resolve().parents[1]
HF = REPO / "configs" / "model" / "hf"

# Published totals (model cards / the safetensors metadata on the Hub); DeepSeek-V3 without its MTP module.
PUBLISHED = {"qwen25_7b": 7.61e9, "qwen25_32b": 32.8e9, "qwen3_8b": 8.19e9, "qwen3_30b_a3b": 30.5e9, "deepseek_v3": 671e9}


def _arch(name: str):
    return from_hf_config(json.loads((HF / f"{name}.json").read_text()))


def _tiny(**overrides):
    config = {"model_type": "qwen2", "vocab_size": 16, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    return from_hf_config({**config, **overrides})


def _tiny_moe(**overrides):
    config = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, head_dim=16, num_experts=4,
                  moe_intermediate_size=32, num_experts_per_tok=2)
    return _tiny(**{**config, **overrides})


# -- parameter counts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_of_each_shipped_spec_is_within_half_a_percent_of_the_published_size(name):
    count = _arch(name).parameter_count()
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.005, (name, count)


def test_active_parameters_of_the_moe_specs():
    assert abs(_arch("qwen3_30b_a3b").active_parameter_count() / 3.3e9 - 1) < 0.02  # "A3B": 3.3B active
    assert abs(_arch("deepseek_v3").active_parameter_count() / 37e9 - 1) < 0.02  # 37B activated


@pytest.mark.parametrize("name", ["qwen25_7b", "qwen3_30b_a3b", "deepseek_v3"])
def test_the_count_equals_the_engines_hf_tensor_shapes(name):
    from mindspeed_rl.models.layouts import hf_shapes

    arch = _arch(name)
    assert arch.parameter_count() == sum(math.prod(s) for s in hf_shapes(arch.to_spec()).values())


def test_deepseek_shards_add_up_to_the_count():
    """TP1/PP1/EP1 Megatron holds every parameter (the router's score bias is a buffer there); vLLM too. The
    shards are the engine's layouts (tests/test_deepseek_v3.py checks them against live engines at TP2 and PP2)."""
    arch = _arch("deepseek_v3")
    assert arch.trainable and "can train" in arch.support and arch.mtp_layers == 1
    megatron = sum(p.numel for p in megatron_params(arch, tp=1, tp_rank=0, pp=1, pp_rank=0))
    router_bias = arch.num_experts * (arch.num_layers - arch.first_dense_layers)
    assert megatron + router_bias == arch.parameter_count()
    assert vllm_numel(arch, tp=1, tp_rank=0, dp=1, dp_rank=0, expert_parallel=False) == arch.parameter_count()


def test_shipped_model_blocks_describe_their_config_json():
    from omegaconf import OmegaConf

    from mindspeed_rl.config import ModelArchConfig, check_model_block_against_hf

    for name in PUBLISHED:
        block = OmegaConf.load(REPO / "configs" / "model" / f"{name}.yaml")[name]
        arch = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelArchConfig), block))
        arch.check(f"model.{name}")
        check_model_block_against_hf(arch, f"model.{name}", json.loads((HF / f"{name}.json").read_text()))


# -- per-rank bytes by hand ---------------------------------------------------------------------------------
def test_dense_tp2_pp2_shards_by_hand():
    arch = _tiny()  # V16 h128 f256 4 layers, 4 heads of 32, 2 KV heads, QKV bias, untied
    h, hd = 128, 32
    layer = (2 * h                                   # input / pre-MLP norms, replicated
             + (2 * hd + hd + hd) * (h + 1)          # linear_qkv: this rank's query group (2 heads + k + v), bias
             + h * 2 * hd                            # linear_proj: half the columns
             + 2 * (256 // 2) * h + h * (256 // 2))  # linear_fc1 [gate; up] halves, linear_fc2 half the columns
    first = 16 // 2 * h + 2 * layer                  # vocab-parallel embedding + 2 layers
    last = 2 * layer + h + 16 // 2 * h               # 2 layers + final norm + vocab-parallel output layer
    for tp_rank in (0, 1):
        assert sum(p.numel for p in megatron_params(arch, tp=2, tp_rank=tp_rank, pp=2, pp_rank=0)) == first
        assert sum(p.numel for p in megatron_params(arch, tp=2, tp_rank=tp_rank, pp=2, pp_rank=1)) == last
    plan = plan_memory(PlanInputs(arch=arch, world_size=4, tp=2, pp=2))
    table = plan.table()
    assert table["old_logprob"]["train_params"] == 4 * last  # fp32, the larger stage
    assert table["update"]["train_grads"] == 4 * last
    assert table["update"]["optimizer_states"] == 8 * last  # Adam moments, fp32 model: no masters
    # vLLM TP1 on every rank: the whole model, the 16-row vocabulary padded to 64; on this CPU host with the
    # oneDNN-packed copies of every linear weight and the head (engines/vllm_cpu_linears.py), not the embedding, the
    # norms or the biases.
    whole = arch.parameter_count() + 2 * (64 - 16) * h
    linears = 4 * ((4 + 2 + 2) * hd * h + h * 4 * hd + 2 * 256 * h + h * 256) + 64 * h  # qkv, o, gate_up, down
    assert [r.pushed_weight_bytes for r in plan.ranks] == [4 * whole] * 4
    assert table["generate"]["inference_weights"] == 4 * whole + (4 * linears if packs_linears() else 0)


def test_bf16_holds_every_param_in_bf16_with_fp32_masters():
    arch = _tiny(num_hidden_layers=2)
    params = megatron_params(arch, tp=1, tp_rank=0, pp=1, pp_rank=0)
    total = arch.parameter_count()
    assert sum(p.numel for p in params) == total
    state = train_state_bytes(params, bf16=True, distributed_optimizer=False, dp_cp=1, expert_dp=1, dp_cp_rank=0,
                              expert_dp_rank=0)
    assert state.params == state.reference == 2 * total  # norms too (Float16Module's cast, models/megatron_build)
    assert state.grads == 4 * total  # grad_reduce_in_fp32
    assert state.optimizer == 12 * total  # Adam moments and an fp32 master for every element


def test_moe_tp2_ep2_shards_and_the_distributed_optimizer_by_hand():
    arch = _tiny_moe()  # h64, 4 heads of 16, 2 KV heads, 4 experts of 32, q/k norms, no bias, 2 layers
    h, tp, ep = 64, 2, 2
    expert = 2 * (32 // tp) * h + h * (32 // tp)  # one expert's fc1 [gate; up] and fc2, split over expert TP
    layer_dense = 2 * h + (2 * 16 + 16 + 16) * h + 2 * 16 + h * 2 * 16 + 4 * h  # norms, qkv, q/k norms, proj, router
    params = megatron_params(arch, tp=tp, tp_rank=1, pp=1, pp_rank=0, ep=ep, ep_rank=1)
    experts = sum(p.numel for p in params if p.expert)
    assert experts == 2 * (4 // ep) * expert
    assert sum(p.numel for p in params) == experts + 2 * layer_dense + 2 * (16 // tp) * h + h
    # bf16 + distributed optimizer on 8 ranks: DP 4, expert DP 2. Each buffer's params start on 64-element
    # boundaries, each buffer ends on lcm(DP, 128); a rank optimizes 1/DP of each (1/expert-DP of the experts).
    state = train_state_bytes(params, bf16=True, distributed_optimizer=True, dp_cp=4, expert_dp=2, dp_cp_rank=0,
                              expert_dp_rank=0)
    dense = [p.numel for p in params if not p.expert]
    # DDP fills a buffer in reverse order, each start rounded up to 64 (the q/k norms of 16 are padded).
    padded_dense = -(-(sum(-(-n // 64) * 64 for n in dense[1:]) + dense[0]) // 128) * 128
    assert state.params == 2 * (padded_dense + experts)
    assert state.grads == 4 * (padded_dense + experts)
    assert state.reference == 2 * (sum(dense) + experts)


def test_activations_follow_the_pipeline_schedule():
    arch = _tiny()
    inputs = PlanInputs(arch=arch, world_size=2, pp=2, micro_batch_size=4, mini_batch_samples=8, seq_length=10)
    assert inputs.micro_batches_per_step == 2
    # Stage 0 holds 2 micro-batches in flight (1F1B warm-up), the last stage 1 plus the logits' response rows
    # (every position here: no response_length given).
    per_layer = 24 * 128 + 16 * 128 + 20 * 256 + 4 * 4 * 10
    assert activation_bytes(inputs, 0) == 2 * 4 * 10 * (2 * per_layer + 8)
    assert activation_bytes(inputs, 1) == 4 * 10 * (2 * per_layer + 12 * 128 + 4 * 16 + 24)


# -- the phase table is the residency policy ----------------------------------------------------------------
@pytest.mark.parametrize("has_reward_model", [False, True], ids=["rule", "reward_model"])
@pytest.mark.parametrize("flags", list(itertools.product([True, False], repeat=3)))
def test_the_phase_table_follows_the_residency_policy(flags, has_reward_model):
    policy = ResidencyPolicy(offload_train_param=flags[0], offload_train_grad=flags[1], offload_train_optimizer=flags[2],
                             has_reward_model=has_reward_model)
    plan = plan_memory(PlanInputs(arch=_tiny(), world_size=2, tp=2, policy=policy,
                                  kv=KVCacheSpec(on_cpu=True, cpu_bytes=1 << 22)))
    table = plan.table()
    assert ("reward" in table) == has_reward_model  # the phase exists only with a reward model
    for phase in (p for p in PHASES if p in table):
        resident = {c for c, v in table[phase].items() if v}
        expected = set(policy.resident(phase)) | ({ACTIVATIONS} if phase == "update" else set())
        assert resident == expected, (phase, flags)
        assert plan.totals()[phase][1] == sum(table[phase].values())  # every rank alike here
    switch = {c for c, v in table["switch"].items() if v}
    assert switch == set(policy.pinned) | {"train_params", "inference_weights"}


def test_kv_cache_sizes():
    arch = _arch("qwen25_7b")
    gpu = KVCacheSpec(on_cpu=False, gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=1024)
    needed = plan_memory(PlanInputs(arch=arch, world_size=2, infer_tp=2, bf16=True, infer_dtype="bfloat16", kv=gpu))
    per_token = 2 * 28 * (4 // 2) * 128 * 2  # K and V, 28 layers, 2 of the 4 KV heads, head_dim 128, bf16
    assert needed.table()["generate"]["kv_cache"] == 8 * 1024 * per_token
    sized = plan_memory(PlanInputs(arch=arch, world_size=2, infer_tp=2, bf16=True, infer_dtype="bfloat16", kv=gpu,
                                   device_memory=64 << 30))
    row = sized.table()["generate"]
    assert row["kv_cache"] + row["inference_weights"] == 32 << 30  # vLLM fills its share of the device
    cpu = plan_memory(PlanInputs(arch=arch, world_size=1, kv=KVCacheSpec(on_cpu=True, cpu_bytes=3 << 20)))
    assert cpu.table()["generate"]["kv_cache"] == 3 << 20


def test_parse_bytes():
    assert parse_bytes("64GiB") == 64 << 30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("1.5TiB") == 3 << 39
    for bad in ("abc", "-1GiB", "12XB", ""):
        with pytest.raises(ValueError):
            parse_bytes(bad)


# -- the switch is the resharding plan ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", [
    dict(arch="dense", world_size=2, tp=2, infer_tp=1),
    dict(arch="dense", world_size=2, pp=2, infer_tp=2),
    dict(arch="dense", world_size=4, tp=2, pp=2, infer_tp=1, infer_dtype="bfloat16"),
    dict(arch="moe", world_size=2, ep=2, infer_tp=2, infer_expert_parallel=True),
    dict(arch="dense", world_size=2, tp=2, infer_pp=2),  # each stage receives its layers' other TP half
    dict(arch="dense", world_size=4, pp=2, infer_tp=2, infer_pp=2),  # train PP2 x DP2 -> infer TP2 x PP2
    dict(arch="dense", world_size=4, tp=2, infer_pp=4, infer_dtype="bfloat16"),  # one layer per stage
    dict(arch="dense", world_size=8, tp=2, pp=2, infer_tp=2, infer_pp=2),  # infer DP2
    dict(arch="moe", world_size=4, ep=2, infer_pp=2, infer_expert_parallel=True),  # infer PP2 x DP2, EP2 per stage
])
def test_switch_bytes_are_the_resharding_plans(layout):
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan

    layout = dict(layout)
    arch = _tiny() if layout.pop("arch") == "dense" else _tiny_moe()
    inputs = PlanInputs(arch=arch, bucket_bytes=1 << 16, **layout)
    switch = plan_switch(inputs, link_bytes_per_second=1e9)
    plan = build_plan(arch.to_spec(), TrainLayout(tp=inputs.tp, pp=inputs.pp, ep=inputs.ep),
                      InferLayout(tp=inputs.infer_tp, pp=inputs.infer_pp, expert_parallel=inputs.infer_expert_parallel),
                      inputs.world_size)
    size = 2 if inputs.infer_dtype == "bfloat16" else 4
    for rank in switch.ranks:
        stats = plan.stats[rank.rank]
        assert (rank.received, rank.sent, rank.local) == (size * stats["received_numel"], size * stats["sent_numel"],
                                                          size * stats["local_numel"])
        assert rank.staging == min(rank.received, 1 << 16) + min(rank.sent, 1 << 16)
    assert switch.seconds == max(max(r.received, r.sent) for r in switch.ranks) / 1e9


# -- inference pipeline parallelism -------------------------------------------------------------------------
@pytest.fixture
def vllm_partition(monkeypatch):
    """vLLM's default layer partition (an override in the environment would change every stage)."""
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)


def _vllm_stage_bytes(arch, infer: InferLayout, world: int, rank: int, dtype_bytes: int) -> int:
    """The oracle: the bytes of `vllm_layout` of `rank`'s (tp, pp, dp) coordinates."""
    layout = vllm_layout(arch.to_spec(), tp=infer.tp, tp_rank=infer.tp_rank(rank), dp=world // (infer.tp * infer.pp),
                         dp_rank=infer.dp_rank(rank), expert_parallel=infer.expert_parallel, pp=infer.pp,
                         pp_rank=infer.pp_rank(rank))
    return dtype_bytes * sum(math.prod(shape) for shape in parameter_shapes(layout).values())


def test_infer_pp_coordinates_are_vllms_and_the_world_must_split():
    inputs = PlanInputs(arch=_tiny(), world_size=8, tp=2, infer_tp=2, infer_pp=2)
    assert inputs.infer_dp == 2
    infer = InferLayout(tp=2, pp=2)
    for rank in range(8):
        c = inputs.rank_coordinates(rank)
        assert (c["infer_tp_rank"], c["infer_pp_rank"], c["infer_dp_rank"]) == (
            infer.tp_rank(rank), infer.pp_rank(rank), infer.dp_rank(rank))
    # DP x PP x TP, TP fastest: rank 6 = DP 1, PP 1, TP 0.
    assert [inputs.rank_coordinates(r)["infer_pp_rank"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert inputs.rank_coordinates(6)["infer_dp_rank"] == 1
    with pytest.raises(ValueError, match=r"infer TP\*PP=2\*2=4 must divide the world size 6"):
        PlanInputs(arch=_tiny(), world_size=6, infer_tp=2, infer_pp=2)
    with pytest.raises(ValueError, match=r"infer TP\*PP=1\*4=4 must divide the world size 2"):
        PlanInputs(arch=_tiny(), world_size=2, infer_pp=4)


@pytest.mark.parametrize("layout", [  # (layers, tied, world, infer tp, infer pp, dtype)
    (4, False, 2, 1, 2, "float32"),
    (4, True, 2, 1, 2, "float32"),  # vLLM's Qwen2 builds the tied head's embedding on the last stage too
    (4, False, 4, 1, 4, "bfloat16"),
    (6, False, 4, 1, 4, "float32"),  # vLLM splits 6 layers [1, 2, 2, 1]
    (5, True, 8, 2, 2, "float32"),  # [3, 2], infer TP2 x PP2 x DP2
], ids=lambda layout: "-".join(map(str, layout)))
def test_infer_pp_weights_are_each_stages_vllm_layout(layout, vllm_partition):
    layers, tied, world, tp, pp, dtype = layout
    arch = _tiny(num_hidden_layers=layers, tie_word_embeddings=tied)
    size = {"float32": 4, "bfloat16": 2}[dtype]
    plan = plan_memory(PlanInputs(arch=arch, world_size=world, infer_tp=tp, infer_pp=pp, infer_dtype=dtype))
    infer = InferLayout(tp=tp, pp=pp)
    for rank in plan.ranks:
        assert rank.pushed_weight_bytes == _vllm_stage_bytes(arch, infer, world, rank.rank, size), rank.rank
    # Stages partition an untied model: they add up to the PP1 shard (tied: the last stage's extra embedding).
    whole = size * vllm_numel(arch, tp=tp, tp_rank=0, dp=1, dp_rank=0, expert_parallel=False)
    stages = sum(plan.ranks[stage * tp].pushed_weight_bytes for stage in range(pp))
    assert stages == whole + (size * arch.hidden_size * 64 // tp if tied else 0)  # the 16-row vocabulary padded to 64


@pytest.mark.parametrize("infer_pp, world, expert_parallel", [(2, 2, False), (2, 4, True)])
def test_infer_pp_moe_weights_add_what_vllms_qwen3_moe_allocates_on_every_stage(infer_pp, world, expert_parallel,
                                                                                vllm_partition):
    arch = _tiny_moe()  # untied, 2 layers, h64, vocabulary 16 padded to 64
    plan = plan_memory(PlanInputs(arch=arch, world_size=world, infer_pp=infer_pp,
                                  infer_expert_parallel=expert_parallel))
    infer = InferLayout(pp=infer_pp, expert_parallel=expert_parallel)
    h, rows = 64, 64
    for rank in plan.ranks:
        stage = infer.pp_rank(rank.rank)
        # vLLM 0.32's Qwen3MoeForCausalLM builds embed_tokens, norm and lm_head whatever the stage; the layout (what
        # the switch fills) has them on the first / last stage only.
        unread = rows * h if stage > 0 else h + rows * h
        assert rank.pushed_weight_bytes == _vllm_stage_bytes(arch, infer, world, rank.rank, 4) + 4 * unread


def test_infer_pp_kv_cache_holds_the_stages_layers(vllm_partition):
    arch = _tiny(num_hidden_layers=5)  # vLLM: stage 0 layers 0-2, stage 1 layers 3-4
    assert [len(vllm_pp_layers(5, stage, 2)) for stage in (0, 1)] == [3, 2]
    gpu = KVCacheSpec(on_cpu=False, max_num_seqs=8, max_model_len=64)
    inputs = PlanInputs(arch=arch, world_size=4, infer_tp=2, infer_pp=2, kv=gpu)
    per_layer = 2 * (2 // 2) * 32 * 4  # K and V of 1 of the 2 KV heads per TP rank, head_dim 32, fp32
    plan = plan_memory(inputs)
    assert [r.states["kv_cache"] for r in plan.ranks] == [8 * 64 * per_layer * n for n in (3, 3, 2, 2)]
    assert kv_needed_bytes(inputs) == kv_needed_bytes(inputs, 0) == 8 * 64 * per_layer * 3  # the largest stage
    assert kv_needed_bytes(inputs, 1) == 8 * 64 * per_layer * 2
    # A device size: vLLM's share minus the stage's own weights, per rank.
    sized = plan_memory(replace(inputs, device_memory=1 << 30))
    for rank in sized.ranks:
        assert rank.states["kv_cache"] + rank.states["inference_weights"] == (1 << 30) // 2
    # On CPU the cache is the configured size whatever the stage.
    cpu = plan_memory(replace(inputs, kv=KVCacheSpec(on_cpu=True, cpu_bytes=3 << 20)))
    assert {r.states["kv_cache"] for r in cpu.ranks} == {3 << 20}
    # MLA (DeepSeek-V3, 61 layers -> vLLM PP2 [31, 30]): the latent and the rope key of the stage's layers.
    deepseek = PlanInputs(arch=_arch("deepseek_v3"), world_size=2, infer_pp=2, infer_dtype="bfloat16",
                          kv=KVCacheSpec(on_cpu=False, max_num_seqs=1, max_model_len=1))
    assert [kv_needed_bytes(deepseek, stage) for stage in (0, 1)] == [n * (512 + 64) * 2 for n in (31, 30)]


def test_infer_pp_deepseek_stages_add_up_to_the_whole_model():
    arch = _arch("deepseek_v3")  # untied: the embedding on the first stage, norm and head on the last
    whole = vllm_numel(arch, tp=8, tp_rank=0, dp=1, dp_rank=0, expert_parallel=True)
    stages = [vllm_numel(arch, tp=8, tp_rank=0, dp=1, dp_rank=0, expert_parallel=True, pp=4, pp_rank=p)
              for p in range(4)]
    assert sum(stages) == whole
    vocab_rows = -(-arch.vocab_size // 64) * 64 // 8
    # vLLM splits 61 layers [15, 15, 16, 15]: stages 1 and 3 hold 15 MoE layers, the last also the norm and head.
    assert [len(vllm_pp_layers(61, p, 4)) for p in range(4)] == [15, 15, 16, 15]
    assert stages[3] == stages[1] + arch.hidden_size + vocab_rows * arch.hidden_size


def _predict(config_name: str, device: str = "cpu"):
    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config import load_config
    from mindspeed_rl.planner.from_config import predict_run, resolve_hf_config

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = load_config(compose(config_name=config_name))
    return predict_run(config, resolve_hf_config(config).hf_config, device=device)


def test_the_infer_pp2_demo_predicts_each_stages_weights_and_kv(vllm_partition):
    from mindspeed_rl.planner.report import json_report, text_report

    plan = _predict("grpo_tiny_cpu_infer_pp2")  # train TP2, infer PP2 on 2 ranks: a layer per stage
    dp2 = _predict("grpo_tiny_cpu_tp2_infer_dp2")  # the same model and ranks, infer TP1 x DP2: the whole model
    assert (plan.inputs.infer_tp, plan.inputs.infer_pp, plan.inputs.infer_dp) == (1, 2, 1)
    arch, infer = plan.inputs.arch, InferLayout(pp=2)
    weights = [r.pushed_weight_bytes for r in plan.ranks]
    assert weights == [_vllm_stage_bytes(arch, infer, 2, rank, 4) for rank in (0, 1)]
    whole = dp2.ranks[0].pushed_weight_bytes
    assert sum(weights) == whole  # untied: the stages partition the model
    assert all(abs(w - whole / 2) <= 4 * arch.hidden_size for w in weights)  # about half: they differ by the norm
    # On an accelerator (no device size) a stage's KV cache is max_num_seqs x max_model_len tokens of its one layer.
    accelerator = _predict("grpo_tiny_cpu_infer_pp2", device="cuda")
    per_layer = 2 * 2 * 32 * 4  # K and V, 2 KV heads of 32, fp32
    assert [r.states["kv_cache"] for r in accelerator.ranks] == [128 * 32 * per_layer] * 2
    whole_model_kv = _predict("grpo_tiny_cpu_tp2_infer_dp2", device="cuda").ranks[0].states["kv_cache"]
    assert whole_model_kv == 128 * 32 * per_layer * 2
    report = dict(model_name="tiny_qwen2", source="the model block", switch=None, suggestions=None,
                  h2d_bytes_per_second=1e9, link_bytes_per_second=1e9)
    assert "  infer TP1 x PP2 x DP1, float32; " in text_report(plan, **report)
    assert "  infer TP1 x DP2, float32; " in text_report(dp2, **report)
    layout = json_report(plan, **report)["layout"]
    assert (layout["infer_tp"], layout["infer_pp"], layout["infer_dp"]) == (1, 2, 1)


# -- against a live Megatron engine (1 rank) ----------------------------------------------------------------
def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _live_engine(world, arch, *, bf16: bool, distributed: bool, packed: bool = False, recompute=None):
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.qwen2 import ModelOptions
    from mindspeed_rl.models.layouts import hf_shapes

    spec = arch.to_spec()
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=generator) * 0.05 for k, s in hf_shapes(spec).items()}
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                 clip_grad=1.0, use_distributed_optimizer=distributed)
    return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          accelerator=world, parallel=megatron_state.current(), optimizer=settings,
                          options=ModelOptions(packed_sequences=packed, **(recompute or {})))


def _train_once(engine, vocab: int, *, samples: int, prompt: int, response: int, micro_batch_size: int,
                packing=None):
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig
    from mindspeed_rl.protocol import RolloutBatch
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch

    generator = torch.Generator().manual_seed(1)
    batch = RolloutBatch.from_token_lists(
        [torch.randint(1, vocab, (prompt,), generator=generator).tolist() for _ in range(samples)],
        [torch.randint(1, vocab, (response,), generator=generator).tolist() for _ in range(samples)],
        pad_id=0, response_width=response)
    for column in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        batch.columns[column] = torch.zeros(batch.response_logprobs_shape)
    batch.columns["advantages"] = torch.randn(samples, generator=generator)
    config = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.001, entropy_coeff=0.0,
                            loss_agg_mode="token-mean")
    train_on_mini_batch(engine, batch, config, micro_batch_size=micro_batch_size, temperature=1.0, packing=packing)


@pytest.mark.parametrize("arch, bf16, distributed", [
    (_tiny(hidden_size=96, intermediate_size=200, num_hidden_layers=2, vocab_size=40), True, True),
    (_tiny_moe(hidden_size=96, head_dim=24, vocab_size=40, moe_intermediate_size=40), True, True),
    (_tiny(num_hidden_layers=2), False, False),
], ids=["dense-bf16-distopt-padded", "moe-bf16-distopt-padded", "dense-fp32"])
def test_train_states_equal_a_live_engines_tensors(world, arch, bf16, distributed):
    """Sizes that are not multiples of 64 put the distributed optimizer's padding where the planner says."""
    from mindspeed_rl.memory.megatron_states import grad_buffer_tensors, optimizer_state_tensors, param_tensors

    engine = _live_engine(world, arch, bf16=bf16, distributed=distributed)
    _train_once(engine, arch.vocab_size, samples=4, prompt=5, response=3, micro_batch_size=4)  # Adam's moments
    predicted = train_state_bytes(megatron_params(arch, tp=1, tp_rank=0, pp=1, pp_rank=0), bf16=bf16,
                                  distributed_optimizer=distributed, dp_cp=1, expert_dp=1, dp_cp_rank=0,
                                  expert_dp_rank=0)
    assert predicted.params == _storage_bytes(param_tensors(engine.module))
    assert predicted.grads == _storage_bytes(grad_buffer_tensors(engine.model))
    assert predicted.optimizer == _storage_bytes(optimizer_state_tensors(engine.optimizer))
    assert predicted.reference == sum(p.numel() * p.element_size() for p in engine.module.parameters())


@pytest.mark.parametrize("bf16, distributed", [(True, True), (False, False)], ids=["bf16-distopt", "fp32"])
def test_the_critics_states_equal_a_live_critics_tensors(world, bf16, distributed):
    """PPO's critic: the trunk without the LM head, the hidden -> 1 value head, its DDP grads and Adam states."""
    from mindspeed_rl.algorithms.ppo import clipped_value_loss
    from mindspeed_rl.engines.critic import CriticEngine
    from mindspeed_rl.engines.megatron_engine import OptimizerSettings
    from mindspeed_rl.memory.megatron_states import grad_buffer_tensors, optimizer_state_tensors, param_tensors
    from mindspeed_rl.planner.params import stage_critic_bytes
    from mindspeed_rl.protocol import RolloutBatch
    from mindspeed_rl.models.layouts import hf_shapes

    arch = _tiny(hidden_size=96, intermediate_size=200, num_hidden_layers=2, vocab_size=40)
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator) * 0.05 for k, shape in hf_shapes(arch.to_spec()).items()}
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                 clip_grad=1.0, use_distributed_optimizer=distributed)
    critic = CriticEngine(spec=arch.to_spec(), hf_state=state, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          accelerator=world, parallel=megatron_state.current(), optimizer=settings)
    batch = RolloutBatch.from_token_lists([[1, 2, 3]] * 2, [[4, 5], [6]], pad_id=0, response_width=2)
    batch.columns.update(values=torch.zeros(2, 2), returns=torch.ones(2, 2))
    critic.train_step(batch, micro_batch_size=2, loss_fn=lambda values, mb: clipped_value_loss(
        values, mb.extras["values"], mb.extras["returns"], mb.response_mask, cliprange_value=0.5,
        loss_agg_mode="token-mean", denominator=3.0, mini_batch_tokens=3.0))  # Adam's moments
    predicted = stage_critic_bytes(arch, tp=1, pp=1, pp_rank=0, dp_cp=1, bf16=bf16, distributed_optimizer=distributed,
                                   dp_cp_rank=0)
    assert predicted.params == _storage_bytes(param_tensors(critic.module))
    assert predicted.grads == _storage_bytes(grad_buffer_tensors(critic.model))
    assert predicted.optimizer == _storage_bytes(optimizer_state_tensors(critic.optimizer))


def test_activation_estimate_against_the_activation_meter(world):
    """Dimensions other than the demo's: the measured coefficients carry over (fp32, TP1, one micro-batch)."""
    arch = _tiny(vocab_size=48, hidden_size=64, intermediate_size=320, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=2)
    predicted = activation_bytes(PlanInputs(arch=arch, world_size=1, micro_batch_size=6, mini_batch_samples=6,
                                            seq_length=12, response_length=5), 0)
    measured = _measured_activation_bytes(world, arch)
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)


def test_the_vocabulary_costs_e_bytes_per_response_token_and_no_more(world):
    """The log-prob path keeps only the logits' response rows: 100x the vocabulary adds exactly 4 B (fp32) x the
    vocabulary growth x the response tokens, nothing per prompt token and no fp32 copy of every position."""
    shape = dict(hidden_size=64, intermediate_size=320, num_hidden_layers=1, num_attention_heads=8,
                 num_key_value_heads=2)
    small, large = (_measured_activation_bytes(world, _tiny(vocab_size=v, **shape)) for v in (48, 4800))
    assert large - small == 4 * (4800 - 48) * 6 * 5  # fp32, 6 samples x 5 response tokens


def test_packed_activation_estimate_against_the_activation_meter(world):
    """Packed micro-batches (per-sample attention: no score matrix), one of micro_batch_size samples and, with a
    token budget, several of at most the budget's tokens."""
    from mindspeed_rl.protocol import Packing

    arch = _tiny(vocab_size=48, hidden_size=64, intermediate_size=320, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=2)
    inputs = PlanInputs(arch=arch, world_size=1, micro_batch_size=6, mini_batch_samples=6, seq_length=50,
                        response_length=20, packed=True)
    measured = _measured_activation_bytes(world, arch, prompt=30, response=20, packing=Packing())
    assert abs(activation_bytes(inputs, 0) - measured) / measured < 0.05, (activation_bytes(inputs, 0), measured)
    budget = replace(inputs, packing_token_budget=100)  # 6 samples of 50 tokens: 3 micro-batches of 2
    assert budget.micro_batches_per_step == 3
    measured = _measured_activation_bytes(world, arch, prompt=30, response=20, packing=Packing(max_tokens=100))
    assert abs(activation_bytes(budget, 0) - measured) / measured < 0.05, (activation_bytes(budget, 0), measured)


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    dict(recompute_granularity="selective"),
], ids=["full-uniform-1", "full-uniform-3", "full-block-1", "full-block-2", "selective"])
def test_recompute_activation_estimate_against_the_activation_meter(world, recompute):
    """Full recompute keeps each recomputed chunk's input and rebuilds the chunk in backward, after the layers above
    it have been freed (measured here: uniform-1 keeps 34% of the activations without recompute, block-1 68%)."""
    arch = _tiny(vocab_size=48, hidden_size=64, intermediate_size=320, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=2)
    inputs = PlanInputs(arch=arch, world_size=1, micro_batch_size=6, mini_batch_samples=6, seq_length=40,
                        response_length=10, **recompute)
    measured = _measured_activation_bytes(world, arch, prompt=30, response=10, recompute=recompute)
    assert abs(activation_bytes(inputs, 0) - measured) / measured < 0.03, (activation_bytes(inputs, 0), measured)


def _measured_activation_bytes(world, arch, *, prompt: int = 7, response: int = 5, packing=None, recompute=None) -> int:
    import itertools as it

    from mindspeed_rl.memory import ActivationMeter
    from mindspeed_rl.memory.megatron_states import grad_buffer_tensors, optimizer_state_tensors, param_tensors

    engine = _live_engine(world, arch, bf16=False, distributed=False, packed=packing is not None, recompute=recompute)
    shape = dict(samples=6, prompt=prompt, response=response, micro_batch_size=6, packing=packing)
    _train_once(engine, arch.vocab_size, **shape)
    keep = it.chain(param_tensors(engine.module), grad_buffer_tensors(engine.model),
                    optimizer_state_tensors(engine.optimizer))
    with ActivationMeter({t.untyped_storage()._cdata for t in keep}) as meter:
        _train_once(engine, arch.vocab_size, **shape)
    return meter.peak_bytes


# -- the CLI --------------------------------------------------------------------------------------------------
def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli/plan.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cli_on_the_7b_recipe_fits_its_64gb_devices_with_the_kernels_it_selects():
    done = _plan_cli("--config-name", "grpo_qwen25_7b_A3", "--device-memory", "64GiB")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Qwen2ForCausalLM, 7.62B parameters" in out and "layout: 16 devices" in out
    assert "train TP2 x PP2 x DP4" in out and "infer TP1 x DP16" in out and "accelerator activation profile" in out
    for row in ("train params", "train grads", "optimizer", "reference params", "inference weights", "KV cache",
                "activations", "total"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert "device memory 64.00 GiB: FITS" in out
    assert "switch train -> infer (the resharding plan" in out


def test_cli_on_the_7b_recipe_with_the_cpu_profile_suggests_a_layout_that_fits():
    done = _plan_cli("--config-name", "grpo_qwen25_7b_A3", "--device-memory", "64GiB", "--profile", "cpu")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "device memory 64.00 GiB: DOES NOT FIT (short by 13.87 GiB)" in lines  # unfused kernels keep more
    first = lines[lines.index(next(l for l in lines if l.startswith("would fit with"))) + 1]
    overrides = first.split("->")[0].split()
    again = _plan_cli("--config-name", "grpo_qwen25_7b_A3", "--device-memory", "64GiB", "--profile", "cpu", *overrides)
    assert again.returncode == 0, again.stderr
    assert "device memory 64.00 GiB: FITS" in again.stdout, (overrides, again.stdout[-3000:])


def test_accelerator_profile_is_the_published_per_layer_count():
    """Korthikanti et al. 2022 Table 2 (34 s b h / t with sequence parallel) counted for Qwen2.5-7B's GQA + SwiGLU,
    bf16, TP2 with sequence parallel, flash attention: the two norms' inputs 2 x 2h, the QKV and MLP inputs 2h
    each, Q 2q, K and V 2 x 2kv, the attention output 2q, gate and up 2 x 2f, fc2's input 2f; all over TP."""
    arch = _arch("qwen25_7b")
    inputs = PlanInputs(arch=arch, world_size=2, tp=2, bf16=True, sequence_parallel=True, flash_attention=True,
                        seq_length=4096, activation_profile="accelerator")
    h, q, kv, f = 3584, 28 * 128, 4 * 128, 18944
    assert activation_terms(inputs).dense_layer == (4 * h + 4 * h + 2 * q + 4 * kv + 2 * q + 6 * f) / 2 == 79360
    # The paper's own block (MHA: q = kv = h; a GeLU MLP of f = 4h keeps fc1's output and GeLU's, 2 x 2f instead
    # of SwiGLU's 3 x 2f) counts to its 34 h less the two dropout masks (h each), which RL runs without.
    gpt_mha_gelu = 4 * h + 4 * h + 2 * h + 4 * h + 2 * h + 2 * 2 * (4 * h)
    assert gpt_mha_gelu == (34 - 2) * h
    assert activation_terms(replace(inputs, activation_profile="cpu")).dense_layer > activation_terms(inputs).dense_layer


def test_cli_json_and_bad_input():
    done = _plan_cli("--config-name", "grpo_tiny_cpu_tp2_infer_dp2", "--json", "-")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["layout"]["tp"] == 2 and document["layout"]["infer_dp"] == 2 and document["fits"] is None
    assert document["phases"]["generate"]["kv_cache"] == 32 << 20  # cpu_kvcache_space_gb 0.03125
    assert [r["received_bytes"] for r in document["switch"]["ranks"]] == [599040, 599040]  # the other TP half
    bad = _plan_cli("--config-name", "grpo_tiny_cpu", "--device-memory", "lots")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == ["config error: --device-memory: 'lots' is not a size like 64GiB, 80GB or 1.5TiB"]


def test_a_critic_of_its_own_is_planned_on_its_devices_with_its_states_in_every_phase():
    """critic.device_mapping apart (ppo_tiny_cpu_critic_devices): the critic's device holds its params, grads and Adam
    states in every phase (the live run's ledger shows the same, test_train_ppo_e2e), the actor's device none, and
    nothing of it moves between host and device."""
    from mindspeed_rl.memory.residency import CRITIC_STATES
    from mindspeed_rl.planner.from_config import plan_config
    from tests.test_config import load

    config = load("ppo_tiny_cpu_critic_devices")
    plan, _ = plan_config(config, _tiny(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=64))
    colocated, _ = plan_config(load("ppo_tiny_cpu"), _tiny(hidden_size=128, intermediate_size=256,
                                                           num_hidden_layers=2, vocab_size=64))
    actor_device, critic_device = plan.ranks
    assert critic_device.rank == 1 and plan.inputs.critic_world_size == 1
    for phase in plan.table_phases:
        on_critic = plan.rank_phase(critic_device, phase)
        assert all(on_critic[state] > 0 for state in CRITIC_STATES), phase
        assert all(plan.rank_phase(actor_device, phase)[state] == 0 for state in CRITIC_STATES), phase
    # Its states are the colocated critic's (fp32, no distributed optimizer: the same on every DP rank).
    assert all(critic_device.states[state] == colocated.ranks[0].states[state] for state in CRITIC_STATES)


def test_with_lora_the_adapters_are_their_own_row_and_the_switch_after_the_first_moves_only_them():
    """grpo_tiny_cpu_lora (colocated, TP2): the adapters are their own state group (the ledger's
    `adapter_params`, equal to this in test_train_lora_e2e); the switch's row is charged at its first push, which
    reads the backbone too; every later switch brings only the adapters to the device."""
    from mindspeed_rl.memory.residency import ADAPTER_PARAMS, TRAIN_PARAMS
    from mindspeed_rl.planner.from_config import plan_config
    from mindspeed_rl.planner.switch import iteration_moves
    from tests.test_config import load

    config = load("grpo_tiny_cpu_lora")
    plan, _ = plan_config(config, _tiny(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=64))
    rank = plan.ranks[0]
    adapters, backbone = rank.states[ADAPTER_PARAMS], rank.states[TRAIN_PARAMS]
    assert 0 < adapters < backbone
    policy = plan.inputs.policy
    assert policy.adapter_only_switch and policy.resident("switch") == {ADAPTER_PARAMS, "inference_weights"}
    switch = plan.rank_phase(rank, "switch")
    assert switch[TRAIN_PARAMS] == backbone and switch[ADAPTER_PARAMS] == adapters  # the first push's row
    into_switch = next(move for move in iteration_moves(plan.inputs, rank.states) if move.after == "switch")
    assert into_switch.onload == adapters
