"""EPLB's token collection (generate_config.eplb_token_collects / eplb_token_save_path): per MoE layer, how many tokens
each expert received in this rank's rollouts, in the files MindSpeed-RL's collector writes and its
cli/eplb_generate_map_ds.py reads (docs/zh/features/EPLB.md):

    <eplb_token_save_path>/eplb_token_collects_<rank>.json = {"<MoE layer>": {"<expert>": tokens, ...}, ...}

`<rank>` is the process's torch.distributed rank, a MoE layer is its ordinal among the model's MoE layers (vllm-ascend's
`moe_instance_id`, the `layer_id` of the expert map), every expert of a layer is listed (0 when it received nothing)
and a token routed to top-k experts counts once for each. The counts come from vLLM's own routing capture, the one
routing replay reads (engines/vllm_routing.RoutingRecorder): every forward of a generate call adds the experts of the
tokens it computed (a request recomputed after preemption adds its tokens again: that is load the experts carried).

Only the first rank of each inference TP group writes: its TP peers route the very same tokens (vLLM's capture gives
every TP rank its DP slice's whole batch), so the files of one run add up to the tokens routed, each once. A pipeline
stage writes its own MoE layers. As MindSpeed-RL's collector does, a file already there is added to (a resumed or
repeated run accumulates; start from an empty directory for one run's loads), and each save replaces the file whole
(a temporary file renamed over it), so a run killed mid-save leaves the previous counts.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mindspeed_rl.atomic_files import write_text_atomic

SAVE_PATH_KEY = "generate_config.eplb_token_save_path"
FILE_PATTERN = re.compile(r"^eplb_token_collects_(\d+)\.json$")

# {MoE layer ordinal: {expert id: tokens}}, MindSpeed-RL's per-rank document with integer keys.
LayerCounts = dict[int, dict[int, int]]


def counts_file_name(rank: int) -> str:
    return f"eplb_token_collects_{rank}.json"


def counts_document(counts: LayerCounts) -> str:
    """The JSON text MindSpeed-RL writes (string keys, layers and experts in ascending order)."""
    return json.dumps({str(layer): {str(e): int(n) for e, n in sorted(experts.items())}
                       for layer, experts in sorted(counts.items())}, indent=2) + "\n"


def read_counts_file(path: str | Path) -> LayerCounts:
    """One rank's file; ValueError naming the file when it is not of that shape."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        counts = {int(layer): {int(e): int(n) for e, n in experts.items()} for layer, experts in raw.items()}
    except (ValueError, AttributeError, TypeError) as error:
        raise ValueError(f"{path}: not an EPLB token-count file ({{MoE layer: {{expert: tokens}}}}): {error}") from None
    if any(n < 0 for experts in counts.values() for n in experts.values()):
        raise ValueError(f"{path}: a negative token count")
    return counts


def counts_files(folder: str | Path) -> list[Path]:
    """The per-rank count files of `folder`, by rank; other files there are not read."""
    found = [(int(m.group(1)), path) for path in Path(folder).iterdir() if (m := FILE_PATTERN.match(path.name))]
    return [path for _, path in sorted(found)]


def aggregate_counts(folder: str | Path) -> np.ndarray:
    """[MoE layers, experts] int64: the sum over every rank's file in `folder` (MindSpeed-RL's load_and_aggregate:
    the sizes are the highest layer and expert ids seen, plus one)."""
    files = counts_files(folder)
    if not files:
        raise FileNotFoundError(f"no eplb_token_collects_<rank>.json in {folder} (generate_config.eplb_token_collects "
                                "writes them to generate_config.eplb_token_save_path)")
    loaded = [read_counts_file(path) for path in files]
    layers = 1 + max((layer for counts in loaded for layer in counts), default=-1)
    experts = 1 + max((e for counts in loaded for row in counts.values() for e in row), default=-1)
    total = np.zeros((layers, experts), dtype=np.int64)
    for counts in loaded:
        for layer, row in counts.items():
            for expert, tokens in row.items():
                total[layer, expert] += tokens
    return total


@dataclass(kw_only=True)
class ExpertTokenCounts:
    """One rank's running counts over its stage's MoE layers, saved to `save_dir` after each generate call."""

    save_dir: Path
    rank: int
    num_experts: int
    # Decoder-layer index (vLLM's MoE `layer_id`) -> the layer's ordinal among the model's MoE layers.
    moe_ordinal_of_layer: dict[int, int]
    loads: np.ndarray = field(init=False)  # [this stage's MoE layers (in moe_ordinal_of_layer order), experts] int64

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or not self.moe_ordinal_of_layer:
            raise ValueError(f"expert token counts need MoE layers, got {self.num_experts} experts on layers "
                             f"{sorted(self.moe_ordinal_of_layer)}")
        self.save_dir = Path(self.save_dir)
        self.loads = np.zeros((len(self.moe_ordinal_of_layer), self.num_experts), dtype=np.int64)
        self._add_file_already_there()

    @property
    def path(self) -> Path:
        return self.save_dir / counts_file_name(self.rank)

    def _add_file_already_there(self) -> None:
        if not self.path.is_file():
            return
        earlier = read_counts_file(self.path)
        for row, ordinal in enumerate(self.moe_ordinal_of_layer.values()):
            for expert, tokens in earlier.get(ordinal, {}).items():
                if not 0 <= expert < self.num_experts:
                    raise ValueError(f"{self.path}: expert {expert} in MoE layer {ordinal}, the model has "
                                     f"{self.num_experts} experts (a file of another model: move it away)")
                self.loads[row, expert] += tokens

    def add(self, topk_ids: np.ndarray) -> None:
        """`topk_ids` [tokens, this stage's MoE layers, top-k]: the experts each computed token was routed to."""
        for row in range(self.loads.shape[0]):
            self.loads[row] += np.bincount(topk_ids[:, row].reshape(-1), minlength=self.num_experts)

    def as_layer_counts(self) -> LayerCounts:
        return {ordinal: {e: int(n) for e, n in enumerate(self.loads[row])}
                for row, ordinal in enumerate(self.moe_ordinal_of_layer.values())}

    def save(self) -> Path:
        write_text_atomic(self.path, counts_document(self.as_layer_counts()))
        return self.path
