"""Spellings of one answer that math-verify does not equate, rewritten to one form before it compares.

:func:`canonical_answer`: MindSpeed-RL's verifiers (Qwen-math's ``strip_string``/``math_equal``) accept these and
math-verify alone does not: ``1e3`` (math-verify reads ``e`` as Euler's number), ``\\varnothing``/``∅`` for
``\\emptyset``, full-width digits and signs (``１２``, ``－５``), and English number words (``twelve``, ``one hundred
and five``). Each rewrite applies only to a whole answer of that form, so no other answer changes.

:func:`written_forms`: what models write around a final answer and a careful grader reads through (the survey
behind tests/data/verifier_graded_pairs.jsonl): Unicode math (``½``, ``2√2``, ``π``, ``×``, ``−``, ``≤``, ``x²``,
``∞``), LaTeX spacing inside a number (``1\\,000``), markdown or display delimiters around the whole answer
(``**5**``, ``\\[5\\]``), a number and its unit inside ``\\text{}`` (``\\text{5 cm}``), and unit or count words
after a number (``5 dollars``, ``80 km/h``, ``24 people``). Each rewrite is narrow: words that change or hedge a
value (``thousand``, ``dozen``, ``squared``, ``more``...) and short tokens that may be math (``pi``, ``or``, ``x``)
stop the unit rule, so ``5 thousand`` and ``2 pi`` stay unlike ``5`` and ``2``.
All are single left-to-right passes over at most :data:`MAX_REWRITTEN_CHARS` characters.
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

# A final answer is short; longer text (a runaway box, a whole paragraph) gets only canonical_answer's rewrites,
# so the work added here stays bounded whatever a response holds.
MAX_REWRITTEN_CHARS = 1000

# Trailing space: "πr" must become "\pi r", not the unknown command "\pir".
_UNICODE_SYMBOLS = str.maketrans({
    "−": "-", "×": "\\times ", "·": "\\cdot ", "⋅": "\\cdot ", "÷": "\\div ", "≤": "\\le ", "⩽": "\\le ",
    "≥": "\\ge ", "⩾": "\\ge ", "≠": "\\ne ", "∞": "\\infty ", "π": "\\pi ", "±": "\\pm ", "∪": "\\cup ",
    "∩": "\\cap ", "∈": "\\in ",
})
_VULGAR_FRACTIONS = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5),
                     "⅗": (3, 5), "⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅐": (1, 7), "⅛": (1, 8), "⅜": (3, 8),
                     "⅝": (5, 8), "⅞": (7, 8), "⅑": (1, 9), "⅒": (1, 10)}
# A digit run right before the fraction, or a space apart, is a mixed number ("1½", "1 ½": 1.5, not 1 x 0.5).
_VULGAR = re.compile(r"(?<!\d)(?:(\d+) ?)?([" + "".join(_VULGAR_FRACTIONS) + r"])")
_SUPERSCRIPT_DIGITS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻ⁿ", "0123456789+-n")
_SUPERSCRIPTS = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻ⁿ]+")
_ROOT_INDEX = {"√": "", "∛": "[3]", "∜": "[4]"}
# The radicand: one brace or parenthesis group without nesting, a number, \pi or one letter. Anything else
# ("√((x+1)/2)") is left as written: not equated, rather than guessed.
_ROOT = re.compile(r"([√∛∜])\s*(?:\{([^{}]{1,100})\}|\(([^()]{1,100})\)|(\d+(?:\.\d+)?|\\pi\b|[A-Za-z]))")
# Groups of exactly three digits joined by a LaTeX space (\, \; \: \! "\ " ~ \thinspace): one number. The first
# group has no leading zero ("0\,001" is not 1).
_LATEX_THOUSANDS = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:(?:\\[,;:! ]|~|\\thinspace ?)\d{3})+(?!\d)")
_LATEX_SPACE = re.compile(r"\\[,;:! ]|~|\\thinspace ?")
_WRAPPERS = (("**", "**"), ("__", "__"), ("*", "*"), ("`", "`"), ("\\[", "\\]"), ("\\(", "\\)"), ("$$", "$$"))
_TEXT_NUMBER = re.compile(r"\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{\s*([-+]?\d[^{}]*)\}")

# Unit and count words: a word of 4+ letters, or one of these shorter units; a single letter only inside a
# compound ("m/s", "m^2"), since "5 x" or "5 i" is a product, not 5 with a unit.
_SHORT_UNITS = frozenset(
    "cm mm km kg mg ml ft yd mi hr hrs min mins sec secs oz lb lbs mph kph kmh sq cu per usd eur gal qt pt".split())
# Words that change the number they follow, or hedge it: never read as a unit.
_VALUE_WORDS = frozenset(
    "thousand thousands million millions billion billions trillion trillions hundred hundreds dozen dozens score "
    "half halves third thirds quarter quarters fourth fourths fifth fifths sixth sixths seventh sevenths eighth "
    "eighths ninth ninths tenth tenths hundredth hundredths thousandth thousandths squared cubed root roots sqrt "
    "factorial prime percent percentage more less least most than over plus minus about approximately approx "
    "roughly nearly almost around infinity tens grand gross lakh lakhs crore crores inverse reciprocal negative "
    "positive maybe perhaps probably".split())
_UNIT_TOKEN = re.compile(r"([A-Za-z]+(?:/[A-Za-z]+)*)(\^\{?[23]\}?)?[.,]?")
_TOKEN = re.compile(r"\S+")


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


def normalised_answer(answer: str) -> str:
    """What math-verify is given for ``answer``: :func:`written_forms`, then :func:`canonical_answer`."""
    text = answer.translate(_FULL_WIDTH)
    if len(text) <= MAX_REWRITTEN_CHARS:
        text = written_forms(text)
    return canonical_answer(text)


def written_forms(answer: str) -> str:
    """``answer`` with the forms models write around a value rewritten as math-verify reads them (module doc)."""
    text = _unwrapped(answer.strip())
    number_in_text = _TEXT_NUMBER.fullmatch(text)
    if number_in_text:
        text = number_in_text.group(1).strip()
    text = unicode_math_to_latex(text)
    text = _LATEX_THOUSANDS.sub(lambda match: _LATEX_SPACE.sub("", match.group()), text)
    return without_unit_words(text)


def unicode_math_to_latex(text: str) -> str:
    """Unicode math notation in ``text`` as LaTeX: ``−½`` -> ``-\\frac{1}{2}``, ``2√2`` -> ``2\\sqrt{2}``,
    ``3×10⁻³`` -> ``3\\times 10^{-3}``, ``(−∞, 2]`` -> ``(-\\infty , 2]``."""
    text = text.translate(_UNICODE_SYMBOLS)
    text = _VULGAR.sub(_vulgar_as_latex, text)
    text = _SUPERSCRIPTS.sub(lambda match: "^{" + match.group().translate(_SUPERSCRIPT_DIGITS) + "}", text)
    return _ROOT.sub(_root_as_latex, text).strip()


def _vulgar_as_latex(match: re.Match[str]) -> str:
    numerator, denominator = _VULGAR_FRACTIONS[match.group(2)]
    fraction = f"\\frac{{{numerator}}}{{{denominator}}}"
    return f"({match.group(1)}+{fraction})" if match.group(1) else fraction


def _root_as_latex(match: re.Match[str]) -> str:
    radicand = next(group for group in match.groups()[1:] if group is not None)
    return f"\\sqrt{_ROOT_INDEX[match.group(1)]}{{{radicand.strip()}}}"


def _unwrapped(text: str) -> str:
    """``text`` without markdown or display-math delimiters around the whole of it (``**5**``, ``\\[5\\]``)."""
    for _ in range(3):  # nested at most a few deep in practice ("**`5`**")
        # A period after the wrapper ("**5**.") goes with it; otherwise the text is kept as written, since
        # math-verify reads "The answer is 19." and "The answer is 19" differently.
        bare = text.rstrip(".").strip()
        wrapper = next(((opening, closing) for opening, closing in _WRAPPERS
                        if len(bare) > len(opening) + len(closing)
                        and bare.startswith(opening) and bare.endswith(closing)), None)
        if wrapper is None:
            return text
        text = bare[len(wrapper[0]):-len(wrapper[1])].strip()
    return text


def without_unit_words(text: str) -> str:
    """``text`` without the unit or count words after its number: ``5 dollars``, ``80 km/h``, ``24 people``,
    ``6 liters per minute`` -> the number. Unchanged unless what is left ends a number (a digit, ``}``, ``)``,
    ``]``, ``$`` or ``\\pi``), so "5 thousand", "5 or more" or "three apples" keep their words."""
    tokens = list(_TOKEN.finditer(text))
    kept = len(tokens)
    while kept > 1 and _is_unit_token(tokens[kept - 1].group()):
        kept -= 1
    if kept == len(tokens) or kept == 0:
        return text
    head = text[:tokens[kept - 1].end()]
    ends_a_number = head[-1].isdigit() or head[-1] in "})]$" or head.endswith("\\pi")
    return head if ends_a_number and any(char.isdigit() for char in head) else text


def _is_unit_token(token: str) -> bool:
    match = _UNIT_TOKEN.fullmatch(token)
    if match is None:
        return False
    words = match.group(1).split("/")
    compound = len(words) > 1 or match.group(2) is not None
    return all(_is_unit_word(word, compound) for word in words)


def _is_unit_word(word: str, compound: bool) -> bool:
    lower = word.lower()
    if lower in _VALUE_WORDS:
        return False
    if lower in _SHORT_UNITS or len(word) >= 4:
        return True
    return len(word) == 1 and compound


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
