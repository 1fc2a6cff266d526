"""ROLL's offload control on the real hybrid worker: 2 Ray ranks (train TP2 -> infer TP1, DP2), real
Megatron-core, vLLM and gloo, the tiny demo model.

One run checks, in order: nothing is resident after initialize; every RPC reloads its role's
states, runs with exactly the DESIGN phase table on the device, and offloads them afterwards
(automatic mode); `is_offload_states=False` keeps them; the automatic path drops the inference
weights (they come back as zeros, vLLM then samples uniformly) while a manual
`offload_states()` / `reload_states()` round trip (blocking, and non-blocking Ray refs) brings
them back so that vLLM's samples and log-probs are identical; the context manager's metrics
count exactly the bytes resident in the phase; and two training iterations through the trainer
write the ledger into metrics.jsonl and draw memory_timeline.png from it.

Runs where: the pytest process drives Ray; 2 worker processes, 1 thread each; ~60 s.
"""
import json
import math

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from mindspeed_rl.config import load_config
from mindspeed_rl.memory.timeline import build_timeline
from mindspeed_rl.planner.from_config import predict_run, resolve_hf_config
from planner_checks import assert_prediction_matches_ledger

CATEGORIES = ("train_params", "train_grads", "optimizer_states", "inference_weights", "kv_cache", "reference_params")
ON_DEVICE = {  # DESIGN.md's phase table with every offload_train_* flag on
    "generate": {"inference_weights", "kv_cache"},
    "ref_logprob": {"reference_params"},
    "old_logprob": {"train_params"},
    "update": {"train_params", "train_grads", "optimizer_states", "activations"},
}


