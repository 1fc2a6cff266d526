"""The CPU demo's task: add two small integers ("3+4=" -> "7"), with its locally generated assets.

``ensure_demo_assets`` creates, once, everything the demo needs in ``data_dir/arith-<digest>/``:
``model/`` (a random tiny Qwen2 checkpoint + tokenizer; with ``num_experts`` > 0 a Qwen3-MoE one), ``prompts.jsonl`` and ``eval_prompts.jsonl`` (every
distinct problem of the task once, for evaluation during training: with operands up to ``max_operand`` the task has
``(max_operand + 1)^2`` problems, and the training prompts draw from all of them, so none is held out). Nothing is
downloaded. The digest hashes the generation parameters (``asset_cache``): a later call with the same
parameters reuses the directory, a call with different ones gets its own, and none is ever rewritten.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from mindspeed_rl.atomic_files import write_text_atomic
from mindspeed_rl.data.asset_cache import MANIFEST_FILE, ensure_generated  # noqa: F401 (MANIFEST_FILE re-exported)
from mindspeed_rl.data.tiny_model import create_checkpoint_from_asset_params
from mindspeed_rl.data.tokenizer import train_arith_tokenizer

MODEL_SUBDIR = "model"
PROMPTS_FILE = "prompts.jsonl"
EVAL_FILE = "eval_prompts.jsonl"
TASK_NAME = "arith"
# Bump when the generators change, so caches written by older code are regenerated. 2: EVAL_FILE.
ASSETS_FORMAT_VERSION = 2


def make_arith_prompts(num_prompts: int, max_operand: int, seed: int) -> list[dict[str, str]]:
    """``num_prompts`` rows ``{"prompt": "a+b=", "answer": str(a+b)}`` with a, b in [0, max_operand]."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def write_prompts_jsonl(path: str | os.PathLike[str], rows: list[dict[str, str]]) -> None:
    """Write one JSON object per line, atomically (temp file + ``os.replace``)."""
    text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    write_text_atomic(Path(path), text)


def read_prompts_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows with string ``prompt`` and ``answer`` (extra keys kept); blank lines are skipped.

    Raises ``ValueError`` naming ``path:line`` for the first malformed line.
    """
    path = Path(path)
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                rows.append(_parse_prompt_line(line, f"{path}:{line_number}"))
    if not rows:
        raise ValueError(f"{path}: no prompts found")
    return rows


def _parse_prompt_line(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: invalid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("prompt", "answer"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"{where}: missing or non-string {key!r} (keys: {sorted(row)})")
    return row


def ensure_demo_assets(
    data_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 128,
    hidden_size: int = 128,
    ffn_hidden_size: int = 256,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    max_position_embeddings: int = 256,
    init_std: float = 0.05,
    num_prompts: int = 512,
    max_operand: int = 9,
    seed: int = 1234,
    num_experts: int = 0,
    moe_router_topk: int = 2,
    moe_ffn_hidden_size: int = 64,
) -> tuple[Path, Path]:
    """Return ``(model_dir, prompts_path)`` in this parameter set's directory under ``data_dir``,
    generating it if no process has yet (any number of processes may call this at once). ``num_experts`` > 0:
    the checkpoint is a Qwen3-MoE (``moe_router_topk`` of ``num_experts`` experts of ``moe_ffn_hidden_size`` per
    token, head size ``hidden_size / num_attention_heads``)."""
    params = demo_asset_params(
        vocab_size=vocab_size, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_layers=num_layers,
        num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
        max_position_embeddings=max_position_embeddings, init_std=init_std, num_prompts=num_prompts,
        max_operand=max_operand, seed=seed, num_experts=num_experts, moe_router_topk=moe_router_topk,
        moe_ffn_hidden_size=moe_ffn_hidden_size)
    root = ensure_generated(data_dir, TASK_NAME, params, required=(f"{MODEL_SUBDIR}/config.json", PROMPTS_FILE, EVAL_FILE),
                            generate=_generate_assets)
    return root / MODEL_SUBDIR, root / PROMPTS_FILE


def demo_asset_params(*, vocab_size: int, hidden_size: int, ffn_hidden_size: int, num_layers: int,
                      num_attention_heads: int, num_query_groups: int, max_position_embeddings: int, init_std: float,
                      num_prompts: int, max_operand: int, seed: int, num_experts: int = 0, moe_router_topk: int = 2,
                      moe_ffn_hidden_size: int = 64) -> dict[str, Any]:
    """The generation parameters ``asset_cache`` hashes into the directory name. The expert keys are there only
    for a MoE checkpoint (num_experts > 0), so a dense parameter set keeps the directory it had before they
    existed."""
    if num_experts < 0:
        raise ValueError(f"num_experts must be >= 0, got {num_experts}")
    params: dict[str, Any] = {
        "format_version": ASSETS_FORMAT_VERSION,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "ffn_hidden_size": ffn_hidden_size,
        "num_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_query_groups": num_query_groups,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
        "num_prompts": num_prompts,
        "max_operand": max_operand,
        "seed": seed,
    }
    if num_experts > 0:
        if not 1 <= moe_router_topk <= num_experts:
            raise ValueError(f"moe_router_topk must be in [1, num_experts={num_experts}], got {moe_router_topk}")
        if moe_ffn_hidden_size < 1:
            raise ValueError(f"moe_ffn_hidden_size must be >= 1, got {moe_ffn_hidden_size}")
        params.update(num_experts=num_experts, moe_router_topk=moe_router_topk, moe_ffn_hidden_size=moe_ffn_hidden_size)
    return params


def _generate_assets(data_path: Path, params: dict[str, Any]) -> None:
    seed, max_operand = params["seed"], params["max_operand"]
    tokenizer = train_arith_tokenizer(params["vocab_size"], seed, max_operand=max_operand)
    if params.get("num_experts", 0) > 0:
        _create_moe_checkpoint(data_path / MODEL_SUBDIR, params, tokenizer)
    else:
        create_checkpoint_from_asset_params(data_path / MODEL_SUBDIR, params, vocab_size=params["vocab_size"],
                                            tokenizer=tokenizer)
    rows = make_arith_prompts(params["num_prompts"], max_operand, seed)
    write_prompts_jsonl(data_path / PROMPTS_FILE, rows)
    write_prompts_jsonl(data_path / EVAL_FILE, [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                                                for a in range(max_operand + 1) for b in range(max_operand + 1)])


def _create_moe_checkpoint(out_dir: Path, params: dict[str, Any], tokenizer) -> Path:
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    hidden, heads, groups = params["hidden_size"], params["num_attention_heads"], params["num_query_groups"]
    if hidden % heads or heads % groups:
        raise ValueError(f"hidden_size={hidden}, num_attention_heads={heads}, num_query_groups={groups}: the heads "
                         "must divide hidden_size and the query groups the heads")
    return create_tiny_qwen3_moe_checkpoint(
        out_dir, vocab_size=params["vocab_size"], hidden_size=hidden, num_layers=params["num_layers"],
        num_attention_heads=heads, num_query_groups=groups, head_dim=hidden // heads,
        num_experts=params["num_experts"], moe_topk=params["moe_router_topk"],
        moe_ffn_hidden_size=params["moe_ffn_hidden_size"], intermediate_size=params["ffn_hidden_size"],
        seed=params["seed"], init_std=params["init_std"], max_position_embeddings=params["max_position_embeddings"],
        tokenizer=tokenizer)
