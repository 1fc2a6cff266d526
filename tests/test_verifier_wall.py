"""The per-sample limit is a hard wall: verifiers run in a child process that is killed and replaced when a
sample overruns, so whatever the response, compute_rule_rewards returns within limit + 1 s per sample.
The deliberately bad verifiers are module-level functions: the verifier process imports them by name."""

import os
import re
import time

import pytest

from mindspeed_rl.data import rewards
from mindspeed_rl.data.rewards import VERIFIERS, compute_rule_rewards

LIMIT_SECONDS = 1.0


def catastrophic_regex(response: str, label: str) -> float:
    """Exponential backtracking inside the C regex engine: no signal interrupts it (2^40 steps)."""
    return 1.0 if re.fullmatch(r"(a+)+$", response) else 0.0


def exits_its_process(response: str, label: str) -> float:
    os._exit(3)


def raises(response: str, label: str) -> float:
    raise RecursionError("maximum recursion depth exceeded")


def eats_memory(response: str, label: str) -> float:
    return float(len(bytearray(64 << 30)))


def is_seven(response: str, label: str) -> float:
    return float(response == "7")


@pytest.fixture
def registered(monkeypatch):
    for function in (catastrophic_regex, exits_its_process, raises, eats_memory, is_seven):
        monkeypatch.setitem(VERIFIERS, function.__name__, function)


@pytest.mark.parametrize("bad", ["catastrophic_regex", "exits_its_process", "raises", "eats_memory"])
def test_a_bad_sample_scores_0_in_bounded_time_and_the_next_is_scored(registered, bad):
    responses = ["a" * 40 + "b", "7"]
    compute_rule_rewards(["7"], ["7"], ["is_seven"], [1.0])  # the verifier process is up
    started = time.monotonic()
    got = compute_rule_rewards(responses, ["7", "7"], [bad, "is_seven"], [1.0, 1.0], timeout_seconds=LIMIT_SECONDS)
    elapsed = time.monotonic() - started
    assert elapsed < 2 * (LIMIT_SECONDS + 1.0), elapsed  # at most one item per sample hits the wall
    assert got.per_verifier[bad].tolist() == [0.0, 0.0]
    assert got.per_verifier["is_seven"].tolist() == [0.0, 1.0]


def test_failures_are_named_in_a_warning(registered, caplog):
    compute_rule_rewards(["x"], ["7"], ["raises"], [1.0], timeout_seconds=LIMIT_SECONDS)
    assert "verifier raises on sample 0 scored 0: raised RecursionError" in caplog.text


ADVERSARIAL_64KB = {
    "unclosed boxes": "\\boxed{" * 9000,
    "nested boxes": "\\boxed{" * 8000 + "1" + "}" * 8000,
    "markers": "</think><answer>\\boxed{1}" * 2600,
    "think tags": "<think>" * 9000,
    "fractions": "\\frac{1}{" * 7000,
    "answer lines": "Answer: " * 8000,
    "digits": "9" * 65536,
    "exponents": "2^" * 32000 + "2",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_64KB))
def test_adversarial_64kb_responses_return_within_the_limit_with_every_verifier(name):
    response = ADVERSARIAL_64KB[name]
    assert len(response) >= 60_000
    names = sorted(rewards.VERIFIERS)
    started = time.monotonic()
    compute_rule_rewards([response], ["1"], names, [1.0] * len(names), timeout_seconds=LIMIT_SECONDS)
    elapsed = time.monotonic() - started
    assert elapsed < len(names) * (LIMIT_SECONDS + 1.0), elapsed


def test_a_child_started_ahead_is_the_one_that_scores(registered):
    from mindspeed_rl.data.verifier_process import VerifierProcess

    verifiers = VerifierProcess()
    try:
        verifiers.start()  # in the background: returns before the child is ready
        deadline = time.monotonic() + 60
        while verifiers._conn is None and time.monotonic() < deadline:  # ready
            time.sleep(0.01)
        started = verifiers._process.pid
        scores, failures = verifiers.score({"is_seven": is_seven}, ["7", "8"], ["", ""], timeout_seconds=LIMIT_SECONDS)
        assert scores == {"is_seven": [1.0, 0.0]} and failures == []
        assert verifiers._process.pid == started  # the child started ahead scored
    finally:
        verifiers.close()