def _config(tmp_path):
    from pathlib import Path

    overrides = [
        "rl_config.actor_resource.num_npus=2", "actor_config.tensor_model_parallel_size=2",
        "generate_config.infer_tensor_parallel_size=1", "megatron_training.global_batch_size=4",
        "rl_config.n_samples_per_prompt=4", "rl_config.mini_batch_size=2", "actor_config.micro_batch_size=4",
        "generate_config.cpu_kvcache_space_gb=0.0625", "generate_config.max_num_seqs=16",
        "megatron_training.train_iters=2", "runtime.num_threads_per_rank=1",
        f"synthetic_data.data_dir={tmp_path / 'assets'}",
    ]
    config_dir = str(Path(__file__).resolve().parents[1] / "configs")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return load_config(compose(config_name="grpo_tiny_cpu", overrides=overrides))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import os

    from transformers import AutoTokenizer

    from mindspeed_rl.trainer import setup
    from mindspeed_rl.workers.group import RayActorGroup
    from mindspeed_rl.workers.processes import rank_env_vars

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    tmp_path = tmp_path_factory.mktemp("roll")
    config = _config(tmp_path)
    from mindspeed_rl.data.dataset import load_prompt_dataset

    model_dir, ref_dir, prompts_path = setup.resolve_assets(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mt = config.megatron_training
    dataset = load_prompt_dataset(prompts_path, tokenizer=tokenizer, prompt_type=mt.prompt_type,
                                  map_keys=dict(mt.map_keys), max_prompt_length=config.rl_config.max_prompt_length,
                                  show_progress=False)
    setup.start_ray(config, "cpu", 1)
    actor = RayActorGroup(config=config, device="cpu", env_vars=rank_env_vars(1), model_dir=model_dir,
                          ref_model_dir=ref_dir, worker_class=_probing_worker_class(config))
    try:
        actor.initialize()
        yield config, actor, tokenizer, dataset, tmp_path
    finally:
        actor.shutdown()
        ray.shutdown()


def _probing_worker_class(config):
    """The production worker plus `rollout_probe` (sample with vLLM's current weights: no phase, so no push),
    which shows what a weight round trip did to them. Shipped to the Ray workers by value: they cannot import
    this test module."""
    import sys

    from ray import cloudpickle

    from mindspeed_rl.workers.roles import actor_worker

    class ProbingWorker(actor_worker(config)):
        def rollout_probe(self, prompt_token_ids: list[list[int]], seed: int) -> tuple[list, dict[str, float]]:
            sampling = self.config.generate_config.sampling_config
            self.sharding_manager.reload_states(["inference_weights", "kv_cache"])  # whatever weights they hold
            engine = self.parts["inference engine"].inference_model
            generations = engine.generate(prompt_token_ids, n=2, max_tokens=sampling.max_tokens,
                                          temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=seed)
            return [(g.token_ids, g.logprobs) for g in generations], {}

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ProbingWorker


def _resident(actor) -> list[dict[str, int]]:
    return actor.call("resident_bytes")


def _probe(actor, prompt_batch) -> list:
    """Each rank's vLLM samples (token ids, log-probs) with its current weights, seed 5, states kept."""
    results = actor.call("rollout_probe", [p.token_ids for p in prompt_batch], 5)
    return [samples for samples, _ in results]


def _in_phase(metrics: dict, phase: str) -> set[str]:
    return {c for c in (*CATEGORIES, "activations") if metrics.get(f"memory/{phase}/{c}_bytes", 0) > 0}


def test_roll_offload_control_on_the_hybrid_worker(cluster):
    from mindspeed_rl.trainer import setup
    from mindspeed_rl.trainer.grpo_trainer import make_sampler, train
    from mindspeed_rl.trainer.prepared_run import PreparedRun
    from mindspeed_rl.trainer.rollout import forward_logprobs, generate

    config, actor, tokenizer, dataset, tmp_path = cluster
    assert all(sum(r.values()) == 0 for r in _resident(actor)), "after initialize nothing stays on the device"
    prompt_batch = dataset.records[:4]

    # Automatic mode: each call brings its role's states, runs with the phase table, and clears the device.
    batch, metrics = generate(actor, prompt_batch, config)
    assert _in_phase(metrics, "generate") == ON_DEVICE["generate"]
    assert all(sum(r.values()) == 0 for r in _resident(actor))
    assert metrics["memory/after_generate/total_bytes"] == 0
    batch.columns["advantages"] = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    batch.columns["ref_logprobs"], metrics = forward_logprobs(actor, "compute_ref_log_prob", batch)
    assert _in_phase(metrics, "ref_logprob") == ON_DEVICE["ref_logprob"]
    ref_bytes = metrics["memory/ref_logprob/reference_params_bytes"]
    assert metrics["offload/ref_logprob/reload_bytes"] == metrics["offload/ref_logprob/offload_bytes"] == ref_bytes
    assert all(metrics[f"timing/ref_logprob/{s}"] >= 0 for s in ("onload", "execute", "offload", "total"))
    assert all(sum(r.values()) == 0 for r in _resident(actor))

    # is_offload_states=False: the states stay (here only what the table keeps anyway: the train params, for
    # the update that follows).
    batch.meta_info["is_offload_states"] = False
    batch.columns["old_logprobs"], metrics = forward_logprobs(actor, "compute_log_prob", batch)
    del batch.meta_info["is_offload_states"]
    assert _in_phase(metrics, "old_logprob") == ON_DEVICE["old_logprob"]
    assert metrics["offload/old_logprob/offload_bytes"] == 0
    for resident in _resident(actor):
        assert {k for k, v in resident.items() if v} == {"train_params"}
    [update] = [actor.call("update", batch, kl_coef=0.001)[0]]
    assert _in_phase(update, "update") == ON_DEVICE["update"]
    assert update["offload/update/reload_bytes"] == 0, \
        "params were still resident, grads come back as zeros, Adam has no moments before its first step"
    assert update["memory/update/optimizer_states_bytes"] == 2 * update["memory/update/train_params_bytes"]
    # Grads are dropped (no copy); params and the freshly created Adam moments are copied out.
    assert update["offload/update/offload_bytes"] == 3 * update["memory/update/train_params_bytes"]
    assert all(sum(r.values()) == 0 for r in _resident(actor))

    # The automatic path dropped vLLM's weights: reloaded by hand they are zeros, so vLLM samples uniformly.
    actor.reload_states(["inference_weights"])
    probe = _probe(actor, prompt_batch)[0]
    logprobs = [lp for _, lps in probe for lp in lps]
    assert max(abs(lp + math.log(config.synthetic_data.vocab_size)) for lp in logprobs) < 1e-4

    # Manual round trip: real weights on vLLM (a generate call that keeps them), offload all, reload all.
    actor.call("generate_sequences", [p.token_ids for p in prompt_batch], meta_info={"is_offload_states": False})
    before = _probe(actor, prompt_batch)
    offloaded = actor.offload_states()
    assert all(sum(r.values()) == 0 for r in _resident(actor))
    refs = actor.reload_states(blocking=False)
    assert all(isinstance(ref, ray.ObjectRef) for ref in refs)
    reloaded = ray.get(refs)
    # On a CPU host the inference weights count vLLM's oneDNN-packed copies too (engines/vllm_cpu_linears.py): dropped
    # with the weights, packed again from them at the reload, never copied.
    packed = [rank.inference_packed_bytes for rank in predict_run(config, resolve_hf_config(config).hf_config,
                                                                device="cpu").ranks]
    for resident, out, back, packed_bytes in zip(_resident(actor), offloaded, reloaded, packed):
        assert all(resident[c] > 0 for c in CATEGORIES), resident
        # Only vLLM's weights were resident to copy out (the KV cache is dropped); everything but
        # grads (dropped) and the KV cache (rebuilt empty) is copied back.
        assert out["offload/offload_states/offload_bytes"] == resident["inference_weights"] - packed_bytes
        kept = sum(v for k, v in resident.items() if k not in ("train_grads", "kv_cache")) - packed_bytes
        assert back["offload/reload_states/reload_bytes"] == kept
    assert _probe(actor, prompt_batch) == before, "vLLM samples the same tokens and log-probs after the round trip"
    assert [ids for ids, _ in before[0]] != [ids for ids, _ in probe], "the probe is sensitive to the weights"
    actor.offload_states(blocking=True)

    # The trainer: ledger figures per phase in metrics.jsonl, and the timeline drawn from them.
    model_dir, ref_dir, _ = setup.resolve_assets(config)
    run = PreparedRun(model_dir=model_dir, ref_dir=ref_dir, tokenizer=tokenizer, dataset=dataset, eval_dataset=None,
                      sampler=make_sampler(config, dataset), resume=None, ref_checkpoint=None, device="cpu",
                      prediction=None)  # the trainer predicts the planner's bytes itself
    history = train(config, actor, run, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        for phase, expected in ON_DEVICE.items():
            assert _in_phase(record, phase) == expected, (phase, record)
        assert record["rollout/logprob_max_abs_diff"] < 1e-4
        assert_prediction_matches_ledger(record)  # train TP2 -> infer TP1 x DP2: the planner's bytes
    timeline = build_timeline(history, last_iterations=3)
    assert timeline.totals()[-1] == records[-1]["memory/update/total_bytes"]
    assert (tmp_path / "memory_timeline.png").stat().st_size > 10_000
