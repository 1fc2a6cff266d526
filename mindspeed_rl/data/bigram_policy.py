"""A checkpoint rewritten as a bigram table: a programmed policy for demos and smoke tests that need a model whose
samples are known in distribution (a random tiny model never writes a tool call or an "Answer:" line).

Every layer's output projections (attention's o_proj, the MLP's, the experts' and the shared experts' down_proj) are
zeroed, so the residual stream at the last layer is the current token's embedding and the logits are the output
layer applied to it after the final norm. Each programmed context token gets an orthonormal embedding direction,
and each of its successors that direction in its output row, at a logit of CHOSEN_LOGIT (every other token 0: a
probability below 1e-15 each). Works for every architecture the engine builds (Qwen2/3, Qwen3-MoE, DeepSeek-V3)."""
from __future__ import annotations

from pathlib import Path

import torch

# A chosen next token's logit; every other token's is 0.
CHOSEN_LOGIT = 40.0
ZEROED_SUFFIXES = ("o_proj.weight", "down_proj.weight")


def program_bigram_policy(model_dir: str | Path, transitions: dict[int, list[int]], *, seed: int = 0) -> None:
    """Rewrite `model_dir/model.safetensors` so that after context token c the model samples uniformly among
    `transitions[c]` (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    path = Path(model_dir) / "model.safetensors"
    state = load_file(path)
    for name, tensor in state.items():
        if name.endswith(ZEROED_SUFFIXES):
            tensor.zero_()  # each layer adds nothing to the residual stream
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    hidden = embed.shape[1]
    if len(transitions) > hidden:
        raise ValueError(f"{len(transitions)} context tokens need a hidden size of at least that, got {hidden}")
    # Orthonormal directions, one per context token: the final RMSNorm leaves sqrt(hidden) * q as it is.
    generator = torch.Generator().manual_seed(seed)
    directions = torch.linalg.qr(torch.randn(hidden, len(transitions), generator=generator))[0].T
    state["model.norm.weight"].fill_(1.0)
    head.zero_()
    for direction, (context, successors) in zip(directions, transitions.items()):
        embed[context] = direction * hidden ** 0.5
        for successor in successors:
            head[successor] += CHOSEN_LOGIT * direction / hidden ** 0.5
    save_file(state, path, metadata={"format": "pt"})
