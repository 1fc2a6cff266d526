"""Device memory: offload/reload of states (`offload`), the ledger and the timeline plot, and ROLL's
control surface (`state_offload_manager`, `log_gpu_memory_usage`)."""
from mindspeed_rl.memory.context_managers import (
    log_gpu_memory_usage,
    state_offload_manager,
    state_offload_manger,
)
from mindspeed_rl.memory.ledger import CATEGORIES, PHASES, ActivationMeter, LedgerRecord, MemoryLedger
from mindspeed_rl.memory.offload import Offloader, StorageGroup

__all__ = [
    "CATEGORIES", "PHASES", "ActivationMeter", "LedgerRecord", "MemoryLedger", "Offloader",
    "StorageGroup", "log_gpu_memory_usage", "state_offload_manager", "state_offload_manger",
]
