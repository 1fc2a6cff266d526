"""Spellings of one answer that math-verify does not equate, rewritten to one form before it compares.

MindSpeed-RL's verifiers (Qwen-math's ``strip_string``/``math_equal``) accept these and math-verify alone
does not: ``1e3`` (math-verify reads ``e`` as Euler's number), ``\\varnothing``/``∅`` for ``\\emptyset``,
full-width digits and signs (``１２``, ``－５``), and English number words (``twelve``, ``one hundred and
five``). Each rewrite applies only to a whole answer of that form, so no other answer changes.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SCIENTIFIC = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?\d{1,4}")
_EMPTY_SET = re.compile(r"\\varnothing\b|∅")
# U+FF01..U+FF5E are the full-width forms of ASCII 0x21..0x7E; U+3000 is the full-width space.
_FULL_WIDTH = {code: code - 0xFEE0 for code in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}

_UNITS = {word: value for value, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {word: 10 * value for value, word in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9}


def canonical_answer(answer: str) -> str:
    """``answer`` in the form math-verify equates (unchanged when none of the module's forms applies)."""
    text = answer.translate(_FULL_WIDTH).strip()
    text = _EMPTY_SET.sub(r"\\emptyset", text)
    if _SCIENTIFIC.fullmatch(text):
        try:
            return format(Decimal(text), "f")
        except InvalidOperation:
            return text
    number = number_from_words(text)
    return text if number is None else str(number)


def number_from_words(text: str) -> int | None:
    """The integer an English number phrase names ("minus forty-two", "one hundred and five", "two
    thousand"), or None when ``text`` is anything else (a unit after a unit, as in "one two", is not one)."""
    words = text.lower().rstrip(".").replace("-", " ").replace(",", " ").split()
    sign = 1
    if words[:1] in (["minus"], ["negative"]):
        sign, words = -1, words[1:]
    total, current, previous = 0, 0, None
    for word in words:
        if word == "and" and previous in ("hundred", "scale"):
            continue
        if word in _UNITS and previous not in ("unit", "teen"):
            current += _UNITS[word]
            previous = "teen" if _UNITS[word] >= 10 else "unit"
        elif word in _TENS and previous in (None, "hundred", "scale"):
            current, previous = current + _TENS[word], "tens"
        elif word == "hundred" and previous in ("unit", "teen", "tens") and current < 100:
            current, previous = current * 100, "hundred"
        elif word in _SCALES and previous not in (None, "scale"):
            total, current, previous = total + current * _SCALES[word], 0, "scale"
        else:
            return None
    return sign * (total + current) if previous is not None else None
