"""Rule rewards: a registry of verifiers named by ``rl_config.verifier_function`` and combined with
``rl_config.verifier_weight``, as in MindSpeed-RL (``mindspeed_rl/models/rule_verifier.py``).

Each verifier is ``fn(response, label) -> float``. The scores keep MindSpeed-RL's meaning and
scale per name (see each function); where MindSpeed-RL compares answers with Qwen-math's
``math_equal``, mathruler's ``grade_answer`` or DAPO's string normalisation, this module uses
HF math-verify (:mod:`mindspeed_rl.data.math_answers`) for every name, so one notion of
"same answer" holds across verifiers. The format checks read the response with surrounding
whitespace stripped: a newline before the end-of-sequence token is not a format error.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where tensors are made: config checks read the registry only
    import torch


from mindspeed_rl.data.math_answers import (
    DEFAULT_SAMPLE_TIME_LIMIT_SECONDS,
    answers_equivalent,
    before_end_of_turn,
    checked_time_limit,
    last_answer_line,
    last_boxed_content,
)

Verifier = Callable[[str, str], float]

logger = logging.getLogger(__name__)
_FAILURES_SHOWN = 3

# ASCII digits only: str.isdigit() also accepts e.g. "²", which int() rejects.
_LEADING_INTEGER = re.compile(r"\s*([0-9]+)")
ARITH_FORMAT_CREDIT = 0.2

_BLANKS = re.compile(r"\s*")
# `step`: markers of step-by-step reasoning; three or more earn the full score. "^\d+\." is
# anchored to the start of the response only (no MULTILINE), as in MindSpeed-RL.
_REASONING_STEP = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")
STEPS_FOR_FULL_SCORE = 3


def leading_integer(response: str) -> str | None:
    """The digits at the start of ``response`` after leading whitespace, or None."""
    match = _LEADING_INTEGER.match(response)
    return match.group(1) if match else None


def arith_acc(response: str, answer: str) -> float:
    """1.0 if the response's leading integer equals ``answer``, 0.2 if it is another integer, else 0.

    The response is read from its first non-space character up to the first non-digit, so
    "7", " 7" and "7+1" all answer 7 and a response cut short by ``max_tokens`` still counts.
    Leading zeros compare numerically ("07" == "7").

    The 0.2 format credit is deliberate shaping: the demo policy starts as a randomly
    initialised model that almost never hits the answer, and rewarding "starts with a number"
    gives GRPO its first non-zero advantages. Use :func:`accuracy` to measure correctness.
    """
    digits = leading_integer(response)
    if digits is None:
        return 0.0
    return 1.0 if int(digits) == int(answer) else ARITH_FORMAT_CREDIT


def boxed_answer_is_correct(response: str, label: str) -> bool:
    """Whether the last non-empty ``\\boxed{}`` of ``response`` is equivalent to ``label``."""
    answer = last_boxed_content(response)
    return bool(answer) and answers_equivalent(answer, label)


def math_17k_acc(response: str, label: str) -> float:
    """1.0 if the last box's content equals the label mathematically, else 0.0. No format needed."""
    return 1.0 if boxed_answer_is_correct(response, label) else 0.0


def acc(response: str, label: str) -> float:
    """1.0 correct boxed answer, -0.5 boxed but wrong, -1.0 no (complete, non-empty) box.

    Only the text before the first end-of-turn marker counts.
    """
    answer = last_boxed_content(before_end_of_turn(response))  # MindSpeed-RL's `acc` stops at the first marker
    if not answer:
        return -1.0
    return 1.0 if answers_equivalent(answer, label) else -0.5


def base_acc(response: str, label: str) -> float:
    """1.0 if the response is ``<think>…</think>…<answer>…\\boxed{…}…</answer>`` and its last box
    is correct, else 0.0."""
    if not _is_think_answer_boxed(response.strip()):
        return 0.0
    return math_17k_acc(response, label)


def acc_for_dapo(response: str, label: str) -> float:
    """DAPO's score: 1.0 if the last "Answer: ..." line near the end is correct, else -1.0."""
    answer = last_answer_line(response)
    return 1.0 if answer is not None and answers_equivalent(answer, label) else -1.0


def format_reward(response: str, label: str) -> float:
    """``format``: 1.0 for ``<think>…</think>`` then ``<answer>…</answer>``, else 0.0. Label unused."""
    return 1.0 if _is_think_then_answer(response.strip()) else 0.0


