"""Final answers of math responses: extraction (last ``\\boxed{}``, DAPO's "Answer:" line) and
mathematical equivalence with HF ``math-verify`` under a per-sample time limit.

Time limit. math-verify bounds ``parse`` and each ``verify`` comparison with ``signal.alarm``,
which has two consequences handled here:

* ``signal.alarm`` takes whole seconds (a float makes math-verify's parse fail silently and
  return nothing), so the limit is rounded up to whole seconds. Parsing the prediction gets the
  whole limit and the comparison gets what is left of it (at least one second), so one
  (answer, label) check ends within ``ceil(limit) + 1`` seconds. A label is parsed once (under
  its own limit) and cached, as are verdicts, so verifiers sharing an answer pay once.
* Signals can only be installed from the main thread. Called from any other thread, the check
  runs with math-verify's timeouts off (a warning is logged once): the trainer scores rewards in
  the driver's main thread, and a worker thread would otherwise get no answer at all
  (math-verify raises there). A pathological expression then can stall that thread.

A timed-out check counts as "not equivalent".
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import re
import threading
import time
from typing import Iterator

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from mindspeed_rl.data.answer_forms import normalised_answer

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_TIME_LIMIT_SECONDS = 5.0
# DAPO's compute_score looks only at the tail of a response: the answer line must come last.
DAPO_ANSWER_WINDOW_CHARS = 300

# Any box command; the braced form "\boxed{...}" is the usual one, "\boxed 5" (TeX's one-token argument) the other.
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
# An unbraced box holds what follows it up to the end of its math or line ("\boxed 12$." -> "12"), as the MATH
# benchmark's last_boxed_only_string reads "\boxed ", capped: an answer is short.
_UNBRACED_BOX_CONTENT = re.compile(r"[^$\n]{1,100}")
# Tokens that end a model's turn: what follows one is not the model's answer.
END_OF_TURN_MARKERS = ("</s>", "<|im_end|>", "<|endoftext|>")
# DAPO's form: the last "Answer: ..." (any case) up to the end of its line.
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$")
_EXTRACTION_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_CACHE_SIZE = 16384

_sample_time_limit_seconds: contextvars.ContextVar[float] = contextvars.ContextVar(
    "sample_time_limit_seconds", default=DEFAULT_SAMPLE_TIME_LIMIT_SECONDS
)
_warned_no_timeout_off_main_thread = False


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    None when there is no box or the last one is never closed: a response whose final box is
    cut off has no final answer, even if an earlier box is complete. An empty box gives "".
    Escaped braces ``\\{ \\}`` (LaTeX set braces) are content, not structure. A box without
    braces (``\\boxed 5``, ``\\boxed7``) holds the rest of its line or math, trailing punctuation off.
    """
    last = None
    for last in _BOX_COMMAND.finditer(text):
        pass
    if last is None:
        return None
    if not text.startswith("{", last.end()):
        content = _UNBRACED_BOX_CONTENT.match(text, last.end())
        return content.group().strip().rstrip(".,;").strip() if content else None
    start = last.end() + 1
    depth = 1
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # skip the escaped character, e.g. "\{" or "\}"
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:index].strip()
        index += 1
    return None


def last_answer_line(text: str, *, window_chars: int = DAPO_ANSWER_WINDOW_CHARS) -> str | None:
    """The text after the last "Answer:" in the last ``window_chars`` characters, as DAPO reads it.

    Only the text before the first end-of-turn marker counts (``Answer: 5<|im_end|>`` answers 5, and
    the window ends at the marker). None when there is no such line or it is blank.
    """
    matches = _ANSWER_LINE.findall(before_end_of_turn(text)[-window_chars:])
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def before_end_of_turn(text: str) -> str:
    """``text`` up to its first end-of-turn marker (all of it without one)."""
    ends = [index for index in (text.find(marker) for marker in END_OF_TURN_MARKERS) if index != -1]
    return text[:min(ends)] if ends else text


