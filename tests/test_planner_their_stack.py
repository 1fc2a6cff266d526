"""The two MindSpeed-RL keys the planner plans for while this engine runs its own way (issue 39, item 2):
generate_config.expert_map_path (EPLB's redundant experts in the inference weights of the ranks that hold them) and
actor_config.context_parallel_algo (the CP exchange's buffers in the update's activations). Each figure is checked
against its formula (planner/expert_map.py, planner/activations.py)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from eplb_maps import round_robin_placement, write_expert_map
from mindspeed_rl.config import ConfigError
from mindspeed_rl.config.no_effect import NO_EFFECT_KEYS
from mindspeed_rl.memory.residency import INFER_WEIGHTS, KV_CACHE
from mindspeed_rl.planner.activations import activation_bytes, activation_terms
from mindspeed_rl.planner.arch import from_hf_config
from mindspeed_rl.planner.expert_map import expert_slots, read_expert_map, vllm_expert_numel
from mindspeed_rl.planner.from_config import plan_inputs, planned_for_their_stack
from mindspeed_rl.planner.inputs import CP_GATHER, KVCacheSpec, PlanInputs
from mindspeed_rl.planner.memory import plan_memory
from mindspeed_rl.sizes import GIB
from test_mindspeed_rl_recipes import load_recipe

REPO = Path(__file__).resolve().parents[1]
HF = REPO / "configs" / "model" / "hf"
SMOKE_MAP = REPO / "tests" / "data" / "eplb" / "tiny_deepseek_v3_ep2_expert_map.json"
EPLB_RECIPE, CP_RECIPE = "grpo_deepseek_r1_671b_A3_eplb", "dapo_qwen25_32b_A3_32k"


def _moe(**overrides):
    """A Qwen3-MoE of 2 MoE layers, 4 experts of width 32 over hidden 64."""
    config = dict(model_type="qwen3_moe", vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    return from_hf_config({**config, **overrides})


def _deepseek_v3():
    return from_hf_config(json.loads((HF / "deepseek_v3.json").read_text()))


# -- generate_config.expert_map_path ------------------------------------------------------------------------------
# [MoE layer][EP rank]: rank 0 holds a second expert in layer 0, rank 1 in layer 1, rank 3 in both; rank 2 lists its
# own expert twice, which vllm-ascend allocates once (its local_num_experts counts distinct experts).
PLACEMENT = [[[0, 1], [1, 1], [2, 2], [3, 0]],
             [[0, 0], [1, 2], [2, 2], [3, 1]]]
EXTRA_EXPERTS = {0: 1, 1: 1, 2: 0, 3: 2}


def _eplb_inputs(tmp_path: Path, *, placement=PLACEMENT) -> PlanInputs:
    arch = _moe()
    slots = expert_slots(read_expert_map(str(write_expert_map(tmp_path / "map.json", placement))), arch, ep_size=4,
                         expert_parallel=True)
    return PlanInputs(arch=arch, world_size=4, infer_expert_parallel=True, infer_dtype="bfloat16", bf16=True,
                      expert_slots=slots, kv=KVCacheSpec(on_cpu=False, gpu_memory_utilization=0.5),
                      device_memory=GIB)


def test_a_map_puts_the_redundant_experts_bytes_on_exactly_the_ranks_that_hold_them(tmp_path):
    inputs = _eplb_inputs(tmp_path)
    with_map, even = plan_memory(inputs), plan_memory(replace(inputs, expert_slots=None))
    expert_bytes = 3 * 64 * 32 * 2  # w13 (2F x H) + w2 (H x F), bf16
    for rank in range(4):
        extra = with_map.ranks[rank].states[INFER_WEIGHTS] - even.ranks[rank].states[INFER_WEIGHTS]
        assert extra == EXTRA_EXPERTS[rank] * expert_bytes, rank


def test_the_kv_cache_of_a_rank_with_redundant_experts_gives_up_their_bytes(tmp_path):
    """vLLM's share (gpu_memory_utilization x device) holds the weights first: each redundant expert is KV cache less."""
    inputs = _eplb_inputs(tmp_path)
    with_map, even = plan_memory(inputs), plan_memory(replace(inputs, expert_slots=None))
    for rank in range(4):
        assert (even.ranks[rank].states[KV_CACHE] - with_map.ranks[rank].states[KV_CACHE]
                == EXTRA_EXPERTS[rank] * vllm_expert_numel(inputs.arch) * 2), rank


