"""The rule verifiers against a careful hand grading: tests/data/verifier_graded_pairs.jsonl holds model-style
responses with their label and a human grade (1: the final answer is mathematically the label), in the two answer
forms the verifiers read (the last ``\\boxed{}``, DAPO's "Answer:" line). The repo's verifier functions must agree
with the grade on at least 97% of each form's pairs and accept no pair graded 0 (a wrong answer rewarded).

Runs where: in the pytest process (math-verify's signal-based time limit needs the main thread, which pytest's is).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TypedDict

import pytest

from mindspeed_rl.data.rewards import VERIFIERS

PAIRS_PATH = Path(__file__).parent / "data" / "verifier_graded_pairs.jsonl"
MIN_AGREEMENT = 0.97
MIN_PAIRS = 400
MISSES_SHOWN = 12

# Each verifier's score for an accepted answer, and the answer form it reads. `acc` reads the box too, but only
# up to the first end-of-turn marker, so it is held to the same set.
ACCEPTED_SCORE = {"math_17k_acc": 1.0, "acc": 1.0, "acc_for_dapo": 1.0}
FORMAT_OF_VERIFIER = {"math_17k_acc": "boxed", "acc": "boxed", "acc_for_dapo": "dapo"}


class GradedPair(TypedDict):
    response: str
    label: str
    format: str
    grade: int
    note: str


def _load_pairs() -> list[GradedPair]:
    with PAIRS_PATH.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


PAIRS = _load_pairs()


def _verdicts(verifier: str) -> list[tuple[GradedPair, bool]]:
    """Each pair of the verifier's form with whether the verifier accepts its answer."""
    score = VERIFIERS[verifier]
    pairs = [pair for pair in PAIRS if pair["format"] == FORMAT_OF_VERIFIER[verifier]]
    return [(pair, score(pair["response"], pair["label"]) == ACCEPTED_SCORE[verifier]) for pair in pairs]


def _describe(misses: list[tuple[GradedPair, bool]]) -> str:
    return "\n".join(f"  grade {pair['grade']} ({pair['note']}): label {pair['label']!r}, response tail "
                     f"{pair['response'][-80:]!r}" for pair, _ in misses[:MISSES_SHOWN])


def test_the_set_has_400_pairs_in_both_forms_with_both_grades():
    counts = Counter((pair["format"], pair["grade"]) for pair in PAIRS)
    assert len(PAIRS) >= MIN_PAIRS, counts
    assert counts[("boxed", 0)] + counts[("boxed", 1)] >= 200, counts
    assert counts[("dapo", 0)] + counts[("dapo", 1)] >= 150, counts
    assert min(counts[("boxed", 0)], counts[("dapo", 0)]) > 0, counts


def test_every_pair_is_well_formed():
    for pair in PAIRS:
        assert set(pair) == {"response", "label", "format", "grade", "note"}, pair
        assert pair["format"] in ("boxed", "dapo") and pair["grade"] in (0, 1), pair
        assert pair["response"] and pair["label"] and pair["note"], pair


@pytest.mark.parametrize("verifier", sorted(FORMAT_OF_VERIFIER))
def test_the_verifier_agrees_with_the_grader(verifier):
    verdicts = _verdicts(verifier)
    misses = [(pair, accepted) for pair, accepted in verdicts if accepted != bool(pair["grade"])]
    agreement = 1 - len(misses) / len(verdicts)
    summary = (f"{verifier} on {FORMAT_OF_VERIFIER[verifier]} pairs: {len(verdicts) - len(misses)}/{len(verdicts)} "
               f"= {agreement:.1%} agree with the grader")
    print(summary)
    assert agreement >= MIN_AGREEMENT, f"{summary}; misses:\n{_describe(misses)}"


@pytest.mark.parametrize("verifier", sorted(FORMAT_OF_VERIFIER))
def test_the_verifier_accepts_no_wrong_answer(verifier):
    wrong = [(pair, accepted) for pair, accepted in _verdicts(verifier) if accepted and pair["grade"] == 0]
    assert not wrong, f"{verifier} accepts {len(wrong)} answers graded wrong:\n{_describe(wrong)}"
