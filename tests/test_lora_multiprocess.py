"""LoRA on the actor (models/lora.py) on 2 real gloo ranks, at DP2, TP2, TP2 with sequence parallel and PP2, after one
optimizer step (so that B is not zero):
- the actor's log-probs equal HF + PEFT's with the same adapter (the engine's adapters converted to PEFT's
  per-module tensors, models/lora_peft.py), fp32, < 1e-4; with the adapters disabled, the base model's;
- only the adapters train: every other parameter has no gradient and no optimizer state, and is unchanged;
- the merged weights the push reads are W + (alpha/r) B A of each shard;
- the step agrees across layouts (loss and log-probs after it);
- the adapter-only switch (DP2 -> vLLM TP2, TP2 -> TP1 x DP2, TP2+SP -> TP2, PP2 -> TP2) gives vLLM the merged
  weights pushed whole (< 1e-6 relative, fp32), twice (restoring the backbone from the host the second time),
  receiving exactly the plan's adapter bytes, fewer than the full push.

Runs where: 2 spawned processes (torch.multiprocessing), gloo; one spawn covers the four layouts.
"""
import os

import pytest
import torch
import torch.distributed as dist

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from resharding_oracle import adapter_push_check, four_sample_batch, free_port
from preloaded import spawn_ranks

VOCAB, PAD, RANK, ALPHA = 64, 63, 4, 8.0
LAYOUTS = ((1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False))  # (TP, PP, SP) on 2 ranks: (1, 1) is DP2
# vLLM's TP for each: DP2 -> TP2, TP2 -> TP1 x DP2, TP2 -> TP2, PP2 -> TP2
INFER_TP = {(1, 1, False): 2, (2, 1, False): 1, (2, 1, True): 2, (1, 2, False): 2}
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAM = dict(lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


def _hf_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    with torch.no_grad():
        log_p = torch.log_softmax(model(batch.input_ids).logits.float(), dim=-1)
    index = (batch.prompt_lengths.unsqueeze(1) - 1 + torch.arange(batch.response_mask.shape[1])).clamp(
        max=batch.input_ids.shape[1] - 2)
    targets = torch.gather(batch.input_ids, 1, index + 1)
    token = torch.gather(torch.gather(log_p, 1, index.unsqueeze(-1).expand(-1, -1, log_p.shape[-1])), 2,
                         targets.unsqueeze(-1))[..., 0]
    return token * batch.response_mask


def _actor(model_dir: str, tp: int, pp: int, sp: bool):
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.lora import LoRASettings
    from mindspeed_rl.models.qwen2 import ModelOptions

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    accelerator = get_accelerator("cpu")
    accelerator.seed_model_parallel_rng(1)
    spec, state = load_hf_checkpoint(model_dir)
    lora = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=TARGETS, seed=5)
    return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                          parallel=megatron_state.current(),
                          optimizer=OptimizerSettings(**ADAM), options=ModelOptions(sequence_parallel=sp), lora=lora)


