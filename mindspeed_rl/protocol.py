"""The batch that flows through one GRPO iteration, and its micro-batch view for the engines."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

# A multi-turn rollout's [B, R] column: 0.0 on the tool outputs inside a response (trainer/multi_turn.py).
LOSS_MASK = "loss_mask"
# Every rollout's [B, R] int64 column: the policy version (updates applied to the weights) that sampled each response
# token; a partial rollout's resumed sample holds several (trainer/partial_rollout.py). Its age is the policy being
# updated's version minus it (token_ages).
TOKEN_VERSIONS = "token_versions"
# On-policy distillation's teacher (workers/parts/teacher.py): [B, R] its log-prob of each response token; with a
# top-k loss mode instead [B, R, 1 + 2k]: that log-prob, its k most likely tokens' log-probs, their ids (as fp32).
TEACHER_COLUMN = "teacher_logprobs"
TEACHER_TOPK_COLUMN = "teacher_topk"


def _without_tool_outputs(response_mask: torch.Tensor, columns: dict[str, torch.Tensor]) -> torch.Tensor:
    tool_mask = columns.get(LOSS_MASK)
    return response_mask if tool_mask is None else response_mask * tool_mask


@dataclass(frozen=True, kw_only=True)
class Packing:
    """Micro-batches of samples concatenated without padding (MindSpeed-RL's `use_remove_padding`); with
    `max_tokens` (`use_dynamic_bsz`, `max_packing_token_size`) cut by token budget and balanced
    (algorithms/seqlen_balancing.py), at most `max_samples` samples each (`dynamic_max_batch_size`)."""

    max_tokens: int | None = None
    max_samples: int | None = None
    multiple: int = 1  # a packed row's length is rounded up to this (TP with sequence parallel, CP)
    # Each sample's length is rounded up to this (context parallelism cuts every sample into 2 CP chunks).
    sample_multiple: int = 1


@dataclass(kw_only=True)
class MicroBatch:
    """b samples, either padded ([b, s] rows, right-padded) or packed (one [1, t] row of the b samples one after
    another, `cu_seqlens` [b + 1 (+1 for a final padding segment)] their boundaries)."""

    input_ids: torch.Tensor       # [b, s] or [1, t]
    position_ids: torch.Tensor    # alike; packed: restarting at 0 for each sample
    prompt_lengths: torch.Tensor  # [b]
    response_mask: torch.Tensor   # [b, r] 1.0 on generated tokens
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-sample columns, sliced alike
    sample_indices: list[int] = field(default_factory=list)  # the samples' rows in the batch it was cut from
    cu_seqlens: torch.Tensor | None = None  # int32; None: padded
    max_seqlen: int = 0
    # Context parallelism: the padded length whose chunks the CP ranks hold (models/context_parallel.py); 0: none.
    context_parallel_length: int = 0

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    def loss_mask(self) -> torch.Tensor:
        """[b, r] 1.0 on the response tokens the policy sampled: what losses, KL and entropy average over."""
        return _without_tool_outputs(self.response_mask, self.extras)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def padded_to(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids) of padded rows extended to `length` tokens (positions continue)."""
        ids, positions = self.input_ids, self.position_ids
        extra = length - ids.shape[1]
        if extra == 0:
            return ids, positions
        more = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)
        return torch.nn.functional.pad(ids, (0, extra)), torch.cat([positions, more], dim=1)

    def sample_starts(self) -> torch.Tensor:
        """[b] where each sample's first token is in the flattened `input_ids`."""
        if self.packed:
            return self.cu_seqlens[: len(self.prompt_lengths)].long()
        width = self.input_ids.shape[1]
        return torch.arange(self.input_ids.shape[0], device=self.input_ids.device) * width

    def scored_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample, position in the sample) of each response token's scoring position, in `response_mask` order:
        position t predicts token t + 1, so response token j of a sample is scored at its prompt length - 1 + j."""
        offsets = torch.arange(self.response_width, device=self.input_ids.device)
        positions = (self.prompt_lengths - 1).unsqueeze(1) + offsets
        samples = torch.arange(len(self.prompt_lengths), device=positions.device).unsqueeze(1).expand_as(positions)
        selected = self.response_mask.bool()
        return samples[selected], positions[selected]

    def scored_rows(self) -> torch.Tensor:
        """Rows of the flattened [tokens, vocab] logits that score a response token, in `response_mask` order."""
        samples, positions = self.scored_positions()
        return self.sample_starts()[samples] + positions


@dataclass(kw_only=True)
class RolloutBatch:
    """Samples of one iteration, prompt-major (the n samples of a prompt are contiguous)."""

    input_ids: torch.Tensor       # [B, S]
    prompt_lengths: torch.Tensor  # [B] int64
    response_mask: torch.Tensor   # [B, R] float32
    columns: dict[str, torch.Tensor] = field(default_factory=dict)  # rollout_logprobs, advantages, ...
    # Per-call controls that are not data, e.g. {"is_offload_states": False} (ROLL's name).
    meta_info: dict = field(default_factory=dict)

    @classmethod
    def from_token_lists(cls, prompts: list[list[int]], responses: list[list[int]], *, pad_id: int,
                         response_width: int) -> "RolloutBatch":
        assert len(prompts) == len(responses)
        seq_width = max(len(p) for p in prompts) + response_width
        input_ids = torch.full((len(prompts), seq_width), pad_id, dtype=torch.long)
        response_mask = torch.zeros((len(prompts), response_width), dtype=torch.float32)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            assert len(response) <= response_width, "vLLM was asked for at most response_width tokens"
            tokens = prompt + response
            input_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            response_mask[i, : len(response)] = 1.0
        prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return cls(input_ids=input_ids, prompt_lengths=prompt_lengths, response_mask=response_mask)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_logprobs_shape(self) -> tuple[int, int]:
        return tuple(self.response_mask.shape)

    def loss_mask(self) -> torch.Tensor:
        """[B, R] 1.0 on the response tokens the policy sampled (`response_mask` less a multi-turn rollout's tool
        outputs, which are in the response, scored as context, but not trained on)."""
        return _without_tool_outputs(self.response_mask, self.columns)

    def response_tokens(self) -> torch.Tensor:
        """[B, R] the generated token ids (pad where masked)."""
        width = self.response_mask.shape[1]
        index = (self.prompt_lengths.unsqueeze(1) + torch.arange(width).unsqueeze(0)).clamp(max=self.input_ids.shape[1] - 1)
        return torch.gather(self.input_ids, 1, index) * self.response_mask.long()

    def select(self, index: torch.Tensor | slice) -> "RolloutBatch":
        return replace(
            self,
            input_ids=self.input_ids[index],
            prompt_lengths=self.prompt_lengths[index],
            response_mask=self.response_mask[index],
            columns={k: v[index] for k, v in self.columns.items()},
        )

    @classmethod
    def concat(cls, batches: list["RolloutBatch"], *, pad_id: int = 0) -> "RolloutBatch":
        """The samples of `batches` in order, in one batch as wide as the widest (same response width); per-sample
        columns concatenated alike."""
        width = max(b.input_ids.shape[1] for b in batches)
        input_ids = torch.cat([torch.nn.functional.pad(b.input_ids, (0, width - b.input_ids.shape[1]), value=pad_id)
                               for b in batches])
        columns = {name: torch.cat([_widened(name, b.columns[name], width) for b in batches])
                   for name in batches[0].columns}
        return cls(input_ids=input_ids, prompt_lengths=torch.cat([b.prompt_lengths for b in batches]),
                   response_mask=torch.cat([b.response_mask for b in batches]), columns=columns)

    def sample_lengths(self) -> torch.Tensor:
        """[B] prompt + response tokens of each sample (its row without the padding)."""
        return self.prompt_lengths + self.response_mask.sum(dim=1).long()

    def micro_batches(self, micro_batch_size: int, device: torch.device,
                      packing: Packing | None = None) -> list[MicroBatch]:
        """Padded: `micro_batch_size` samples each, all of the batch's width (pipeline p2p needs one shape); the
        last may have fewer samples. Packed: the same groups (or, with `packing.max_tokens`, token-budget
        groups) concatenated without padding."""
        if packing is not None and packing.max_tokens is not None:
            from mindspeed_rl.algorithms.seqlen_balancing import token_budget_partitions

            groups = token_budget_partitions(self.sample_lengths().tolist(), max_tokens=packing.max_tokens,
                                             max_samples=packing.max_samples)
        else:
            groups = [list(range(start, min(start + micro_batch_size, len(self))))
                      for start in range(0, len(self), micro_batch_size)]
        if packing is None:
            return [self._padded(group, device) for group in groups]
        return [self._packed(group, device, packing.multiple, packing.sample_multiple) for group in groups]

    def _padded(self, group: list[int], device: torch.device) -> MicroBatch:
        part = self.select(torch.tensor(group, dtype=torch.long))
        b, s = part.input_ids.shape
        return MicroBatch(
            input_ids=part.input_ids.to(device),
            position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous().to(device),
            prompt_lengths=part.prompt_lengths.to(device),
            response_mask=part.response_mask.to(device),
            extras={k: v.to(device) for k, v in part.columns.items()},
            sample_indices=group,
        )

    def _packed(self, group: list[int], device: torch.device, multiple: int, sample_multiple: int = 1) -> MicroBatch:
        part = self.select(torch.tensor(group, dtype=torch.long))
        # Tokens appended to a sample change none of its own logits (causal): a padded sample scores the same.
        lengths = [-(-n // sample_multiple) * sample_multiple for n in part.sample_lengths().tolist()]
        ids = [part.input_ids[i, :n] for i, n in enumerate(lengths)]
        ids = [torch.nn.functional.pad(row, (0, n - len(row))) for row, n in zip(ids, lengths)]
        positions = [torch.arange(n) for n in lengths]
        total = sum(lengths)
        padding = -total % multiple
        if padding:  # its own segment: causal attention keeps it out of every sample
            ids.append(torch.zeros(padding, dtype=torch.long))
            positions.append(torch.arange(padding))
            lengths.append(padding)
        cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return MicroBatch(
            input_ids=torch.cat(ids).unsqueeze(0).to(device),
            position_ids=torch.cat(positions).unsqueeze(0).to(device),
            prompt_lengths=part.prompt_lengths.to(device),
            response_mask=part.response_mask.to(device),
            extras={k: v.to(device) for k, v in part.columns.items()},
            sample_indices=group,
            cu_seqlens=cu_seqlens.to(device),
            max_seqlen=max(lengths),
        )


# Routing replay's column: the experts vLLM chose, [B, S, layers, k] aligned with `input_ids`; -1 where it recorded
# nothing (the trainer's router chooses there).
ROUTES_COLUMN = "routed_experts"
UNRECORDED_ROUTE = -1
# Columns aligned with `input_ids` positions ([B, S, ...]) and their padding value.
POSITION_COLUMNS = {ROUTES_COLUMN: UNRECORDED_ROUTE}


def _widened(name: str, column: torch.Tensor, width: int) -> torch.Tensor:
    """A column aligned with `input_ids` (POSITION_COLUMNS) padded to `width` positions; any other as it is."""
    if name not in POSITION_COLUMNS or column.shape[1] == width:
        return column
    pad = column.new_full((column.shape[0], width - column.shape[1], *column.shape[2:]), POSITION_COLUMNS[name])
    return torch.cat([column, pad], dim=1)


@dataclass(frozen=True, kw_only=True)
class Shard:
    """What one rank returns: the slice [start, stop) of the samples, or nothing."""

    start: int
    stop: int
    value: object


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One sampled completion, as the inference engine returns it and the rollout strategies assemble it: token ids
    and the log-prob vLLM assigned to each sampled token."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    # With logprobs > 0: per step, the `logprobs` most likely tokens' log-probs (plus the sampled one).
    top_logprobs: list[dict[int, float]] | None = None
    text: str | None = None  # with detokenize
    # With return_routed_experts: [prompt + response - 1 positions, layers, top-k] int16 expert ids, -1 unrecorded.
    routed_experts: object = None  # np.ndarray | None
    # The policy version that sampled each token (room for partial rollout: a sample resumed under newer weights);
    # None: every token by the version of the rollout that holds it.
    policy_versions: list[int] | None = None
    # True: vLLM stopped the sample (an end or stop token); False: it reached its max_tokens; None: not said.
    stopped: bool | None = None


def token_ages(batch: RolloutBatch, policy_version: int) -> torch.Tensor:
    """[B, R] versions each response token lags the policy of version `policy_version` (0 where nothing was sampled:
    outside `loss_mask`, the tokens trained on)."""
    versions = batch.columns[TOKEN_VERSIONS]
    return (policy_version - versions) * (batch.loss_mask() > 0).long()


def has_older_tokens(batch: RolloutBatch, policy_version: int) -> bool:
    """Whether a response token was sampled by a policy older than `policy_version` (a partial rollout's resumed one)."""
    return TOKEN_VERSIONS in batch.columns and bool(token_ages(batch, policy_version).any())


def checked_token_ages(batch: RolloutBatch, policy_version: int, *, bound: int) -> torch.Tensor:
    """token_ages, each checked to lie in [0, bound] (the run's declared bound, config/partial_rollout.max_token_age):
    a token outside it is the engine's bug, not the user's, and stops the run before it trains."""
    ages = token_ages(batch, policy_version)
    oldest, newest = (int(ages.max()), int(ages.min())) if ages.numel() else (0, 0)
    assert 0 <= newest and oldest <= bound, (
        f"a trained token is {oldest if oldest > bound else newest} policy versions behind the policy of version "
        f"{policy_version}; the declared bound is [0, {bound}] (config/partial_rollout.max_token_age)")
    return ages


def versions_column(batch: RolloutBatch, version: int) -> torch.Tensor:
    """The TOKEN_VERSIONS column of a batch sampled by one policy version."""
    return torch.full(batch.response_logprobs_shape, version, dtype=torch.long)
