"""A checkpoint saved at TP2 (2 real gloo ranks) exports, on one process, to exactly the weights it was built from.

Runs where: 2 spawned processes (torch.multiprocessing, gloo) save; the export runs in a CLI subprocess.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mindspeed_rl.checkpoint.store import begin_save, commit_save
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from resharding_oracle import free_port
from preloaded import spawn_ranks

ROOT = Path(__file__).resolve().parents[1]


def _save_at_tp2(rank, world, port, hf_dir, tmp_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    acc = get_accelerator("cpu")
    acc.seed_model_parallel_rng(1)
    spec, state = load_hf_checkpoint(hf_dir)
    engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=acc,
                            parallel=megatron_state.current(), optimizer=None)
    engine.save_sharded(tmp_dir, with_optimizer=False)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_export_of_tp2_checkpoint_equals_source_weights(tmp_path):
    hf_dir = tmp_path / "model"
    create_tiny_qwen2_checkpoint(hf_dir, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    tmp = begin_save(tmp_path / "save", 1)
    spawn_ranks(_save_at_tp2, args=(2, free_port(), str(hf_dir), str(tmp)), nprocs=2)
    (tmp / "hf").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, tmp / "hf" / name)
    commit_save(tmp, 1, keep_last_n=None)

    result = subprocess.run([sys.executable, str(ROOT / "cli" / "export_hf.py"), "--checkpoint", str(tmp_path / "save"),
                             "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    _, source = load_hf_checkpoint(str(hf_dir))
    _, exported = load_hf_checkpoint(str(tmp_path / "out"))
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
