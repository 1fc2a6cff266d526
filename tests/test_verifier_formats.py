"""The `format` and `base_acc` checks are MindSpeed-RL's regular expressions rewritten as one linear pass: they give
the regexes' verdict on every short string over their markers (exhaustive random sampling, the regex as the oracle),
and a 64 KB response that repeats the markers (which the regexes take minutes on) scores in well under a second
through compute_rule_rewards. The answer forms models write (data/answer_forms.written_forms, the unbraced box,
the DAPO line's end-of-turn marker; tests/test_verifier_agreement.py measures them against a hand grading) have one
test per rule family, each with a wrong answer the rule must leave wrong. Runs in-process."""
import random
import re
import time

import pytest

from mindspeed_rl.data.answer_forms import MAX_REWRITTEN_CHARS, normalised_answer, written_forms
from mindspeed_rl.data.math_answers import answers_equivalent, last_answer_line, last_boxed_content
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


@pytest.mark.parametrize("written, label, same", [
    ("½", r"\frac{1}{2}", True), ("1½", "1.5", True), ("−2½", "-2.5", True), ("2 ½", "2.5", True), ("⅓", "0.5", False),
    ("2√2", r"2\sqrt{2}", True), ("√(x+1)", r"\sqrt{x+1}", True), ("∛2", r"\sqrt[3]{2}", True), ("2√2", "2", False),
    ("x² + 2x + 1", "(x+1)^2", True), ("3×10⁵", "300000", True), ("2.5×10⁻³", "0.0025", True), ("10⁻³", "10", False),
    ("(−∞, 2]", r"(-\infty,2]", True), ("6π", r"6\pi", True), ("3·4·5", "60", True), ("x ≥ 3", r"x \le 3", False),
])
def test_unicode_math_notation_reads_as_latex(written, label, same):
    assert answers_equivalent(written, label) is same


@pytest.mark.parametrize("written, label, same", [
    (r"1\,250", "1250", True), (r"12\,345\,678", "12345678", True), (r"10\;080", "10080", True),
    (r"10\ 000", "10000", True), (r"1~000", "1000", True), (r"1\,000", "100", False), (r"12\,500", "1250", False),
])
def test_latex_spaced_thousands_are_one_number(written, label, same):
    assert answers_equivalent(written, label) is same


def test_a_latex_space_before_other_than_three_digits_is_not_a_thousands_separator():
    assert written_forms(r"1\,0000") == r"1\,0000"
    assert written_forms(r"0\,001") == r"0\,001"


@pytest.mark.parametrize("written, label, same", [
    ("**64**", "64", True), ("*128*", "128", True), ("`77`", "77", True), (r"**$\frac{1}{2}$**", "0.5", True),
    (r"\[96\]", "96", True), ("**46**", "64", False), (r"\[64\]", "96", False),
])
def test_markdown_and_display_delimiters_around_the_answer_are_dropped(written, label, same):
    assert answers_equivalent(written, label) is same


@pytest.mark.parametrize("written, label, same", [
    (r"\text{5 cm}", "5", True), (r"\text{3 hours}", "3", True), (r"\mbox{12 dollars}", "12", True),
    (r"\text{50 cm}", "5", False), (r"\text{5 or 7}", "5", False), (r"\text{5 thousand}", "5", False),
])
def test_a_number_and_its_unit_inside_text_read_as_the_number(written, label, same):
    assert answers_equivalent(written, label) is same


@pytest.mark.parametrize("written, label, same", [
    ("12 dollars", "12", True), ("80 km/h", "80", True), ("24 people", "24", True), ("49 m^2", "49", True),
    ("50 cm²", "50", True), ("6 liters per minute", "6", True), ("$8$ kg", "8", True), (r"9\pi cm^2", r"9\pi", True),
    ("7 pairs.", "7", True), ("1200 dollars", "120", False), ("5 thousand", "5", False), ("5 dozen", "5", False),
    ("2 pi", "2", False), ("2 squared", "2", False), ("5 factorial", "5", False), ("5 xy", "5", False),
    ("5 i", "5", False), ("3 or 4", "3", False), ("three apples", "3", False),
])
def test_unit_and_count_words_after_a_number_are_dropped_unless_they_change_it(written, label, same):
    assert answers_equivalent(written, label) is same


@pytest.mark.parametrize("response, content", [
    (r"The answer is $\boxed 5$.", "5"), (r"Final answer: \boxed 12", "12"), (r"\boxed7", "7"),
    ("\\boxed 9.\nDone.", "9"), (r"\boxed{3} then \boxed 4", "4"), (r"\boxed 4 then \boxed{3}", "3"),
    ("ends with \\boxed", None), (r"\boxed $5$", None), (r"\boxedanswer 5", None),
])
def test_a_box_without_braces_holds_the_rest_of_its_line(response, content):
    assert last_boxed_content(response) == content


@pytest.mark.parametrize("response, answer", [
    ("Answer: 42<|im_end|>", "42"), (r"Answer: \sqrt{3}</s>", r"\sqrt{3}"), ("Answer: 1{,}024<|endoftext|>", "1{,}024"),
    ("Answer: 5<|im_end|>\n<|im_start|>user\nAnswer: 7", "5"), ("Answer: 5" + "<|endoftext|>" * 40, "5"),
    ("<|im_end|>Answer: 5", None),
])
def test_the_dapo_answer_line_ends_at_an_end_of_turn_marker(response, answer):
    assert last_answer_line(response) == answer


def test_the_rewrites_leave_long_text_alone_in_bounded_time():
    """An answer past MAX_REWRITTEN_CHARS gets no rewrite (no box of a 64 KB response is a final answer), and
    the worst inputs up to it take milliseconds."""
    long_answer = "½" * (MAX_REWRITTEN_CHARS + 1)
    assert normalised_answer(long_answer) == long_answer
    worst = [r"1\,00" * 250, "1" * 999 + "½", "√(" * 500, "²" * 1000, "cm " * 333, "m/" * 500,
             "\\text{" + " " * 990 + "1"]
    started = time.perf_counter()
    for text in worst:
        normalised_answer(text[:MAX_REWRITTEN_CHARS])
    assert time.perf_counter() - started < 0.5
