"""The batch that flows through one GRPO iteration, and its micro-batch view for the engines."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(kw_only=True)
class MicroBatch:
    input_ids: torch.Tensor       # [b, s] prompt + response, right-padded with pad id
    position_ids: torch.Tensor    # [b, s]
    prompt_lengths: torch.Tensor  # [b]
    response_mask: torch.Tensor   # [b, r] 1.0 on generated tokens
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-sample columns, sliced alike

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]


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

    def micro_batches(self, micro_batch_size: int, device: torch.device) -> list[MicroBatch]:
        """Equal-shape micro-batches (pipeline p2p needs one shape); the last may be smaller."""
        out = []
        for start in range(0, len(self), micro_batch_size):
            part = self.select(slice(start, start + micro_batch_size))
            b, s = part.input_ids.shape
            out.append(MicroBatch(
                input_ids=part.input_ids.to(device),
                position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous().to(device),
                prompt_lengths=part.prompt_lengths.to(device),
                response_mask=part.response_mask.to(device),
                extras={k: v.to(device) for k, v in part.columns.items()},
            ))
        return out
