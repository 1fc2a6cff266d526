"""A small Qwen2-style BPE tokenizer for the arithmetic demo task, trained locally.

Why Qwen2's own pipeline (byte-level BPE, Qwen's pre-tokenize regex, NFC) and not a plain BPE:
in transformers 5.x, ``AutoTokenizer`` on a directory whose ``config.json`` says
``model_type: qwen2`` always builds ``Qwen2Tokenizer``, which keeps only the vocab and merges of
``tokenizer.json`` and re-creates the Qwen2 normalizer / pre-tokenizer / decoder (vLLM loads
tokenizers the same way). A tokenizer with any other pipeline would silently tokenize and
decode differently once loaded from the checkpoint. Consequences of Qwen's regex: digits are
single tokens (as in Qwen2.5) and "+"/"=" never merge with an operand.

Every id 0..vocab_size-1 exists and decodes: vLLM samples from the whole embedding matrix and a
random model emits every id, so the learned vocabulary is topped up with ``<|unused_k|>``
tokens. They are *not* special: decoding with ``skip_special_tokens=True`` keeps them in the
text, so a response "<|unused_3|>7" cannot earn the reward of "7".
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 0
TASK_ALPHABET = "0123456789+= "
# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (5.19), copied so that training
# needs only `tokenizers`; a test checks that both still agree.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def arith_lines(num_lines: int, max_operand: int, seed: int) -> Iterator[str]:
    """Solved sums like ``"3+4=7"``: the tokenizer's training corpus."""
    rng = random.Random(seed)
    for _ in range(num_lines):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        yield f"{a}+{b}={a + b}"


def min_vocab_size() -> int:
    """``<|endoftext|>`` plus one id per (byte-level) character of the task alphabet."""
    return 1 + len(_byte_level_alphabet())


def train_arith_tokenizer(
    vocab_size: int, seed: int, *, max_operand: int = 99, num_lines: int = 5000
) -> Tokenizer:
    """Train the BPE on generated sums and pad it to exactly ``vocab_size`` decodable ids."""
    if vocab_size < min_vocab_size():
        raise ValueError(
            f"vocab_size={vocab_size} is too small: it needs at least {min_vocab_size()} ids "
            f"({EOS_TOKEN} + the alphabet {TASK_ALPHABET!r})"
        )
    tokenizer = _qwen2_style_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=_byte_level_alphabet(),
        limit_alphabet=len(_byte_level_alphabet()),
        show_progress=False,
    )
    tokenizer.train_from_iterator(arith_lines(num_lines, max_operand, seed), trainer=trainer)
    _pad_vocab(tokenizer, vocab_size)
    _check_vocab(tokenizer, vocab_size)
    return tokenizer


def _qwen2_style_tokenizer() -> Tokenizer:
    """An empty BPE with exactly the pipeline ``Qwen2Tokenizer`` rebuilds on load."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            _byte_level_pre_tokenizer(),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer() -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _byte_level_alphabet() -> list[str]:
    """The task characters as byte-level symbols (space becomes 'Ġ')."""
    byte_level = _byte_level_pre_tokenizer()
    symbols = {c for ch in TASK_ALPHABET for piece, _ in byte_level.pre_tokenize_str(ch) for c in piece}
    return sorted(symbols)


def _pad_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Add ``<|unused_k|>`` (non-special) tokens until the vocabulary has ``vocab_size`` ids."""
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    assert missing >= 0, "the BPE trainer never exceeds its vocab_size"
    fillers = [
        AddedToken(f"<|unused_{k}|>", special=False, normalized=False) for k in range(missing)
    ]
    tokenizer.add_tokens(fillers)


def _check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    ids = sorted(tokenizer.get_vocab(with_added_tokens=True).values())
    assert ids == list(range(vocab_size)), "token ids must be 0..vocab_size-1 without holes"
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` loadable by ``AutoTokenizer`` offline."""
    # Imported here: transformers is heavy and only this step needs it.
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # The default clean-up rewrites spaces around punctuation and would break the round trip.
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(out_dir))
