"""An engine's model and optimizer as Megatron dist checkpoints (mindspeed_rl/checkpoint/FORMAT.md): the layout-free
format, so a checkpoint saved at one TP/PP/EP/CP/DP layout loads at another, with the plain or the distributed
optimizer, in fp32 or bf16 (the settings every MindSpeed-RL recipe uses).

Two Megatron-core 0.16 gaps of the torch-native optimizer path (no Apex / Transformer Engine, as on CPU and NPU) are
closed here, for the load only:
- torch's Adam creates its states at its first step, but the distributed optimizer's `state_dict` (where a load
  starts) needs them: a fresh engine gets zero moments and step 0, which the load then overwrites;
- the fully-reshardable load copies every key of the per-parameter state, `step` included, which the checkpoint keeps
  in its param groups (KeyError), and gives every parameter the same `step` tensor, which Adam then increments once
  per parameter: the step is kept in place and each parameter gets its own.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

# Megatron-LM's `--dist-ckpt-optim-fully-reshardable`: the distributed optimizer's states saved per parameter in model
# space (gathered over DP), as the plain optimizer's are. 0.16's default for it ('fully_sharded_model_space') is refused
# by its own save ("ShardedTensor.flattened_range is not supported").
CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                       "chained_optim_avoid_prefix": True}
MODEL_SUBDIR, OPTIMIZER_SUBDIR = "model", "optimizer"


def model_sharded_state_dict(module: torch.nn.Module) -> dict:
    """A GPTModel's sharded state dict as the checkpoints hold it (the exports read it the same way)."""
    return module.sharded_state_dict(metadata=dict(CHECKPOINT_METADATA))


def _in_process_write_results() -> None:
    """Megatron's file writer hands each save's results through one module-level queue, by default a `spawn`
    multiprocessing Manager's: its server process re-imports the rank's main module and, to unpickle the results,
    torch's distributed checkpointing, ~10 CPU-seconds per rank at the first save of every run (measured 2026-11-29
    with py-spy: more than the tiny recipes' training). A save here is synchronous (no `async_save`): the results are
    put and taken in this process, so a thread-safe in-process queue serves it."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_engine(engine, checkpoint_dir: str, *, with_optimizer: bool) -> None:
    """Collective: a MegatronEngine's model/ (and optimizer/ when asked and it trains) under `checkpoint_dir`."""
    from megatron.core import dist_checkpointing

    _in_process_write_results()
    model_dir = os.path.join(checkpoint_dir, MODEL_SUBDIR)
    os.makedirs(model_dir, exist_ok=True)
    dist_checkpointing.save(engine.sharded_state_dict(), model_dir, content_metadata=CHECKPOINT_METADATA)
    if not (with_optimizer and engine.optimizer is not None):
        return
    optimizer_dir = os.path.join(checkpoint_dir, OPTIMIZER_SUBDIR)
    os.makedirs(optimizer_dir, exist_ok=True)
    # The optimizer's sharded state refers to the model's sharded tensors by key.
    state = engine.optimizer.sharded_state_dict(engine.sharded_state_dict(), metadata=dict(CHECKPOINT_METADATA))
    dist_checkpointing.save(state, optimizer_dir, content_metadata=CHECKPOINT_METADATA)


def load_engine(engine, checkpoint_dir: str, *, load_optimizer: bool) -> None:
    """Collective: the inverse of `save_engine`, into this rank's layout."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(engine.sharded_state_dict(), os.path.join(checkpoint_dir, MODEL_SUBDIR),
                                    strict="raise_all")
    engine.module.load_state_dict(state, strict=False)
    optimizer = engine.optimizer
    if optimizer is None:
        return
    # Mixed-precision and distributed optimizers keep fp32 main copies of the module's params.
    optimizer.reload_model_params()
    if not load_optimizer:
        return
    _with_empty_adam_states(optimizer)
    wanted = optimizer.sharded_state_dict(engine.sharded_state_dict(), is_loading=True,
                                          metadata=dict(CHECKPOINT_METADATA))
    loaded = dist_checkpointing.load(wanted, os.path.join(checkpoint_dir, OPTIMIZER_SUBDIR))
    with _step_kept_on_load(optimizer):  # without the save's content_metadata, which the chained count would see
        optimizer.load_state_dict({key: loaded[key] for key in wanted})


def _leaves(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _with_empty_adam_states(optimizer) -> None:
    for leaf in _leaves(optimizer):
        adam = leaf.optimizer
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state[param]:
                    adam.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                         "exp_avg_sq": torch.zeros_like(param)}


@contextlib.contextmanager
def _step_kept_on_load(optimizer) -> Iterator[None]:
    leaves = [leaf for leaf in _leaves(optimizer) if hasattr(leaf, "_set_main_param_and_optimizer_states")]
    for leaf in leaves:
        leaf._set_main_param_and_optimizer_states = _keeping_step(leaf, leaf._set_main_param_and_optimizer_states)
    try:
        yield
    finally:
        for leaf in leaves:
            del leaf._set_main_param_and_optimizer_states  # the class's method again
            for state in leaf.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()


def _keeping_step(leaf, set_states):
    def set_states_keeping_step(model_param, tensors):
        group_index, group_order = leaf.model_param_group_index_map[model_param]
        main_param = leaf.optimizer.param_groups[group_index]["params"][group_order]
        step = leaf.optimizer.state[main_param].get("step")
        set_states(model_param, tensors if step is None or "step" in tensors else {**tensors, "step": step})

    return set_states_keeping_step
