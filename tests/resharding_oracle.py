"""Independent oracles for resharding tests: shards cut from full HF tensors with plain torch ops,
written without the layout/segment machinery under test."""
import torch

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.models.qwen2 import Qwen2Spec


def tiny_spec(*, vocab=64, hidden=64, ffn=128, layers=4, heads=4, kv=2, tie=False) -> Qwen2Spec:
    return Qwen2Spec(vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                     num_attention_heads=heads, num_query_groups=kv, head_dim=hidden // heads, rms_norm_eps=1e-6,
                     rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=tie)


def random_hf_state(spec: Qwen2Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    from mindspeed_rl.resharding.layouts import hf_shapes

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in hf_shapes(spec).items()}


def vllm_shard_oracle(hf: dict[str, torch.Tensor], spec: Qwen2Spec, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What vLLM's weight loaders put in rank `rank` of a TP=`tp` Qwen2 model."""
    hd = spec.head_dim
    heads = spec.num_attention_heads // tp
    kv = spec.num_query_groups
    if kv >= tp:
        kv_heads = list(range(rank * kv // tp, (rank + 1) * kv // tp))
    else:
        kv_heads = [rank * kv // tp]  # replicated: tp/kv consecutive ranks share one KV head

    def rows(t, idx_heads):
        return torch.cat([t[h * hd:(h + 1) * hd] for h in idx_heads])

    def vocab(t):
        padded = -(-spec.vocab_size // 64) * 64
        full = torch.zeros(padded, *t.shape[1:])
        full[: t.shape[0]] = t
        return full.chunk(tp)[rank].clone()

    out = {"model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"]), "model.norm.weight": hf["model.norm.weight"]}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    q_heads = list(range(rank * heads, (rank + 1) * heads))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([
                rows(hf[f"{p}self_attn.q_proj.{kind}"], q_heads),
                rows(hf[f"{p}self_attn.k_proj.{kind}"], kv_heads),
                rows(hf[f"{p}self_attn.v_proj.{kind}"], kv_heads)])
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"].chunk(tp)[rank],
                                                         hf[p + "mlp.up_proj.weight"].chunk(tp)[rank]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


def make_checkpoint(path, **kwargs) -> str:
    sizes = dict(vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=4, num_attention_heads=4,
                 num_query_groups=2, seed=11)
    sizes.update(kwargs)
    create_tiny_qwen2_checkpoint(path, **sizes)
    return str(path)
