"""MindSpeed-RL's recipes shrunk by command-line overrides only, as a migrating user's first smoke test: a tiny
checkpoint of the recipe's own architecture, 2 devices with one of the recipe's own parallel kinds kept, short
lengths and small batches, every feature left as the recipe sets it (bf16, the distributed optimizer, packing,
dynamic batch sizes, dynamic sampling, LoRA, the critic, multi-turn tools). docs/configuration.md lists the same
overrides as the migration recipe ("Smoke-test your recipe on CPU").

`smoke_overrides(name, assets, save=...)` is the whole command line after `--config-dir ... --config-name NAME`;
`tiny_assets(root)` makes the checkpoints (one per architecture, sharing the arithmetic demo's tokenizer) and the
prompts once per root.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "data" / "mindspeed_rl_recipes"
VOCAB = 64
PROMPTS = 64
ARCHITECTURES = {"qwen25_7b": "qwen2", "qwen25_32b": "qwen2", "qwen3_8b": "qwen3", "qwen3_32b": "qwen3",
                 "qwen3_30b_a3b": "qwen3_moe", "qwen3_235b_a22b": "qwen3_moe", "deepseekv3_671b": "deepseek_v3"}


@dataclass(frozen=True)
class Shrink:
    """The recipe's parallel kind kept on 2 devices (actor_config keys) and its inference layout (generate_config)."""
    layout: dict[str, object]
    infer: dict[str, object] = field(default_factory=dict)
    extra: tuple[str, ...] = ()


TP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
       "context_parallel_size": 1}
# The tiny models have 3 layers: a pipeline of 2 stages is uneven.
PP2 = {**TP2, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "num_layer_list": "1,2"}
EP2 = {**TP2, "tensor_model_parallel_size": 1, "expert_model_parallel_size": 2}
CP2 = {**TP2, "tensor_model_parallel_size": 1, "context_parallel_size": 2}
INFER_TP2 = {"infer_tensor_parallel_size": 2, "infer_pipeline_parallel_size": 1, "infer_expert_parallel_size": 1}
INFER_TP1 = {**INFER_TP2, "infer_tensor_parallel_size": 1}
INFER_EP2 = {**INFER_TP1, "infer_expert_parallel_size": 2}

SHRINKS: dict[str, Shrink] = {
    "grpo_qwen25_7b_A3": Shrink(TP2, INFER_TP1),
    "grpo_qwen3_8b_A3": Shrink(PP2, INFER_TP1),
    "grpo_qwen25_32b_A2": Shrink(TP2, INFER_TP2),
    "grpo_qwen25_32b_A3": Shrink(PP2, INFER_TP2),
    "grpo_lora_qwen25_32b_A2": Shrink(PP2, INFER_TP2),
    # Their no-op layers (94 real + 2 at PP16): 3 real + 1 no-op at PP2, read as stages of 2 and 1.
    "grpo_qwen3_235b_a22b_A2": Shrink({**PP2, "num_layers": 4, "noop_layers": "3", "num_layer_list": None},
                                      INFER_EP2),
    "grpo_deepseek_r1_671b_A3": Shrink({**EP2, "num_layer_list": None}, INFER_EP2),
    # Their EPLB map is made from their rollouts' expert loads (not published): the test makes one for the tiny model
    # at EP2 from grpo_deepseek_r1_671b_A3's collection (generate_config.expert_map_path, tests/test_recipes_smoke_e2e.py).
    "grpo_deepseek_r1_671b_A3_eplb": Shrink({**EP2, "num_layer_list": None}, INFER_EP2),
    "grpo_deepseek_r1_671b_A2": Shrink(PP2, INFER_EP2),
    "dapo_qwen25_32b_A3": Shrink(TP2, INFER_TP2),
    "dapo_qwen25_32b_A2_20k": Shrink(CP2, INFER_TP2),
    "dapo_qwen25_32b_A3_32k": Shrink(CP2, INFER_TP1),
    "dapo_qwen25_7b_A2_multi_turn": Shrink(TP2, INFER_TP1),
    "dapo_qwen3_30b_a3b_A3": Shrink(EP2, INFER_EP2),
    "dapo_qwen3_32b_A3": Shrink(PP2, INFER_TP2),
    "ppo_qwen25_32b_A3": Shrink(TP2, INFER_TP2),
    # DPO (no vLLM: the inference layout is not read). Their recipe saves no optimizer or RNG state (no_save_optim,
    # no_save_rng), which an exact resume needs: saved here.
    "dpo_qwen3_30b_a3b_A3": Shrink(TP2, extra=("actor_config.no_save_optim=false", "actor_config.no_save_rng=false")),
}


def recipe_tree(name: str) -> dict:
    import yaml

    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())


MAX_OPERAND = 4  # answers 0..8: a programmed policy's uniform guess is right one time in nine
ANSWERS = range(2 * MAX_OPERAND + 1)
THINK = ("<think>", "</think>", "<answer>", "</answer>")
# The programmed policies (data/bigram_policy.py), one token per piece, answers guessed uniformly:
# boxed: "<think></think><answer>\boxed{n}</answer>" (MindSpeed-RL's base_acc format; math_17k_acc, acc_for_ppo and
# retool_reward read its box); dapo: "\boxed{n}Answer: m" (acc_for_dapo reads the Answer: line, retool_reward the box).
POLICIES = ("boxed", "dapo")


