"""The output layer on the rows that score a response token only (HF's and TRL's `logits_to_keep`).

A log-prob pass and the update need the logits of the positions that predict a response token, and nothing else:
the prompt's positions (a third to a half of the tokens in RL batches) would cost the output layer's 2 x hidden x
vocab FLOPs per token forward, twice that backward, and their [tokens x vocab] logits. While `scored_rows_only` lasts,
a pre-hook on Megatron's output layer hands it just those rows, [n, 1, hidden], in the order
`engines/vocab_parallel.response_logprobs_from_logits` reads them (`MicroBatch.scored_rows`, or under context
parallelism this rank's, `scored_rows_of_this_rank`). With sequence parallelism the hook first all-gathers the
sequence (Megatron's own inference path does the same) with a backward that keeps this rank's slice, and the layer
runs without its sequence-parallel gather: its input gradient is then summed over TP once, by the layer.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from mindspeed_rl.models.context_parallel import scored_rows

if TYPE_CHECKING:
    from mindspeed_rl.parallel.megatron_state import RankGroups


def hidden_rows(mb, sequence_length: int, *, parallel: RankGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, sample) in Megatron's [s, b, h] hidden states of each row `response_logprobs_from_logits` scores:
    `sequence_length` is the hidden states' s (a padded row's length with its padding; under CP this rank's, at
    `parallel`)."""
    if mb.context_parallel_length:
        rows = scored_rows(mb, parallel=parallel)[0]  # this rank's flattened [b x s / CP] rows, b-major
        return rows % sequence_length, rows // sequence_length
    samples, positions = mb.scored_positions()
    if mb.packed:
        return mb.sample_starts()[samples] + positions, torch.zeros_like(samples)
    return positions, samples


@contextlib.contextmanager
def scored_rows_only(output_layer: torch.nn.Module, mb, *, parallel: RankGroups):
    """`output_layer` computes the logits of `mb`'s scored rows only while the context lasts ([1, n, vocab / TP]
    out of the model); `parallel`: this rank's place in the training layout (its TP group, its CP rank)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    sequence_parallel = output_layer.sequence_parallel

    def select(module, args):
        hidden = args[0]
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=parallel.tp_group)
        positions, samples = hidden_rows(mb, hidden.shape[0], parallel=parallel)
        return (hidden[positions, samples].unsqueeze(1), *args[1:])

    handle = output_layer.register_forward_pre_hook(select)
    output_layer.sequence_parallel = False
    try:
        yield
    finally:
        output_layer.sequence_parallel = sequence_parallel
        handle.remove()
