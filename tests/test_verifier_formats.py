"""The `format` and `base_acc` checks are MindSpeed-RL's regular expressions rewritten as one linear pass: they give
the regexes' verdict on every short string over their markers (exhaustive random sampling, the regex as the oracle),
and a 64 KB response that repeats the markers (which the regexes take minutes on) scores in well under a second
through compute_rule_rewards. Runs in-process."""
import random
import re
import time

import pytest

from mindspeed_rl.data.rewards import _is_think_answer_boxed, _is_think_then_answer, compute_rule_rewards

# MindSpeed-RL's patterns, verbatim: the oracle.
FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL | re.MULTILINE)
BOXED = re.compile(r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>", re.DOTALL)
PIECES = ["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "}", "x", " ", "\n", "{"]


def _random_strings(count: int, seed: int):
    """Marker soup that mostly starts with <think> and often ends with </answer>, so both verdicts are common."""
    rng = random.Random(seed)
    for _ in range(count):
        middle = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
        start = "<think>" if rng.random() < 0.9 else ""
        end = rng.choice(["</answer>", "</answer>\n", "</answer>x", ""])
        yield start + middle + end


def _boxed_candidates(count: int, seed: int):
    """base_acc's markers, each kept or dropped, shuffled a little, with soup between them."""
    rng = random.Random(seed)
    markers = ["</think>", "<answer>", "\\boxed{", "}"]
    for _ in range(count):
        kept = [m for m in markers if rng.random() < 0.9]
        if rng.random() < 0.3:
            rng.shuffle(kept)
        body = "".join(m + "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 2))) for m in kept)
        yield rng.choice(["<think>", "", "x<think>"]) + body + rng.choice(["</answer>", "</answer>x", ""])


@pytest.mark.parametrize("oracle, check, texts, min_positives", [
    (FORMAT.match, _is_think_then_answer, _random_strings(40_000, seed=1), 200),
    (BOXED.fullmatch, _is_think_answer_boxed, _boxed_candidates(40_000, seed=2), 100),
], ids=["format", "base_acc"])
def test_the_linear_check_agrees_with_mindspeed_rls_regex(oracle, check, texts, min_positives):
    positives = 0
    for text in texts:
        want = oracle(text) is not None
        assert check(text) == want, repr(text)
        positives += want
    assert positives > min_positives  # the sample reaches the interesting cases


@pytest.mark.parametrize("verifier", ["format", "base_acc", "strict_format", "acc", "math_17k_acc", "acc_for_dapo",
                                      "step"])
def test_a_64kb_response_repeating_the_markers_scores_within_a_second(verifier):
    """The case that froze a run: the markers repeated without the closing tag the patterns need."""
    adversarial = "<think>" + "</think><answer>\\boxed{1}" * (64 * 1024 // 25)
    started = time.perf_counter()
    compute_rule_rewards([adversarial, adversarial + "\n" * 1000], ["1", "1"], [verifier], [1.0], timeout_seconds=1)
    assert time.perf_counter() - started < 1.0