def strict_format(response: str, label: str) -> float:
    """``strict_format``: 1.0 if well structured (see :func:`has_strict_structure`), else -0.5."""
    return 1.0 if has_strict_structure(response) else -0.5


# The two format checks below are what MindSpeed-RL writes as regular expressions with several `.*`, which
# backtrack in quadratic or worse time on a response repeating their markers (a 5 KB one took 50 s): here they are
# one left-to-right pass each, linear in the response whatever it holds.


def _is_think_then_answer(text: str) -> bool:
    r"""`format`, MindSpeed-RL's `^<think>.*?</think>\s*<answer>.*?</answer>$` (DOTALL, MULTILINE) matched at the
    start: the earliest "</think>" followed by blanks and "<answer>" leaves the most room for a "</answer>" that ends a
    line (MULTILINE's `$`: lines after it are not checked)."""
    if not text.startswith("<think>"):
        return False
    answer = -1
    close = text.find("</think>", 7)
    while close != -1 and answer == -1:
        start = _BLANKS.match(text, close + len("</think>")).end()  # each run of blanks follows one "</think>"
        answer = start if text.startswith("<answer>", start) else -1
        close = text.find("</think>", close + 1)
    if answer == -1:
        return False
    end = text.find("</answer>", answer + len("<answer>"))
    while end != -1:
        tail = end + len("</answer>")
        if tail == len(text) or text[tail] == "\n":  # `$` with MULTILINE: a line end or the text's end
            return True
        end = text.find("</answer>", end + 1)
    return False


def _is_think_answer_boxed(text: str) -> bool:
    r"""`base_acc`'s `<think>.*</think>.*<answer>.*\boxed\{.*\}.*</answer>` (DOTALL) as a full match: the markers in order,
    each found at its earliest place after the one before, the text starting with <think> and ending with </answer>."""
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    position, limit = len("<think>"), len(text) - len("</answer>")
    for marker in ("</think>", "<answer>", "\\boxed{", "}"):
        found = text.find(marker, position, limit)
        if found == -1:
            return False
        position = found + len(marker)
    return True


def has_strict_structure(response: str) -> bool:
    """Exactly one each of ``<think>``, ``</think>``, ``<answer>``, ``\\boxed{``, ``</answer>``, in
    that order, the response starting with ``<think>`` and ending with ``</answer>``, and the box closed
    inside the answer (an unclosed ``\\boxed{`` is malformed)."""
    text = response.strip()
    markers = ("<think>", "</think>", "<answer>", "\\boxed{", "</answer>")
    if any(text.count(marker) != 1 for marker in markers):
        return False
    positions = [text.find(marker) for marker in markers]
    in_order = positions == sorted(positions)
    closed = last_boxed_content(text[positions[3]:positions[4]]) is not None
    return in_order and closed and text.startswith("<think>") and text.endswith("</answer>")


def step(response: str, label: str) -> float:
    """``step``: min(1, number of reasoning-step markers / 3). Label unused."""
    return min(1.0, len(_REASONING_STEP.findall(response)) / STEPS_FOR_FULL_SCORE)


# ReTool's answer (MindSpeed-RL's math_dapo.compute_score with strict_box_verify): the response's last 300
# characters, of which the last 100 are searched for the final box. Reading the last 100 directly is the same.
RETOOL_ANSWER_WINDOW_CHARS = 100
RETOOL_TOOL_CALL_BONUS = 0.1


def retool_answer(response: str) -> str | None:
    """The content of the last complete ``\\boxed{}`` within the response's last 100 characters, or None."""
    return last_boxed_content(response[-RETOOL_ANSWER_WINDOW_CHARS:])


def retool_reward(response: str, label: str) -> float:
    """``retool_reward``: 1.0 if the final box (see :func:`retool_answer`) holds the label's answer, else -1.0.

    MindSpeed-RL compares the box's text with the label as strings; here math-verify decides, as for every box
    verifier. Their bonus for tool calls on a wrong answer needs the sample's call count:
    :func:`retool_tool_call_bonus`, applied by the caller.
    """
    answer = retool_answer(response)
    return 1.0 if answer and answers_equivalent(answer, label) else -1.0


def retool_tool_call_bonus(score: float, tool_calls: int) -> float:
    """MindSpeed-RL's shaping of a wrong answer's score: ``min(0, score + 0.1 * tool_calls)`` when the score is
    negative (a wrong answer that used the interpreter loses less, never gains), the score unchanged otherwise."""
    if isinstance(tool_calls, bool) or not isinstance(tool_calls, int) or tool_calls < 0:
        raise ValueError(f"tool_calls must be a non-negative integer, got {tool_calls!r}")
    return min(0.0, score + RETOOL_TOOL_CALL_BONUS * tool_calls) if score < 0 else score