def current_sample_time_limit() -> float:
    """The per-sample time limit, in seconds, that :func:`answers_equivalent` uses by default."""
    return _sample_time_limit_seconds.get()


@contextlib.contextmanager
def sample_time_limit(seconds: float) -> Iterator[None]:
    """Within the block, equivalence checks that name no limit use ``seconds`` per sample.

    A context variable, so the verifiers keep the plain ``(response, label)`` signature.
    """
    token = _sample_time_limit_seconds.set(checked_time_limit(seconds))
    try:
        yield
    finally:
        _sample_time_limit_seconds.reset(token)


def answers_equivalent(predicted: str, label: str, *, timeout_seconds: float | None = None) -> bool:
    """Whether ``predicted`` is mathematically the same answer as ``label``, per math-verify.

    Both are answer texts (e.g. a box's content), not whole responses: ``0.5``, ``\\frac12``,
    ``\\dfrac{1}{2}`` and ``1/2`` are equivalent; units in ``\\text{}`` are dropped; Unicode math (``½``,
    ``2√2``, ``x²``), LaTeX-spaced thousands (``1\\,000``), unit words (``5 dollars``), ``1e3``, ``∅``,
    full-width digits and number words are read first as :mod:`answer_forms` says. Empty texts are never
    equivalent. ``timeout_seconds`` defaults to :func:`current_sample_time_limit`.
    """
    limit = current_sample_time_limit() if timeout_seconds is None else checked_time_limit(timeout_seconds)
    return _equivalent(normalised_answer(predicted), normalised_answer(label), _alarm_seconds(limit))


def checked_time_limit(seconds: float) -> float:
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"per-sample time limit must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def _alarm_seconds(limit_seconds: float) -> int | None:
    """math-verify's timeout argument for this thread: whole seconds, or None off the main thread."""
    global _warned_no_timeout_off_main_thread
    if threading.current_thread() is threading.main_thread():
        return max(1, math.ceil(limit_seconds))
    if not _warned_no_timeout_off_main_thread:
        _warned_no_timeout_off_main_thread = True
        logger.warning(
            "math answers are checked outside the main thread: math-verify's signal-based time "
            "limit cannot run there, so checks in this thread have no time limit"
        )
    return None


def _as_math_text(answer: str) -> str:
    # An extracted answer is bare LaTeX ("\frac{1}{2}"); math-verify finds math inside $...$.
    # Text that already carries its own $ delimiters (not "\$", a dollar sign) is passed as written.
    return answer if _MATH_DELIMITER.search(answer) else f"${answer}$"


def _compact(answer: str) -> str:
    return "".join(answer.split()).strip("$")


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _parsed_label(label: str, alarm_seconds: int | None) -> tuple:
    # Labels repeat n_samples_per_prompt times per batch and across verifiers: parse once.
    return tuple(parse(_as_math_text(label), list(_EXTRACTION_CONFIG), parsing_timeout=alarm_seconds))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _equivalent(predicted: str, label: str, alarm_seconds: int | None) -> bool:
    # Cached: several verifiers of one response (acc, math_17k_acc, base_acc) check the same
    # (answer, label) pair, and a pathological answer then costs its time limit once.
    if not predicted or not label:
        return False
    if _compact(predicted) == _compact(label):
        return True
    gold = list(_parsed_label(label, alarm_seconds))
    if not gold:
        return False
    started = time.monotonic()
    target = parse(_as_math_text(predicted), list(_EXTRACTION_CONFIG), parsing_timeout=alarm_seconds)
    if not target:
        return False
    verify_seconds = None
    if alarm_seconds is not None:
        remaining = alarm_seconds - (time.monotonic() - started)
        if remaining <= 0:
            return False
        verify_seconds = max(1, math.ceil(remaining))
    return bool(verify(gold, target, timeout_seconds=verify_seconds))