def policy_of(tree: dict) -> str:
    rl = tree.get("rl_config", {})
    dapo = "acc_for_dapo" in rl.get("verifier_function", []) or rl.get("filter_groups_metric") == "acc_for_dapo"
    return "dapo" if dapo else "boxed"


def smoke_tokenizer():
    from mindspeed_rl.data.tokenizer import TASK_ALPHABET, build_closed_vocab_tokenizer

    pieces = [*THINK, *(f"\\boxed{{{n}}}" for n in ANSWERS), *(f"Answer: {n}" for n in ANSWERS)]
    return build_closed_vocab_tokenizer([TASK_ALPHABET], pieces=pieces, vocab_size=VOCAB)


def transitions(tokenizer, policy: str) -> dict[int, list[int]]:
    from mindspeed_rl.data.tokenizer import EOS_TOKEN_ID

    ids = lambda pieces: [tokenizer.token_to_id(piece) for piece in pieces]  # noqa: E731
    boxes, answers = ids(f"\\boxed{{{n}}}" for n in ANSWERS), ids(f"Answer: {n}" for n in ANSWERS)
    equals = tokenizer.encode("=", add_special_tokens=False).ids[-1]  # every prompt ends "a+b="
    if policy == "dapo":
        return {equals: boxes, **{box: answers for box in boxes}, **{answer: [EOS_TOKEN_ID] for answer in answers}}
    think, end_think, answer_open, answer_close = ids(THINK)
    return {equals: [think], think: [end_think], end_think: [answer_open], answer_open: boxes,
            **{box: [answer_close] for box in boxes}, answer_close: [EOS_TOKEN_ID]}


def tiny_assets(root: Path) -> dict[str, Path]:
    """{"<architecture>-<policy>": checkpoint dir, "prompts": jsonl}: 3-layer models (PP2 with uneven stages needs 3)
    of a 64-token vocabulary, programmed as POLICIES say, made once per root."""
    from mindspeed_rl.data.arith_task import make_arith_prompts, write_prompts_jsonl
    from mindspeed_rl.data.bigram_policy import program_bigram_policy

    root.mkdir(parents=True, exist_ok=True)
    made = {"prompts": root / "prompts.jsonl", "pairs": root / "pairs.jsonl"}
    if not made["prompts"].is_file():
        write_prompts_jsonl(made["prompts"], make_arith_prompts(PROMPTS, MAX_OPERAND, 1))
    if not made["pairs"].is_file():  # DPO's preference pairs of the same problems (data/preference.py)
        from mindspeed_rl.data.preference import make_arith_pairs

        write_prompts_jsonl(made["pairs"], make_arith_pairs(MAX_OPERAND, 1, eval_fraction=0.0)[0])
    tokenizer = smoke_tokenizer()
    for arch, create in (("qwen2", _qwen2), ("qwen3", _qwen3), ("qwen3_moe", _qwen3_moe),
                         ("deepseek_v3", _deepseek_v3)):
        for policy in POLICIES:
            out = made[f"{arch}-{policy}"] = root / f"{arch}-{policy}"
            if not (out / "config.json").is_file():
                create(out, tokenizer)
                program_bigram_policy(out, transitions(tokenizer, policy))
    return made


def _qwen2(out: Path, tokenizer) -> None:
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint

    create_tiny_qwen2_checkpoint(out, vocab_size=VOCAB, hidden_size=128, ffn_hidden_size=256, num_layers=3,
                                 num_attention_heads=4, num_query_groups=2, seed=1, tokenizer=tokenizer)


def _qwen3(out: Path, tokenizer) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mindspeed_rl.data.tiny_model import RMS_NORM_EPS, ROPE_THETA, randomize_parameters, save_tiny_checkpoint
    from mindspeed_rl.data.tokenizer import EOS_TOKEN_ID

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         rms_norm_eps=RMS_NORM_EPS, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                         tie_word_embeddings=False, dtype="float32", bos_token_id=EOS_TOKEN_ID,
                         eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID)
    model = Qwen3ForCausalLM(config).float()
    randomize_parameters(model, 1, 0.05)
    save_tiny_checkpoint(model, tokenizer, out)


def _qwen3_moe(out: Path, tokenizer) -> None:
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    create_tiny_qwen3_moe_checkpoint(out, vocab_size=VOCAB, hidden_size=64, num_layers=3, head_dim=32,
                                     num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, seed=1, tokenizer=tokenizer)