def test_a_vllm_expert_is_whole_under_expert_parallelism():
    arch = _moe()
    assert vllm_expert_numel(arch) == 3 * arch.hidden_size * arch.moe_intermediate_size


def test_the_map_counts_its_redundant_experts_as_vllm_ascend_does(tmp_path):
    """get_global_redundant_expert_num: slots of a layer over all ranks - the logical experts."""
    path = write_expert_map(tmp_path / "map.json", round_robin_placement(2, 4, 4, 3))
    assert read_expert_map(str(path)).redundant_experts == 3 * 4 - 4


def test_a_missing_map_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^generate_config.expert_map_path: .*absent.json does not exist"):
        read_expert_map(str(tmp_path / "absent.json"))


@pytest.mark.parametrize("document, message", [
    ("not json", "not an expert map of vllm-ascend's format"),
    ('{"moe_layer_count": 2, "layer_list": []}', "moe_layer_count is 2 but layer_list has 0 layers"),
    (json.dumps({"moe_layer_count": 1, "layer_list": [{"device_list": [
        {"device_id": 0, "device_expert": [0, 1]}, {"device_id": 1, "device_expert": [2]}]}]}),
     "every layer needs the same device count and every device the same number of experts"),
])
def test_a_map_not_of_vllm_ascends_shape_is_a_config_error(tmp_path, document, message):
    path = tmp_path / "map.json"
    path.write_text(document)
    with pytest.raises(ConfigError, match=f"^generate_config.expert_map_path: .*{message}"):
        read_expert_map(str(path))


@pytest.mark.parametrize("placement, ep_size, message", [
    (round_robin_placement(3, 4, 4, 2), 4, "3 MoE layers, the model has 2"),
    (round_robin_placement(2, 4, 2, 2), 4, "2 devices per layer, vLLM's expert parallelism here is infer TP x DP = 4"),
    ([[[0], [1], [2], [2]]] * 2, 4, "MoE layer 0 must place each of the 4 experts"),
    ([[[0], [1], [2], [4]]] * 2, 4, "MoE layer 0 must place each of the 4 experts"),
])
def test_a_map_for_another_model_or_expert_parallel_size_is_a_config_error(tmp_path, placement, ep_size, message):
    expert_map = read_expert_map(str(write_expert_map(tmp_path / "map.json", placement)))
    with pytest.raises(ConfigError, match=f"^generate_config.expert_map_path: .*{message}"):
        expert_slots(expert_map, _moe(), ep_size=ep_size, expert_parallel=True)


def test_their_eplb_recipe_counts_the_map_on_an_accelerator_only(tmp_path):
    """The plan is for the user's devices (MindSpeed-RL's vllm-ascend places the map's experts); on CPU, and in the
    run's own prediction, what this engine's vLLM holds: the even share."""
    path = write_expert_map(tmp_path / "map.json", round_robin_placement(58, 256, 256, 2))
    config = load_recipe(EPLB_RECIPE, f"generate_config.expert_map_path={path}")
    arch = _deepseek_v3()
    planned = planned_for_their_stack(config, arch, cpu=False, profile="accelerator", this_engine=False)
    assert planned["expert_slots"] == ((2,) * 256,) * 58
    assert planned_for_their_stack(config, arch, cpu=True, profile="cpu", this_engine=False)["expert_slots"] is None
    assert planned_for_their_stack(config, arch, cpu=False, profile="accelerator",
                                   this_engine=True)["expert_slots"] is None


def test_their_eplb_recipe_as_shipped_plans_the_even_share_until_its_map_is_made():
    """Their map is made from their rollouts' expert loads and not published: the recipe as it is plans each device's
    even share (cli/plan.py says so); a run needs the file (trainer/setup.py reads it at start)."""
    config = load_recipe(EPLB_RECIPE)
    assert planned_for_their_stack(config, _deepseek_v3(), cpu=False, profile="accelerator",
                                   this_engine=False)["expert_slots"] is None


