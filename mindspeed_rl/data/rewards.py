"""Rule rewards: a registry of verifiers named by ``rl_config.verifier_function`` and combined with
``rl_config.verifier_weight``, as in MindSpeed-RL."""

from __future__ import annotations

import re
from typing import Callable

import torch

Verifier = Callable[[str, str], float]

# ASCII digits only: str.isdigit() also accepts e.g. "²", which int() rejects.
_LEADING_INTEGER = re.compile(r"\s*([0-9]+)")
ARITH_FORMAT_CREDIT = 0.2


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


VERIFIERS: dict[str, Verifier] = {
    "arith_acc": arith_acc,
}


def compute_rule_rewards(
    responses: list[str],
    answers: list[str],
    verifier_functions: list[str],
    verifier_weights: list[float],
) -> torch.Tensor:
    """Per-response ``sum_k weight_k * verifier_k(response, answer)`` as a float32 tensor."""
    _check_rule_reward_args(responses, answers, verifier_functions, verifier_weights)
    verifiers = [(VERIFIERS[name], weight) for name, weight in zip(verifier_functions, verifier_weights)]
    scores = [
        sum(weight * verify(response, answer) for verify, weight in verifiers)
        for response, answer in zip(responses, answers)
    ]
    return torch.tensor(scores, dtype=torch.float32)


def _check_rule_reward_args(
    responses: list[str],
    answers: list[str],
    verifier_functions: list[str],
    verifier_weights: list[float],
) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    if len(verifier_functions) != len(verifier_weights):
        raise ValueError(
            f"verifier_function has {len(verifier_functions)} entries {verifier_functions} but "
            f"verifier_weight has {len(verifier_weights)} {verifier_weights}"
        )
    if not verifier_functions:
        raise ValueError(f"verifier_function is empty; registered verifiers: {sorted(VERIFIERS)}")
    for name in verifier_functions:
        if name not in VERIFIERS:
            raise ValueError(
                f"unknown verifier_function {name!r}; registered verifiers: {sorted(VERIFIERS)}"
            )


def accuracy(responses: list[str], answers: list[str]) -> float:
    """Fraction of responses whose leading integer is exactly the answer (no format credit)."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    if not responses:
        return 0.0
    correct = sum(arith_acc(response, answer) == 1.0 for response, answer in zip(responses, answers))
    return correct / len(responses)