# MindSpeed-RL's `acc_for_ppo` (mathruler's grade_answer on the last box, 1/0) and `math_verify_reward`
# (base_acc's format, then math-verify on the output against \boxed{label}, 1/0) are math_17k_acc and base_acc
# here: every name already compares the last box with math-verify.
VERIFIERS: dict[str, Verifier] = {
    "arith_acc": arith_acc,
    "acc": acc,
    "base_acc": base_acc,
    "math_verify_reward": base_acc,
    "math_17k_acc": math_17k_acc,
    "acc_for_ppo": math_17k_acc,
    "acc_for_dapo": acc_for_dapo,
    "format": format_reward,
    "strict_format": strict_format,
    "step": step,
    "retool_reward": retool_reward,
}

# How each accuracy verifier decides correctness, for `answer_is_correct`: its answer form.
_CORRECTNESS_BY_VERIFIER: dict[str, Callable[[str, str], bool]] = {
    "arith_acc": lambda response, label: arith_acc(response, label) == 1.0,
    "acc_for_dapo": lambda response, label: acc_for_dapo(response, label) == 1.0,
    "acc": boxed_answer_is_correct,
    "base_acc": boxed_answer_is_correct,
    "math_verify_reward": boxed_answer_is_correct,
    "math_17k_acc": boxed_answer_is_correct,
    "acc_for_ppo": boxed_answer_is_correct,
    "retool_reward": lambda response, label: retool_reward(response, label) == 1.0,
}

# The final answer each accuracy verifier reads (majority voting compares these strings).
_ANSWER_BY_VERIFIER: dict[str, Callable[[str], str | None]] = {
    "arith_acc": lambda response: None if (digits := leading_integer(response)) is None else str(int(digits)),
    "acc_for_dapo": last_answer_line,
    "acc": last_boxed_content,
    "base_acc": last_boxed_content,
    "math_verify_reward": last_boxed_content,
    "math_17k_acc": last_boxed_content,
    "acc_for_ppo": last_boxed_content,
    "retool_reward": retool_answer,
}


@dataclass(frozen=True, kw_only=True)
class RuleRewards:
    """Rewards of one batch: the weighted total and each verifier's unweighted scores."""

    total: torch.Tensor  # float32 [num_samples], sum_k weight_k * verifier_k
    per_verifier: dict[str, torch.Tensor]  # name -> float32 [num_samples], unweighted

    def __post_init__(self) -> None:
        import torch

        if self.total.dtype != torch.float32 or self.total.dim() != 1:
            raise ValueError(
                f"total must be float32 [num_samples], got {self.total.dtype} {tuple(self.total.shape)}"
            )
        for name, scores in self.per_verifier.items():
            if scores.dtype != torch.float32 or scores.shape != self.total.shape:
                raise ValueError(
                    f"per_verifier[{name!r}] must be float32 {tuple(self.total.shape)}, "
                    f"got {scores.dtype} {tuple(scores.shape)}"
                )

    def select(self, rows: "torch.Tensor") -> "RuleRewards":
        """The rewards of the samples `rows`, in that order (as RolloutBatch.select)."""
        return RuleRewards(total=self.total[rows], per_verifier={k: v[rows] for k, v in self.per_verifier.items()})

    @classmethod
    def concat(cls, parts: list["RuleRewards"]) -> "RuleRewards":
        """The samples of `parts` in order (as RolloutBatch.concat)."""
        import torch

        return cls(total=torch.cat([p.total for p in parts]),
                   per_verifier={k: torch.cat([p.per_verifier[k] for p in parts]) for k in parts[0].per_verifier})