def _one_step(actor, batch: RolloutBatch) -> dict:
    from megatron.core import parallel_state as ps

    tokens = float(batch.response_mask.sum())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    part = batch.select(slice(dp_rank * len(batch) // dp, (dp_rank + 1) * len(batch) // dp))

    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.response_mask).sum() / tokens
        return loss, {"loss": loss.item()}

    return actor.train_step(part, micro_batch_size=1, temperature=1.0, loss_fn=loss_fn)


def _peft_tensors(actor) -> dict:
    """The whole adapter as PEFT tensors, on every rank (TP shards gathered, then the pipeline stages')."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.models.lora_peft import peft_lora_tensors

    mine = {name: p.detach().clone() for name, p in actor.module.named_parameters() if p.requires_grad}
    shards = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(shards, mine, group=ps.get_tensor_model_parallel_group())
    stage = peft_lora_tensors(shards, actor.spec, pp=ps.get_pipeline_model_parallel_world_size(),
                              pp_rank=ps.get_pipeline_model_parallel_rank())
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, stage, group=ps.get_pipeline_model_parallel_group())
    return {k: v for part in stages for k, v in part.items()}


def _frozen_facts(actor, before: dict) -> dict:
    trainable = sorted(name for name, p in actor.module.named_parameters() if p.requires_grad)
    optimized = sum(len(group["params"]) for group in actor.optimizer.param_groups)
    unchanged = all(torch.equal(p, before[name]) for name, p in actor.module.named_parameters() if name in before)
    merged = actor.named_weights()
    modules = dict(actor.module.named_modules())
    merge_error = max((merged[f"{name}.weight"] - (modules[name].weight + modules[name].lora_scale *
                                                    modules[name].lora_B @ modules[name].lora_A)).abs().max().item()
                      for name, module in modules.items() if hasattr(module, "lora_A"))
    return dict(trainable=trainable, optimized=optimized, unchanged=unchanged, merge_error=merge_error,
                lora_names_in_push=[k for k in merged if "lora" in k])


def _worker(rank, port, model_dir, batch, out_dir):
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    try:
        for tp, pp, sp in LAYOUTS:
            actor = _actor(model_dir, tp, pp, sp)
            before = {n: p.detach().clone() for n, p in actor.module.named_parameters() if not p.requires_grad}
            stats = _one_step(actor, batch)
            logprobs = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
            with actor.adapters_disabled():
                base = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
            results[(tp, pp, sp)] = dict(stats=stats, logprobs=logprobs, base=base, peft=_peft_tensors(actor),
                                         **_frozen_facts(actor, before),
                                         **adapter_push_check(actor, INFER_TP[(tp, pp, sp)]))
            ps.destroy_model_parallel()
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "lora.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model_dir = root / "model"
    create_tiny_qwen2_checkpoint(model_dir, vocab_size=VOCAB, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    batch = four_sample_batch(PAD)
    spawn_ranks(_worker, args=(free_port(), str(model_dir), batch, str(root)), nprocs=2)
    return torch.load(root / "lora.pt"), str(model_dir), batch


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _peft(model_dir: str, tensors: dict):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from mindspeed_rl.models.lora_peft import peft_target_modules

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                        target_modules=peft_target_modules(TARGETS))
    model = get_peft_model(_hf(model_dir), config)
    loaded = set_peft_model_state_dict(model, tensors)
    assert not loaded.unexpected_keys, loaded.unexpected_keys[:4]
    return model.eval()


def test_the_adapted_actor_equals_hf_with_the_same_peft_adapter_in_every_layout(spawned):
    results, model_dir, batch = spawned
    for layout in LAYOUTS:
        result = results[layout]
        oracle = _hf_logprobs(_peft(model_dir, result["peft"]), batch)
        error = (result["logprobs"] - oracle).abs().max().item()
        assert error < 1e-4, (layout, error)
        assert (oracle - _hf_logprobs(_hf(model_dir), batch)).abs().max() > 1e-3  # the adapter matters


def test_the_adapters_disabled_give_the_base_model(spawned):
    results, model_dir, batch = spawned
    oracle = _hf_logprobs(_hf(model_dir), batch)
    for layout in LAYOUTS:
        assert (results[layout]["base"] - oracle).abs().max().item() < 1e-4, layout


def test_only_the_adapters_train_and_the_push_reads_merged_weights(spawned):
    results, _, _ = spawned
    for layout in LAYOUTS:
        result = results[layout]
        assert result["trainable"] and all(name.endswith(("lora_A", "lora_B")) for name in result["trainable"])
        assert result["optimized"] == len(result["trainable"])  # no optimizer state for the backbone
        assert result["unchanged"], layout
        assert result["merge_error"] < 1e-6 and not result["lora_names_in_push"], layout


def test_one_step_agrees_across_layouts(spawned):
    results, _, _ = spawned
    reference = results[LAYOUTS[0]]
    for layout in LAYOUTS[1:]:
        assert results[layout]["stats"]["loss"] == pytest.approx(reference["stats"]["loss"], rel=1e-5), layout
        assert (results[layout]["logprobs"] - reference["logprobs"]).abs().max().item() < 1e-4, layout


def test_the_adapter_only_switch_equals_the_merged_weights_pushed_whole(spawned):
    results, _, _ = spawned
    for layout in LAYOUTS:
        result = results[layout]
        assert max(result["push_errors"]) < 1e-6, (layout, result["push_errors"])
        for received, planned, full in result["push_bytes"]:
            assert received == planned and (received < full or full == 0), (layout, received, planned, full)
    # TP2 -> TP1 x DP2: each rank receives the other's half; the adapters' share of it is what crosses now.
    assert all(0 < received < full for received, _, full in results[(2, 1, False)]["push_bytes"])
