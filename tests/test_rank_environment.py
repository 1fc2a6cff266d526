"""The environment a rank process gets (workers/processes.rank_env_vars, local_group.prepare_this_process).
Runs a fresh interpreter per case: torch builds its collective flight recorder once per process."""
from __future__ import annotations

import os
import subprocess
import sys

from mindspeed_rl.workers.processes import free_port

RANK = r"""
import os, pickle, sys
from mindspeed_rl.workers.local_group import prepare_this_process
from mindspeed_rl.workers.processes import rank_env_vars
prepare_this_process(rank_env_vars(1), 1)
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
tensor = torch.ones(4)
for _ in range(300):
    dist.all_reduce(tensor)
print(len(pickle.loads(_dump_fr_trace(True, True, False)).get("entries", [])))
"""


def _records_kept_after_300_collectives(**env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"} | env
    done = subprocess.run([sys.executable, "-c", RANK, str(free_port())], env=environ, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_a_rank_keeps_the_last_256_collective_records_not_torchs_2000():
    assert _records_kept_after_300_collectives() == 256


def test_the_users_flight_recorder_size_wins():
    assert _records_kept_after_300_collectives(TORCH_FR_BUFFER_SIZE="0") == 0