def compute_rule_rewards(
    responses: list[str],
    labels: list[str],
    verifier_functions: list[str],
    verifier_weights: list[float],
    *,
    timeout_seconds: float = DEFAULT_SAMPLE_TIME_LIMIT_SECONDS,
) -> RuleRewards:
    """Score every response with every named verifier; ``total = sum_k weight_k * score_k``.

    The verifiers run behind a hard wall (:mod:`verifier_process`): each sample's check by each verifier gets
    ``timeout_seconds`` (math-verify's own limit inside, see :mod:`math_answers`) and a process that is killed
    past it, whatever the response is; such a sample, or one whose verifier raises, scores 0 from that
    verifier and is named in a warning. A name listed twice is scored once and its weights add up.
    """
    from mindspeed_rl.data.verifier_process import shared_verifier_process

    _check_rule_reward_args(responses, labels, verifier_functions, verifier_weights)
    checked_time_limit(timeout_seconds)
    verifiers = {name: VERIFIERS[name] for name in dict.fromkeys(verifier_functions)}
    scores, failures = shared_verifier_process().score(verifiers, responses, labels, timeout_seconds=timeout_seconds)
    for failure in failures[:_FAILURES_SHOWN]:
        logger.warning("verifier %s on sample %d scored 0: %s", failure.verifier, failure.sample, failure.reason)
    if len(failures) > _FAILURES_SHOWN:
        logger.warning("... and %d more verifier failures in this batch, each scored 0",
                       len(failures) - _FAILURES_SHOWN)
    return combine_verifier_scores(scores, verifier_functions, verifier_weights)


def combine_verifier_scores(scores: dict[str, list[float]], verifier_functions: list[str],
                            verifier_weights: list[float]) -> RuleRewards:
    """RuleRewards from each verifier's unweighted scores: ``total = sum_k weight_k * score_k``, summed in
    float64 in the order of ``verifier_functions`` (a name listed twice adds its weights). The reward
    workers (workers/reward_workers.py) combine their scores here too, so both paths agree bit for bit."""
    import torch

    per_verifier = {name: torch.tensor(scores[name], dtype=torch.float32) for name in dict.fromkeys(verifier_functions)}
    num_samples = len(next(iter(per_verifier.values()))) if per_verifier else 0
    total = torch.zeros(num_samples, dtype=torch.float64)
    for name, weight in zip(verifier_functions, verifier_weights):
        total += weight * per_verifier[name].to(torch.float64)
    return RuleRewards(total=total.to(torch.float32), per_verifier=per_verifier)


def answer_is_correct(response: str, label: str, verifier_functions: list[str]) -> bool:
    """Whether the response's final answer is right, in the answer form the verifiers read.

    The first accuracy verifier in ``verifier_functions`` decides: ``arith_acc`` the exact
    leading integer, ``acc_for_dapo`` the "Answer:" line, ``acc``/``base_acc``/``math_17k_acc``
    the last box (format requirements do not count). With only format verifiers, the last box.
    """
    _check_verifier_names(verifier_functions)
    for name in verifier_functions:
        if name in _CORRECTNESS_BY_VERIFIER:
            return _CORRECTNESS_BY_VERIFIER[name](response, label)
    return boxed_answer_is_correct(response, label)


def final_answer(response: str, verifier_functions: list[str]) -> str | None:
    """The response's final answer as :func:`answer_is_correct` reads it (stripped), or None without one."""
    reader = next((_ANSWER_BY_VERIFIER[n] for n in verifier_functions if n in _ANSWER_BY_VERIFIER),
                  last_boxed_content)
    answer = reader(response)
    return answer.strip() or None if answer is not None else None


def correct_answers(responses: list[str], labels: list[str], verifier_functions: list[str]) -> list[bool]:
    """Whether each response's answer is correct (:func:`answer_is_correct`)."""
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    _check_verifier_names(verifier_functions)
    return [answer_is_correct(r, a, verifier_functions) for r, a in zip(responses, labels)]


def accuracy(responses: list[str], labels: list[str], verifier_functions: list[str]) -> float:
    """Fraction of responses whose answer is correct (:func:`answer_is_correct`); 0.0 if none."""
    correct = correct_answers(responses, labels, verifier_functions)
    return sum(correct) / len(correct) if correct else 0.0


def _check_verifier_names(verifier_functions: list[str]) -> None:
    if not verifier_functions:
        raise ValueError(f"verifier_function is empty; registered verifiers: {sorted(VERIFIERS)}")
    for name in verifier_functions:
        if name not in VERIFIERS:
            raise ValueError(f"unknown verifier_function {name!r}; registered verifiers: {sorted(VERIFIERS)}")


def _check_rule_reward_args(
    responses: list[str],
    labels: list[str],
    verifier_functions: list[str],
    verifier_weights: list[float],
) -> None:
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    if len(verifier_functions) != len(verifier_weights):
        raise ValueError(
            f"verifier_function has {len(verifier_functions)} entries {verifier_functions} but "
            f"verifier_weight has {len(verifier_weights)} {verifier_weights}"
        )
    _check_verifier_names(verifier_functions)
