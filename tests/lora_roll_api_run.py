"""Test scaffolding for test_train_lora_e2e: the seed's LoRA reference call through ROLL's API on one in-process
rank of grpo_tiny_cpu_lora (its own process: the rank initialises torch.distributed). Prints one JSON line.

    python tests/lora_roll_api_run.py ASSETS_DIR
"""
import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(assets: str) -> None:
    from transformers import AutoTokenizer

    from mindspeed_rl.config import load_config
    from mindspeed_rl.data.dataset import load_prompt_dataset
    from mindspeed_rl.trainer import setup
    from mindspeed_rl.trainer.rollout import forward_logprobs, generate
    from mindspeed_rl.workers.roles import actor_worker
    from mindspeed_rl.workers.local_group import LocalActorGroup
    from mindspeed_rl.workers.processes import rank_env_vars

    overrides = ["rl_config.actor_resource.num_npus=1", "actor_config.tensor_model_parallel_size=1",
                 "generate_config.infer_tensor_parallel_size=1", f"synthetic_data.data_dir={assets}"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = load_config(compose(config_name="grpo_tiny_cpu_lora", overrides=overrides))
    model_dir, ref_dir, prompts = setup.resolve_assets(config)
    mt = config.megatron_training
    dataset = load_prompt_dataset(prompts, tokenizer=AutoTokenizer.from_pretrained(model_dir), prompt_type=mt.prompt_type,
                                  map_keys=dict(mt.map_keys), max_prompt_length=config.rl_config.max_prompt_length,
                                  show_progress=False)
    actor = LocalActorGroup(config=config, env_vars=rank_env_vars(1), model_dir=model_dir, ref_model_dir=ref_dir,
                            threads=1, worker_class=actor_worker(config))
    actor.initialize()
    batch, _ = generate(actor, dataset.records[:4], config)
    batch.columns["advantages"] = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    batch.columns["ref_logprobs"], _ = forward_logprobs(actor, "compute_ref_log_prob", batch)
    batch.columns["old_logprobs"], _ = forward_logprobs(actor, "compute_log_prob", batch)
    actor.call("update", batch, kl_coef=0.001)
    adapted, _ = forward_logprobs(actor, "compute_log_prob", batch)
    batch.meta_info.update(disable_adapter=True, is_offload_states=False)  # the seed's reference call
    backbone, metrics = forward_logprobs(actor, "compute_log_prob", batch)
    resident = actor.call("resident_bytes")[0]
    mask = batch.response_mask
    print(json.dumps({
        "backbone_vs_reference": ((backbone - batch.columns["ref_logprobs"]).abs() * mask).max().item(),
        "adapted_vs_reference": ((adapted - batch.columns["ref_logprobs"]).abs() * mask).max().item(),
        "before_update_vs_reference": ((batch.columns["old_logprobs"] - batch.columns["ref_logprobs"]).abs()
                                       * mask).max().item(),
        "resident_after": {k: v for k, v in resident.items() if v},
        "offload_bytes": metrics["offload/old_logprob/offload_bytes"],
    }))
    actor.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
