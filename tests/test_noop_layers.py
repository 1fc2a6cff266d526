"""MindSpeed's no-op layers (`actor_config.noop_layers` with the padded `actor_config.num_layers`) are read as the
uneven pipeline stages they amount to (config/noop_layers.py): identity layers compute nothing, so the stages hold
the real layers the padded layout gives them. Their Qwen3-235B-A22B recipe (94 layers padded to 96 at PP16,
`noop_layers: "5,95"`, verbatim in tests/data/mindspeed_rl_recipes) loads unchanged and plans.

Runs where: in process (config loading and the planner; no model is built)."""
import pytest


from mindspeed_rl.config.noop_layers import lift_noop_layers
from tests.test_mindspeed_rl_recipes import load_recipe, load_tiny


def _tree(noop, *, pp=4, padded=None, real=10, **actor):
    actor_config = {"model": "m", "pipeline_model_parallel_size": pp, "noop_layers": noop, **actor}
    if padded is not None:
        actor_config["num_layers"] = padded
    return {"model": {"m": {"num_layers": real}}, "actor_config": actor_config}


def test_the_padded_layout_splits_the_real_layers_as_it_splits_the_padded_ones():
    tree = _tree("0,11", padded=12)  # 12 padded layers, 3 per stage; stage 0 and stage 3 lose one each
    assert lift_noop_layers(tree) == []
    assert tree["actor_config"]["num_layer_list"] == "2,3,3,2"
    assert "noop_layers" not in tree["actor_config"] and "num_layers" not in tree["actor_config"]


@pytest.mark.parametrize("noop,padded,real,expected", [
    ("0,11", 13, 10, "actor_config.num_layers: with 2 no-op layers (0,11) it must be the model's 10 layers + 2 = 12, "
                     "got 13"),
    ("0,12", 12, 10, "actor_config.noop_layers: layer indices must be in [0, 12), got '0,12'"),
    ("a,b", 12, 10, "actor_config.noop_layers: expected comma-separated layer indices"),
    ("0,1,2,3", 12, 8, "actor_config.noop_layers: pipeline stage 0 would hold no real layer"),
    ("0,1", 10, 8, "actor_config.noop_layers: the padded 10 layers must split evenly over pipeline_model_parallel_size=4"),
])
def test_a_layout_that_does_not_add_up_is_one_config_error(noop, padded, real, expected):
    (error,) = lift_noop_layers(_tree(noop, padded=padded, real=real))
    assert str(error).startswith(expected), error


def test_the_same_layout_with_num_layer_list_too_is_an_error():
    (error,) = lift_noop_layers(_tree("0,11", padded=12, num_layer_list="2,3,3,2"))
    assert str(error) == "actor_config.noop_layers: give either noop_layers (with num_layers) or num_layer_list, not both"


def test_through_the_loader_the_stages_reach_the_actor_config():
    """The tiny demo's 2 layers padded to 4 at PP2 (layers 0 and 3 no-op): one real layer per stage."""
    config = load_tiny("actor_config.pipeline_model_parallel_size=2", "rl_config.actor_resource.num_npus=2",
                       "actor_config.noop_layers='0,3'",
                       "actor_config.num_layers=4")
    assert config.actor_config.pipeline_stage_layers == (1, 1)


def test_their_235b_recipe_loads_unchanged_with_the_stages_its_no_op_layers_give():
    """grpo_qwen3_235b_a22b_A2: Qwen3-235B-A22B's 94 layers padded to 96 at PP16 (layers 5 and 95 no-op)."""
    from mindspeed_rl.planner.arch import from_hf_config, hf_config_from_model_block
    from mindspeed_rl.planner.from_config import plan_inputs
    from mindspeed_rl.planner.params import megatron_params

    config = load_recipe("grpo_qwen3_235b_a22b_A2", "runtime.device=npu")
    assert config.actor_config.pipeline_stage_layers == (5,) + (6,) * 14 + (5,)
    arch = from_hf_config(hf_config_from_model_block(config.selected_model, "qwen3_235b_a22b"))
    inputs = plan_inputs(config, arch, device="npu")
    layers = [{p.name.split(".")[2] for p in megatron_params(inputs.arch, tp=2, tp_rank=0, pp=16, pp_rank=rank, ep=4)
               if p.name.startswith("decoder.layers.")} for rank in (0, 1, 15)]
    assert [len(stage) for stage in layers] == [5, 6, 5]


def test_on_cpu_their_235b_layout_loads():
    """TP2 x PP16 with packed micro-batches: the alltoall MoE dispatcher's uneven all-gather over the expert-TP ranks
    runs on gloo through CPU patch P8 (test_packing_multiprocess: TP2 x PP2 packed = padded)."""
    config = load_recipe("grpo_qwen3_235b_a22b_A2", "runtime.device=cpu")
    assert (config.actor_config.tensor_model_parallel_size, config.actor_config.pipeline_model_parallel_size) == (2, 16)
    assert config.rl_config.use_remove_padding
