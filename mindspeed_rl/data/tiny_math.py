"""The tiny math demo's assets: small-integer word problems in DAPO-Math-17k's parquet schema, a
closed-vocabulary chat tokenizer, and a random tiny Qwen2 checkpoint. Nothing is downloaded.

``ensure_tiny_math_assets`` creates, once, in ``data_dir/math_word-<digest>/``: ``model/`` (checkpoint +
tokenizer with a Qwen-style chat template in ``tokenizer_config.json``) and ``tiny_math.parquet``. The
digest hashes the generation parameters (``asset_cache``): a later call with the same parameters reuses
the directory, a call with different ones gets its own, and none is ever rewritten.

Why the task and tokenizer look the way they do (the demo must learn in 100 GRPO iterations from
a random model, which samples nearly uniformly from its whole vocabulary at first):
- every answer is one token: ``\\boxed{0}`` ... ``\\boxed{2*max_operand}`` are single tokens, so a
  random response already holds some ``\\boxed{n}`` and about one in ten of those is right: GRPO
  gets non-zero advantages from the first iteration. With ``\\boxed{``, digit and ``}`` as three
  tokens a random model hits a right answer about once per 10^4 samples and never starts learning.
- every other piece of MindSpeed-RL's ``format`` answer (``<think>``, ``</think>``, ``<answer>``,
  ``</answer>``) is one token too: ``<think></think><answer>\\boxed{5}</answer>`` is 5 tokens.
- the vocabulary is 65 tokens at max_operand=4 (words are whole tokens, no BPE prefixes), and the answers
  are few (0..2*max_operand) and unevenly frequent, like the sums of the arithmetic demo.
"""

from __future__ import annotations

import os
import random
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer

from mindspeed_rl.data.asset_cache import MANIFEST_FILE, ensure_generated  # noqa: F401 (MANIFEST_FILE re-exported)
from mindspeed_rl.data.tiny_model import create_checkpoint_from_asset_params
from mindspeed_rl.data.tokenizer import (
    CHAT_END_TOKEN,
    QWEN_STYLE_CHAT_TEMPLATE,
    build_closed_vocab_tokenizer,
    save_hf_tokenizer,
)

MODEL_SUBDIR = "model"
DATA_FILE = "tiny_math.parquet"
EVAL_FILE = "tiny_math_eval.parquet"  # held-out problems (texts not in DATA_FILE), for evaluation during training
# Bump when the generators change, so caches written by older code are regenerated.
ASSETS_FORMAT_VERSION = 2  # 2: the held-out EVAL_FILE
TASK_NAME = "math_word"
# DAPO-Math-17k's own values for the constant columns (data_source names this generator).
DATA_SOURCE = "tiny_math_word"
ABILITY = "MATH"
REWARD_STYLE = "rule-lighteval/MATH_v2"
CHAT_ROLES = ("system", "user", "assistant")
FORMAT_PIECES = ("<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "}")
NAMES = ("Tom", "Ann", "Sam")
ITEMS = ("apples", "pens", "cards")


@dataclass(frozen=True, kw_only=True)
class WordProblemTemplate:
    """One wording; ``{name}``, ``{a}``, ``{b}``, ``{item}`` are filled in. ``subtract``: the
    answer is a - b (then b < a), else a + b."""

    text: str
    subtract: bool

    def __post_init__(self) -> None:
        for slot in ("{name}", "{a}", "{b}", "{item}"):
            if slot not in self.text:
                raise ValueError(f"template {self.text!r} lacks {slot}")


# Several wordings per operation, so the policy must read the verb, not the sentence shape. The
# name only opens a sentence: one token per name instead of a second " Tom" form.
TEMPLATES = (
    WordProblemTemplate(text="{name} has {a} {item} and gets {b} more. How many {item} now?", subtract=False),
    WordProblemTemplate(text="{name} has {a} {item} and buys {b} more. How many {item} in all?", subtract=False),
    WordProblemTemplate(text="There are {a} {item} in a box. {name} puts in {b} more. How many {item} are in the box?",
                        subtract=False),
    WordProblemTemplate(text="{name} has {a} {item} and gives away {b}. How many {item} are left?", subtract=True),
    WordProblemTemplate(text="{name} had {a} {item} and lost {b}. How many {item} are left?", subtract=True),
)


def answer_token(answer: int) -> str:
    """The single token that answers ``answer`` in MindSpeed-RL's boxed form."""
    return f"\\boxed{{{answer}}}"


def correct_response(answer: int) -> str:
    """The shortest response both ``math_17k_acc`` and MindSpeed-RL's ``format`` accept."""
    return f"<think></think><answer>{answer_token(answer)}</answer>"