def _deepseek_v3(out: Path, tokenizer) -> None:
    from mindspeed_rl.data.tiny_deepseek_v3 import create_tiny_deepseek_v3_checkpoint

    # Their block's YaRN (factor 40 over 4096 positions), as DeepSeek-V3's config.json has it.
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    # Megatron's group score is the top topk/topk_group experts of a group, HF's and vLLM's the top 2: 4 / 2.
    create_tiny_deepseek_v3_checkpoint(out, vocab_size=VOCAB, num_layers=3, n_routed_experts=8, n_group=4,
                                       topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
                                       rope_scaling=yarn, seed=1, tokenizer=tokenizer)


def smoke_overrides(name: str, assets: dict[str, Path], *, save: Path, load: Path | None = None,
                    train_iters: int = 2) -> list[str]:
    """The overrides that shrink recipe `name`; `load`: a checkpoint to resume from (else the tiny HF one)."""
    tree = recipe_tree(name)
    block = tree["megatron_training"]["model"]
    checkpoint = assets[f"{ARCHITECTURES[block]}-{policy_of(tree)}"]
    shrink = SHRINKS[name]
    dpo = tree["megatron_training"].get("stage") == "dpo"  # preference pairs, 2 samples (chosen, rejected) each
    overrides = [
        "runtime.device=cpu",
        "rl_config.actor_resource.num_npus=2",
        f"megatron_training.tokenizer_name_or_path={checkpoint}",
        f"megatron_training.data_path={assets['pairs'] if dpo else assets['prompts']}",
        f"megatron_training.train_iters={train_iters}", "megatron_training.save_interval=1",
        "megatron_training.global_batch_size=4",
        f"actor_config.save={save}",
        f"actor_config.load={load or checkpoint}", *(_resuming() if load else ["actor_config.finetune=true"]),
        *_model_block(block, tree, checkpoint),
        *_sizes(tree),
        *(f"actor_config.{key}={_value(value)}" for key, value in shrink.layout.items()),
        *(f"generate_config.{key}={value}" for key, value in shrink.infer.items()),
        *_critic(tree, shrink, checkpoint),
        *([f"megatron_training.ref_model={checkpoint}"] if dpo else []),  # their ref_model: their load's weights
        *shrink.extra,
    ]
    return overrides


def _resuming() -> list[str]:
    """Their recipes start from a converted checkpoint (finetune, no_load_optim and no_load_rng true): a resume of the
    run turns the three off."""
    return ["actor_config.finetune=false", "actor_config.no_load_optim=false", "actor_config.no_load_rng=false"]


def _critic(tree: dict, shrink: Shrink, checkpoint: Path) -> list[str]:
    """PPO: the critic on the actor's devices and layout, from the same tiny checkpoint."""
    if "critic_config" not in tree:
        return []
    return ["rl_config.critic_resource.num_npus=2", f"critic_config.load={checkpoint}",
            *(f"critic_config.{key}={_value(value)}" for key, value in shrink.layout.items()
              if key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"))]


def _model_block(block: str, tree: dict, checkpoint: Path) -> list[str]:
    """Each field of the recipe's model block that describes the architecture, set to the tiny checkpoint's value
    (the same pairs the engine compares at start: config/model_check.py)."""
    from mindspeed_rl.config.model_arch import ModelArchConfig
    from mindspeed_rl.config.model_check import _MISSING, _holds, _pairs

    hf = json.loads((checkpoint / "config.json").read_text())
    fields = {key: value for key, value in _block_fields(block, tree).items()
              if key in ModelArchConfig.__dataclass_fields__}
    arch = ModelArchConfig(**fields)
    return [f"model.{block}.{pair.field_name}={_value(pair.hf_value)}" for pair in _pairs(arch, hf)
            if pair.block_value is not None and pair.hf_value is not _MISSING and not _holds(pair)]


def _block_fields(block: str, tree: dict) -> dict:
    import yaml

    return yaml.safe_load((RECIPES / "model" / f"{block}.yaml").read_text())[block]


def _sizes(tree: dict) -> list[str]:
    """Short lengths and small batches: 4 prompts x 4 samples per iteration, one optimizer step."""
    rl = tree.get("rl_config", {})
    dpo = tree["megatron_training"].get("stage") == "dpo"  # a pair: its chosen and rejected samples
    sizes = [f"rl_config.n_samples_per_prompt={2 if dpo else 4}", "rl_config.mini_batch_size=4",
             "rl_config.max_prompt_length=16", "generate_config.sampling_config.max_tokens=8",
             "generate_config.max_model_len=32", "generate_config.max_num_batched_tokens=512",
             "generate_config.max_num_seqs=32", "generate_config.cpu_kvcache_space_gb=0.03125",
             "actor_config.micro_batch_size=4", "rl_config.actor_forward_micro_batch_size=8",
             "rl_config.ref_forward_micro_batch_size=8"]
    if "max_packing_token_size" in rl:
        sizes.append("rl_config.max_packing_token_size=256")
    if rl.get("filter_groups_enable"):
        sizes.append("rl_config.filter_groups_train_batch_size=4")
    if rl.get("multi_turn_enable"):
        sizes += ["rl_config.max_total_response_length=8", "rl_config.max_tool_response_length=4"]
    return sizes


def _value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"'{value}'" if isinstance(value, str) and "," in value else str(value)
