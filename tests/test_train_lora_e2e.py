"""GRPO with LoRA end to end through `cli/train_grpo.py` (subprocesses, real vLLM + Megatron), on one 2-rank run (Ray,
Megatron TP2 -> vLLM TP1 x DP2, lora_filter, three iterations, a checkpoint after the second):
- vLLM, its backbone kept on the host and only the adapters' slices received at each switch (and only the adapters,
  a state group of their own, brought to the device for it after the first), samples with the
  log-probs Megatron's adapted forward computes; the reference phase holds the train params and there are no
  reference params; the update holds the backbone plus the adapters' grads and Adam states, as the planner says to
  the byte, and its activations as the planner's LoRA terms say (within 3%);
- its checkpoints hold the adapters only, and a run resumed from one reaches the uninterrupted run's next iteration
  exactly; the export (at TP1, from the TP2 checkpoint) writes it merged into the backbone and as a PEFT adapter,
  and PEFT's base + adapter gives the merged model's logits;
- with the roles disaggregated (actor_train and actor_infer on a device each, Ray), the push over the bridge moves the
  backbone once and then the adapters only (the plan's bytes), and vLLM's log-probs stay Megatron's;
- the seed's LoRA reference call through ROLL's API (`compute_log_prob` with `meta_info["disable_adapter"]` and
  `is_offload_states = False`) gives the reference log-probs and keeps the train params on the device (one
  in-process rank in a subprocess, tests/lora_roll_api_run.py).

Runs where: three CLI runs and one in-process rank in subprocesses, two exports in this process; ~2.5 min on 2 cores."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing

from cli_runner import run_cli
from planner_checks import assert_host_prediction_matches_ledger

LORA = "grpo_tiny_cpu_lora"
# grpo_tiny_cpu_lora's adapters on the disaggregated demo's layout.
LORA_KEYS = ("actor_config.lora_r=16", "actor_config.lora_alpha=32", "actor_config.lr=2e-3",
             "actor_config.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]")
ADAPTER_ONLY = ("actor_config.lora_filter=true", "megatron_training.train_iters=3")
REPO = Path(__file__).resolve().parents[1]
STATES = ("train_params", "adapter_params", "train_grads", "optimizer_states")
# resharding/: a resumed run's first switch pushes the backbone too (a continuing run's pushes the adapters only).
VOLATILE_PREFIXES = ("timing/", "memory/", "offload/", "resharding/")
VOLATILE_SUFFIXES = ("_tps", "seconds")


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE_PREFIXES) and not k.endswith(VOLATILE_SUFFIXES)}


@pytest.fixture(scope="module")
def adapter_only_run(tmp_path_factory):
    """Two ranks, lora_filter: three iterations, a checkpoint after the second."""
    full = tmp_path_factory.mktemp("full")
    done = run_cli(full, LORA, *ADAPTER_ONLY, "megatron_training.save_interval=2", f"actor_config.save={full / 'save'}")
    assert done.returncode == 0, done.stderr[-3000:]
    return full, full / "save" / "iter_0000002"


def test_two_ranks_train_the_adapters_on_the_shared_backbone(adapter_only_run):
    full, _ = adapter_only_run
    for record in _records(full):
        assert record["rollout/logprob_max_abs_diff"] < 1e-4  # vLLM's weights = Megatron's adapted forward
        assert record["memory/ref_logprob/train_params_bytes"] > 0
        assert record.get("memory/ref_logprob/reference_params_bytes", 0) == 0
        for state in STATES:
            assert record[f"memory/update/{state}_bytes"] == record[f"memory/update/{state}_predicted_bytes"], state
        # The update keeps no frozen linear's input and nothing before the first adapter (planner/activations.py).
        activations = record["memory/update/activations_bytes"]
        assert abs(record["memory/update/activations_predicted_bytes"] - activations) < 0.03 * activations
        # Adapters are a fraction of the model: their grads (fp32) are far below the params ...
        assert record["memory/update/train_grads_bytes"] < 0.3 * record["memory/update/train_params_bytes"]
        # ... and the switch moves them, not the model: the plan's adapter bytes, below the full push's.
        received = record["resharding/bytes_received"]
        assert received == record["resharding/planned_bytes_received"]
        assert 0 < received < 0.2 * record["resharding/full_push_planned_bytes_received"]
        # The adapters are a state group of their own: the switch row brings them alone to the device, the
        # backbone only for the first push (then vLLM's base weights are kept on the host).
        adapters, backbone = record["memory/update/adapter_params_bytes"], record["memory/update/train_params_bytes"]
        first = record["iteration"] == 1
        assert record["offload/generate/reload_bytes"] == adapters + (backbone if first else 0)
        # That host copy is a registered state: the ledger counts it (vLLM's weights of the rank, once pushed) and
        # the planner predicted it, with the mirrors of the states that leave the device.
        host_copy = record["memory/after_update/host/inference_weights_host_bytes"]
        packed = record["memory/generate/inference_weights_packed_bytes"]  # CPU: the oneDNN copies, not pushed
        assert host_copy == record["memory/generate/inference_weights_bytes"] - packed
        assert_host_prediction_matches_ledger(record)


def test_disaggregated_roles_push_the_backbone_once_then_the_adapters_over_the_bridge(tmp_path):
    done = run_cli(tmp_path, "grpo_tiny_cpu_disaggregated", *LORA_KEYS, "megatron_training.train_iters=2")
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = _records(tmp_path)
    for record in (first, second):
        assert record["rollout/logprob_max_abs_diff"] < 1e-4  # the second: after an update, adapters landed
        received = record["resharding/bytes_received_all_ranks"]
        assert received == record["resharding/planned_bytes_received_all_ranks"]
        assert 0 < received < 0.2 * record["resharding/full_push_planned_bytes_received"]
    assert first["resharding/backbone_bytes_received"] == first["resharding/full_push_planned_bytes_received"]
    assert "resharding/backbone_bytes_received" not in second


def test_adapter_only_checkpoints_resume_exactly(world, tmp_path, adapter_only_run):
    full, checkpoint = adapter_only_run
    saved = {key: value for key, value in dist_checkpointing.load_plain_tensors(str(checkpoint / "model")).items()
             if isinstance(value, torch.Tensor)}  # beside the tensors: the checkpoint's content_metadata
    assert saved and all(key.endswith(("lora_A", "lora_B")) for key in saved), sorted(saved)[:4]
    done = run_cli(tmp_path, LORA, *ADAPTER_ONLY, f"actor_config.load={checkpoint}", "actor_config.finetune=false",
                   f"actor_config.save={tmp_path / 'save'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _stable(_records(tmp_path)[-1]) == _stable(_records(full)[2])


def test_the_adapters_export_merged_and_as_a_peft_adapter_that_peft_loads(world, tmp_path, adapter_only_run):
    """cli/export_hf.py's export (in this process): the merged HF model and PEFT's base + adapter give the same
    logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mindspeed_rl.checkpoint.hf_export import export_checkpoint
    from mindspeed_rl.parallel import megatron_state

    _, checkpoint = adapter_only_run
    export_checkpoint(checkpoint, tmp_path / "merged", parallel=megatron_state.current())
    export_checkpoint(checkpoint, tmp_path / "adapter", parallel=megatron_state.current(), peft=True)
    record = json.loads((checkpoint / "trainer_state.json").read_text())["lora"]
    load = dict(dtype=torch.float32, attn_implementation="eager")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), **load).eval()
    base = AutoModelForCausalLM.from_pretrained(record["backbone"], **load).eval()
    tokens = torch.arange(1, 12).unsqueeze(0)
    with torch.no_grad():
        backbone = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(tokens).logits
        want = merged(tokens).logits
    assert (want - backbone).abs().max() > 1e-3  # two updates moved the adapters
    assert (adapted - want).abs().max().item() < 1e-4


def test_the_seeds_disable_adapter_call_is_the_reference(tmp_path):
    script = Path(__file__).with_name("lora_roll_api_run.py")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "assets")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["before_update_vs_reference"] == 0.0  # B starts at 0: the actor is its backbone
    assert facts["adapted_vs_reference"] > 1e-3  # one update later the adapters matter ...
    assert facts["backbone_vs_reference"] < 1e-6  # ... and disable_adapter takes them away again
    assert set(facts["resident_after"]) == {"train_params", "adapter_params"}  # the actor, backbone and adapters
    assert facts["offload_bytes"] == 0  # is_offload_states False: nothing left the device