def make_word_problems(num_prompts: int, max_operand: int, seed: int) -> list[dict[str, Any]]:
    """``num_prompts`` rows in DAPO-Math-17k's schema; operands in [1, max_operand]."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2 (a subtraction needs b < a), got {max_operand}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        template = rng.choice(TEMPLATES)
        if template.subtract:
            a = rng.randint(2, max_operand)
            b = rng.randint(1, a - 1)
        else:
            a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        text = template.text.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
        answer = a - b if template.subtract else a + b
        rows.append(_dapo_row(text, answer, str(uuid.UUID(int=rng.getrandbits(128), version=4))))
    return rows


def _dapo_row(problem: str, answer: int, index: str) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"content": problem, "role": "user"}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": str(answer), "style": REWARD_STYLE},
        "extra_info": {"index": index},
    }


def write_dapo_parquet(path: str | os.PathLike[str], rows: list[dict[str, Any]]) -> None:
    """Write rows with DAPO-Math-17k's column types, atomically (temp file + ``os.replace``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_name)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def tokenizer_corpus(max_operand: int) -> list[str]:
    """Every text the tokenizer must cover: each template with every name and item, the roles,
    every digit (labels and multi-digit operands) and the newline of the chat template."""
    texts = [
        template.text.format(name=name, item=item, a=max_operand, b=1)
        for template in TEMPLATES for name in NAMES for item in ITEMS
    ]
    return texts + list(CHAT_ROLES) + ["0123456789", "\n"]


def build_tiny_math_tokenizer(max_operand: int, vocab_size: Optional[int] = None) -> Tokenizer:
    """Words of the problems, digits, chat tokens, the format pieces and one token per answer."""
    answers = [answer_token(n) for n in range(2 * max_operand + 1)]
    return build_closed_vocab_tokenizer(
        tokenizer_corpus(max_operand), pieces=[*FORMAT_PIECES, *answers], vocab_size=vocab_size
    )


def ensure_tiny_math_assets(
    data_dir: str | os.PathLike[str],
    *,
    seed: int = 1234,
    num_prompts: int = 512,
    max_operand: int = 4,
    hidden_size: int = 128,
    ffn_hidden_size: int = 256,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    max_position_embeddings: int = 256,
    init_std: float = 0.05,
    vocab_size: Optional[int] = None,
) -> tuple[Path, Path]:
    """Return ``(model_dir, data_path)`` in this parameter set's directory under ``data_dir``, generating
    it if no process has yet (any number of processes may call this at once).

    ``vocab_size`` None: the tokenizer's own size (see :func:`tiny_math_vocab_size`); a larger
    value pads with filler tokens.
    """
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
    root = ensure_generated(data_dir, TASK_NAME, params, generate=_generate_assets,
                            required=(f"{MODEL_SUBDIR}/config.json", f"{MODEL_SUBDIR}/tokenizer_config.json", DATA_FILE,
                                      EVAL_FILE))
    return root / MODEL_SUBDIR, root / DATA_FILE


def tiny_math_vocab_size(max_operand: int) -> int:
    """The unpadded vocabulary size for ``max_operand`` (the model block's ``padded_vocab_size``)."""
    return build_tiny_math_tokenizer(max_operand).get_vocab_size(with_added_tokens=True)


def _generate_assets(root: Path, params: dict[str, Any]) -> None:
    # `root` is asset_cache's staging directory: nothing reads it before it is complete.
    tokenizer = build_tiny_math_tokenizer(params["max_operand"], params["vocab_size"])
    model_dir = create_checkpoint_from_asset_params(
        root / MODEL_SUBDIR, params, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), tokenizer=tokenizer)
    # Rewritten with the chat template and <|im_end|> as eos, as in Qwen2.5-Instruct: vLLM
    # stops a rollout at the tokenizer's eos (and at config.json's <|endoftext|>).
    save_hf_tokenizer(tokenizer, model_dir, eos_token=CHAT_END_TOKEN, chat_template=QWEN_STYLE_CHAT_TEMPLATE)
    rows = make_word_problems(params["num_prompts"], params["max_operand"], params["seed"])
    write_dapo_parquet(root / DATA_FILE, rows)
    seen = {row["prompt"][0]["content"] for row in rows}
    held_out = [row for row in make_word_problems(max(128, params["num_prompts"] // 2), params["max_operand"],
                                                  params["seed"] + 1) if row["prompt"][0]["content"] not in seen]
    write_dapo_parquet(root / EVAL_FILE, held_out)
