"""The memory planner: per device, per phase and per state group, the bytes a run will hold, computed from the
model's config.json and the run's layouts without allocating anything (`cli/plan.py`, and the trainer's
prediction beside the ledger).

- `arch`: the architecture from an HF config.json (Qwen2 dense, Qwen3-MoE, DeepSeek-V3) and its counts;
- `params`: per-rank Megatron and vLLM shards (the engine's own layouts), DDP buffers, the optimizer;
- `memory`: per-rank bytes of each state group, the activation estimate, the phase table (the residency policy);
- `switch`: the push's bytes per rank from the resharding plan, host <-> device moves, times;
- `from_config`: a GRPOConfig to the planner's inputs, and the search for overrides that fit;
- `report`: the text table and the JSON document.
"""
from mindspeed_rl.planner.arch import Architecture, ArchitectureError, from_hf_config
from mindspeed_rl.planner.inputs import PlanInputs
from mindspeed_rl.planner.memory import MemoryPlan, plan_memory

__all__ = ["Architecture", "ArchitectureError", "MemoryPlan", "PlanInputs", "from_hf_config", "plan_memory"]
