"""What the single-rank optimizer tests share (offload, distributed optimizer, swap optimizer): Adam's settings, a tiny
Qwen2 checkpoint, a batch of random token rows and a loss over their response tokens."""
from __future__ import annotations

from pathlib import Path

import torch

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import OptimizerSettings
from mindspeed_rl.protocol import RolloutBatch

ADAM = OptimizerSettings(lr=1e-2, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                         clip_grad=1.0)


def tiny_checkpoint(directory: Path, *, seed: int) -> str:
    """A 2-layer Qwen2 of vocabulary 64 and hidden 64, written to `directory`."""
    create_tiny_qwen2_checkpoint(directory, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=seed)
    return str(directory)


def token_batch(*, seed: int) -> RolloutBatch:
    """8 rows of a 4-token prompt and a 2-6 token response, padded to 6."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (4,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 7, (8,), generator=g)]
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=6)


def response_loss_fn(batch: RolloutBatch):
    """Minus the response tokens' mean log-prob over the whole batch (the engine's loss_fn signature)."""
    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}
    return loss_fn