def test_the_recipe_smoke_tests_map_fits_the_tiny_deepseek_v3_at_ep2():
    """tests/recipe_smoke.py's tiny DeepSeek-V3: 3 layers, the first dense, 8 experts, vLLM EP2."""
    tiny = replace(_deepseek_v3(), num_layers=3, first_dense_layers=1, num_experts=8)
    assert expert_slots(read_expert_map(str(SMOKE_MAP)), tiny, ep_size=2, expert_parallel=True) == ((5, 5), (5, 5))


def test_a_run_with_a_map_says_at_start_that_vllm_here_places_experts_evenly(tmp_path):
    from mindspeed_rl.config.tolerated import warning_lines

    path = write_expert_map(tmp_path / "map.json", round_robin_placement(58, 256, 256, 2))
    lines = warning_lines(load_recipe(EPLB_RECIPE, f"generate_config.expert_map_path={path}"))
    assert [line for line in lines if "expert_map_path" in line] == [
        f"[config] note: generate_config.expert_map_path: {path} is planned for (cli/plan.py counts the redundant "
        "experts' weights on the ranks the map puts them on, on an accelerator); vLLM here places the experts evenly "
        "(num_experts / EP per rank) and holds no redundant copies"]


# -- actor_config.context_parallel_algo ---------------------------------------------------------------------------
def _cp_inputs(exchange: str, *, cp: int = 4, pp: int = 1) -> PlanInputs:
    """Qwen2.5-7B's attention (28 heads of 128, 4 KV heads) at TP2, bf16, flash attention, the accelerator profile."""
    arch = from_hf_config(json.loads((HF / "qwen25_7b.json").read_text()))
    return PlanInputs(arch=arch, world_size=2 * cp * pp, tp=2, pp=pp, cp=cp, cp_exchange=exchange, bf16=True,
                      flash_attention=True, activation_profile="accelerator", seq_length=8192, micro_batch_size=1,
                      mini_batch_samples=1)


# Per token and layer kept for backward, and held once by the running layer; e = 2, q = 3584, kv = 512, t = 2, CP 4.
E, Q_PER_RANK, KV_PER_RANK, CP = 2, 3584 / 2, 512 / 2, 4
CP_FORMULAS = {
    CP_GATHER: (2 * E * KV_PER_RANK * (CP - 1), 0.0),  # K and V gathered whole: cp times a rank's own
    "megatron_cp_algo": (0.0, 6 * 2 * E * KV_PER_RANK),  # 3 K/V pairs in the ring + their 3 gradient pairs
    "ulysses_cp_algo": (E * Q_PER_RANK, E * (Q_PER_RANK + 2 * KV_PER_RANK)),  # the output twice; a2a in and out
}


@pytest.mark.parametrize("exchange", sorted(CP_FORMULAS))
def test_each_cp_exchange_keeps_its_formulas_bytes_per_layer(exchange):
    kept, _ = CP_FORMULAS[exchange]
    without_cp = activation_terms(_cp_inputs(exchange, cp=1))
    assert activation_terms(_cp_inputs(exchange)).dense_layer - without_cp.dense_layer == pytest.approx(kept)


@pytest.mark.parametrize("exchange", sorted(CP_FORMULAS))
def test_each_cp_exchange_holds_its_formulas_buffers_in_flight(exchange):
    _, in_flight = CP_FORMULAS[exchange]
    assert activation_terms(_cp_inputs(exchange)).exchange_in_flight == pytest.approx(in_flight)
    assert activation_terms(_cp_inputs(exchange, cp=1)).exchange_in_flight == 0.0


@pytest.mark.parametrize("exchange", ["megatron_cp_algo", "ulysses_cp_algo"])
def test_the_buffers_in_flight_count_once_per_stage_not_per_layer(exchange):
    """activation_bytes: every layer's kept bytes, + the in-flight buffers once, x the rank's tokens (s / CP)."""
    gather, other = _cp_inputs(CP_GATHER), _cp_inputs(exchange)
    layers = other.arch.num_layers
    (kept_gather, _), (kept, in_flight) = CP_FORMULAS[CP_GATHER], CP_FORMULAS[exchange]
    expected = (layers * (kept - kept_gather) + in_flight) * other.tokens_per_micro_batch
    assert activation_bytes(other, 0) - activation_bytes(gather, 0) == pytest.approx(expected, abs=1)


