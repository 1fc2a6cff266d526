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
from typing import Iterable, Iterator, Optional, Sequence

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


def save_hf_tokenizer(
    tokenizer: Tokenizer, out_dir: Path, *, eos_token: str = EOS_TOKEN, chat_template: Optional[str] = None
) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` loadable by ``AutoTokenizer`` offline.

    ``chat_template`` (a Jinja string) is stored inside ``tokenizer_config.json``, where every
    loader (transformers, vLLM, MindSpeed-RL) finds it. The pad token is always ``<|endoftext|>``.
    """
    # Imported here: transformers is heavy and only this step needs it.
    from transformers import PreTrainedTokenizerFast

    extra = {} if chat_template is None else {"chat_template": chat_template}
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos_token,
        pad_token=EOS_TOKEN,
        # The default clean-up rewrites spaces around punctuation and would break the round trip.
        clean_up_tokenization_spaces=False,
        **extra,
    )
    hf_tokenizer.save_pretrained(str(out_dir), **({} if chat_template is None else {"save_jinja_files": False}))


# --- closed-vocabulary chat tokenizer (the tiny math demo) ----------------------------------------
CHAT_START_TOKEN = "<|im_start|>"
CHAT_END_TOKEN = "<|im_end|>"
# Qwen2.5's chat template without its default system prompt and tool calls: the tiny model would
# have to read dozens of extra tokens per prompt for nothing.
QWEN_STYLE_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_closed_vocab_tokenizer(
    texts: Iterable[str], *, pieces: Sequence[str], vocab_size: Optional[int] = None
) -> Tokenizer:
    """A Qwen2-pipeline tokenizer whose vocabulary is exactly what ``texts`` and ``pieces`` need.

    Ids: ``<|endoftext|>`` (0), the byte-level symbols of every non-letter character of ``texts``
    (digits, spaces, punctuation), ``<|im_start|>`` and ``<|im_end|>`` (special), then one
    non-special token per entry of ``pieces`` and per distinct word of ``texts`` (a word as Qwen's
    regex cuts it, leading space included: "Tom", " has"). Words are added tokens rather than BPE
    merges because a merge chain puts every prefix ("Ġh", "Ġha") in the vocabulary, and a random
    policy samples from all of it: the vocabulary stays in the tens. The cost is a closed world:
    a letter outside these words has no id (the tests check every generated prompt round-trips).
    ``vocab_size`` pads with ``<|unused_k|>`` fillers (non-special) to that many ids.
    """
    texts = list(texts)
    words, symbols = _words_and_symbols(texts)
    base_vocab = {EOS_TOKEN: EOS_TOKEN_ID}
    for symbol in symbols:
        base_vocab.setdefault(symbol, len(base_vocab))
    tokenizer = _qwen2_style_tokenizer()
    tokenizer.model = models.BPE(vocab=base_vocab, merges=[])
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in (CHAT_START_TOKEN, CHAT_END_TOKEN)]
    )
    non_special = list(dict.fromkeys([*pieces, *sorted(words)]))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in non_special])
    natural_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None:
        if vocab_size < natural_size:
            raise ValueError(f"vocab_size={vocab_size} is too small: the task needs {natural_size} ids")
        _pad_vocab(tokenizer, vocab_size)
    _check_vocab(tokenizer, tokenizer.get_vocab_size(with_added_tokens=True))
    return tokenizer


def _words_and_symbols(texts: list[str]) -> tuple[set[str], list[str]]:
    """Distinct letter-bearing pre-tokens (the words) and the byte-level symbols of the rest."""
    splitter = pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    byte_level = _byte_level_pre_tokenizer()
    words, others = set(), set()
    for text in texts:
        for piece, _ in splitter.pre_tokenize_str(text):
            if any(ch.isalpha() for ch in piece):
                words.add(piece)
            else:
                others.update(piece)
    symbols = {c for ch in others for piece, _ in byte_level.pre_tokenize_str(ch) for c in piece}
    return words, sorted(symbols)