def test_their_cp_recipe_plans_its_ring_with_the_accelerator_profile_and_this_engines_gather_on_cpu():
    config = load_recipe(CP_RECIPE, "runtime.device=npu")
    arch = from_hf_config(json.loads((HF / "qwen25_32b.json").read_text()))
    assert config.actor_config.context_parallel_algo == "megatron_cp_algo"
    assert plan_inputs(config, arch, device="npu").cp_exchange == "megatron_cp_algo"
    assert plan_inputs(config, arch, device="npu", profile="cpu").cp_exchange == CP_GATHER
    assert plan_inputs(config, arch, device="npu", this_engine=True).cp_exchange == CP_GATHER


def test_a_run_with_cp_and_an_algorithm_says_at_start_that_this_engine_gathers():
    from mindspeed_rl.config.tolerated import warning_lines

    assert [line for line in warning_lines(load_recipe(CP_RECIPE)) if "context_parallel_algo" in line] == [
        "[config] note: actor_config.context_parallel_algo: megatron_cp_algo is planned for (cli/plan.py counts its "
        "buffers on an accelerator); this engine's context parallelism gathers each layer's keys and values over the "
        "CP ranks instead (the same attention; models/context_parallel.py)"]


@pytest.mark.parametrize("override, message", [
    ("actor_config.context_parallel_algo=hybrid_cp_algo", "hybrid_cp_algo is refused with context_parallel_size > 1"),
    ("actor_config.context_parallel_algo=ring", "must be one of megatron_cp_algo, ulysses_cp_algo"),
])
def test_an_algorithm_mindspeed_rl_refuses_at_cp_above_1_is_a_config_error(override, message):
    with pytest.raises(ConfigError, match=f"actor_config.context_parallel_algo: {message}"):
        load_recipe(CP_RECIPE, override)


# -- actor_config.moe_tp_extend_ep ----------------------------------------------------------------------------------
def test_tp_extended_experts_keep_each_tp_ranks_own_dispatched_tokens():
    """MindSpeed's moe_tp_extend_ep with sequence parallelism: a rank dispatches its own s/TP tokens, k copies of each
    (2 e k h / TP bytes per token of the micro-batch); Megatron's TP-split experts see the TP group's every token."""
    arch = _moe()
    inputs = PlanInputs(arch=arch, world_size=4, tp=4, bf16=True, sequence_parallel=True,
                        activation_profile="accelerator")
    extended = replace(inputs, moe_tokens_split_over_tp=True)
    saved = activation_terms(inputs).moe_layer - activation_terms(extended).moe_layer
    assert saved == pytest.approx(2 * 2 * arch.moe_topk * arch.hidden_size * (1 - 1 / 4))
    assert activation_terms(inputs).dense_layer == activation_terms(extended).dense_layer


def test_their_moe_recipes_plan_tp_extended_experts_on_their_devices_and_this_engines_split_on_cpu():
    config = load_recipe("grpo_deepseek_r1_671b_A2", "runtime.device=npu")
    arch = _deepseek_v3()
    assert config.actor_config.moe_tp_extend_ep and config.megatron_training.sequence_parallel
    assert plan_inputs(config, arch, device="npu").moe_tokens_split_over_tp
    assert not plan_inputs(config, arch, device="npu", profile="cpu").moe_tokens_split_over_tp
    assert not plan_inputs(config, arch, device="npu", this_engine=True).moe_tokens_split_over_tp


# -- the no-effect table --------------------------------------------------------------------------------------------
def test_no_key_planned_for_is_listed_as_having_no_effect():
    assert {"actor_config.context_parallel_algo", "generate_config.expert_map_path",
            "actor_config.moe_tp_extend_ep"}.isdisjoint(NO_EFFECT_KEYS)


@pytest.mark.parametrize("name, key", [(CP_RECIPE, "actor_config.context_parallel_algo"),
                                       (EPLB_RECIPE, "generate_config.expert_map_path"),
                                       ("grpo_deepseek_r1_671b_A2", "actor_config.moe_tp_extend_ep")])
def test_their_recipes_keep_the_key_for_the_schema_instead_of_listing_it(name, key):
    notices: list[str] = []
    config = load_recipe(name, notices=notices)
    assert key not in {notice.split(" ", 1)[0] for notice in notices}
    section, field = key.split(".")
    assert getattr(getattr(config, section), field) is not None
