"""Rule verifiers (MindSpeed-RL's names) and math answer equivalence with the real math-verify.

Pure functions, single process. Expected scores are hand-written from MindSpeed-RL's meaning of
each name (mindspeed_rl/models/rule_verifier.py, math_dapo.py); equivalence is math-verify's.
"""

import threading
import time

import pytest
import torch

from mindspeed_rl.data.math_answers import (
    answers_equivalent,
    last_answer_line,
    last_boxed_content,
    sample_time_limit,
)
from mindspeed_rl.data.rewards import (
    VERIFIERS,
    RuleRewards,
    accuracy,
    answer_is_correct,
    compute_rule_rewards,
)

# A tower of powers: sympy tries to evaluate it exactly and never finishes on its own.
PATHOLOGICAL_BOX = r"\boxed{10^{10^{10}}}"

# (verifier, response, label, expected score)
CASES = [
    # math_17k_acc: last box, math equivalence, no format requirement; 1 / 0.
    ("math_17k_acc", r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    ("math_17k_acc", r"\boxed{0.5}", r"\frac12", 1.0),
    ("math_17k_acc", r"\boxed{\dfrac{1}{2}}", "1/2", 1.0),
    ("math_17k_acc", r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    ("math_17k_acc", r"\boxed{0.5}", r"\frac{1}{3}", 0.0),
    ("math_17k_acc", r"\boxed{10 \text{ cm}}", "10", 1.0),
    ("math_17k_acc", r"\boxed{\$18.90}", "18.9", 1.0),
    ("math_17k_acc", r"\boxed{-3}", "-3", 1.0),
    ("math_17k_acc", r"\boxed{3}", "-3", 0.0),
    ("math_17k_acc", r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    ("math_17k_acc", r"\boxed{(1,2]}", "(1,2]", 1.0),
    ("math_17k_acc", r"\boxed{[1,2)}", "(1,2)", 0.0),
    ("math_17k_acc", r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    ("math_17k_acc", r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),
    ("math_17k_acc", r"\boxed{3\sqrt{2}}", r"\sqrt{18}", 1.0),
    ("math_17k_acc", r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("math_17k_acc", r"\boxed{1,000}", "1000", 1.0),
    ("math_17k_acc", r"\boxed{x=3}", "3", 1.0),
    ("math_17k_acc", r"\boxed{0.333}", r"\frac{1}{3}", 0.0),
    ("math_17k_acc", r"First \boxed{2}, then finally \boxed{3}", "3", 1.0),
    ("math_17k_acc", r"First \boxed{3}, then finally \boxed{2}", "3", 0.0),
    ("math_17k_acc", r"\fbox{7}", "7", 1.0),
    ("math_17k_acc", r"so it is \boxed{3", "3", 0.0),
    ("math_17k_acc", r"\boxed{3} or maybe \boxed{3", "3", 0.0),
    ("math_17k_acc", r"\boxed{}", "3", 0.0),
    ("math_17k_acc", "The answer is 3", "3", 0.0),
    ("math_17k_acc", "", "3", 0.0),
    # acc: 1 correct box, -0.5 wrong box, -1 no usable box; text after an end-of-turn ignored.
    ("acc", r"\boxed{\frac{3}{4}}", "0.75", 1.0),
    ("acc", r"\boxed{4}", "0.75", -0.5),
    ("acc", "The answer is 0.75", "0.75", -1.0),
    ("acc", r"\boxed{}", "1", -1.0),
    ("acc", r"\boxed{2", "2", -1.0),
    ("acc", r"\boxed{2}<|im_end|>\boxed{3}", "2", 1.0),
    # base_acc: think/answer format holding a box AND a correct box; 1 / 0.
    ("base_acc", r"<think>2+2</think> <answer>The sum is \boxed{4}</answer>", "4", 1.0),
    ("base_acc", "<think>2+2</think>\n<answer>\\boxed{4}</answer>\n", "4", 1.0),
    ("base_acc", r"<think>2+2</think> <answer>\boxed{5}</answer>", "4", 0.0),
    ("base_acc", "<think>2+2</think> <answer>4</answer>", "4", 0.0),
    ("base_acc", r"\boxed{4}", "4", 0.0),
    ("base_acc", r"<answer>\boxed{4}</answer><think>2+2</think>", "4", 0.0),
    ("base_acc", r"<think>2+2</think><answer>\boxed{4}</answer> and more", "4", 0.0),
    # acc_for_dapo: last "Answer:" line in the tail; 1 / -1.
    ("acc_for_dapo", "2 times 17 is 34.\nAnswer: 34", "34", 1.0),
    ("acc_for_dapo", r"Answer: $\frac{1}{2}$", "0.5", 1.0),
    ("acc_for_dapo", "answer: 7\n", "7", 1.0),
    ("acc_for_dapo", r"Answer: \boxed{12}", "12", 1.0),
    ("acc_for_dapo", "Answer: 5\nno wait.\nAnswer: 6", "6", 1.0),
    ("acc_for_dapo", "Answer: 5\nno wait.\nAnswer: 6", "5", -1.0),
    ("acc_for_dapo", r"\boxed{34}", "34", -1.0),
    ("acc_for_dapo", "Answer:", "3", -1.0),
    ("acc_for_dapo", "Answer: 34\n" + "and then I kept on talking. " * 12, "34", -1.0),
    # format: <think>..</think> then <answer>..</answer>; 1 / 0.
    ("format", "<think>reason</think>\n<answer>4</answer>", "4", 1.0),
    ("format", "<think>reason</think><answer>4</answer>\n", "4", 1.0),
    ("format", "<answer>4</answer>", "4", 0.0),
    ("format", "Sure. <think>r</think><answer>4</answer>", "4", 0.0),
    ("format", "<think>r</think><answer>4", "4", 0.0),
    ("format", "<think>r</think><answer>4</answer> trailing", "4", 0.0),
    ("format", "<think>r</think><answer>4</answer>\nlater lines are not checked", "4", 1.0),
    # strict_format: one of each tag and one box, in order; 1 / -0.5.
    ("strict_format", r"<think>r</think><answer>\boxed{4}</answer>", "4", 1.0),
    ("strict_format", "<think>r</think><answer>4</answer>", "4", -0.5),
    ("strict_format", r"<think>r</think><answer>\boxed{4} \boxed{5}</answer>", "4", -0.5),
    ("strict_format", r"<think>r</think><think>s</think><answer>\boxed{4}</answer>", "4", -0.5),
    ("strict_format", r"<think>r</think>\boxed{4}<answer></answer>", "4", -0.5),
    # step: min(1, step markers / 3).
    ("step", "Step 1: add\nStep 2: carry\nStep 3: done", "", 1.0),
    ("step", "First, add. Next, carry.", "", 2.0 / 3.0),
    ("step", "1. add\n2. carry", "", 1.0 / 3.0),
    ("step", "\n- a\n- b\n- c\n- d", "", 1.0),
    ("step", "just the number 4", "", 0.0),
    # arith_acc (the CPU demo): leading integer, 0.2 format credit.
    ("arith_acc", " 7", "7", 1.0),
    ("arith_acc", "12", "1", 0.2),
    ("arith_acc", r"\boxed{7}", "7", 0.0),
    # MindSpeed-RL's acc_for_ppo: the last box against the label, 1 / 0, no format.
    ("acc_for_ppo", r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    ("acc_for_ppo", r"\boxed{3}", "4", 0.0),
    ("acc_for_ppo", "no box: 3", "3", 0.0),
    # MindSpeed-RL's math_verify_reward: <think>...</think>...<answer>...\boxed{...}...</answer>, then the answer.
    ("math_verify_reward", r"<think>a</think> <answer>\boxed{0.5}</answer>", r"\frac12", 1.0),
    ("math_verify_reward", r"<think>a</think> <answer>\boxed{2}</answer>", "3", 0.0),
    ("math_verify_reward", r"<answer>\boxed{3}</answer>", "3", 0.0),
    # MindSpeed-RL's retool_reward: the last box within the last 100 characters, 1 / -1 (the tool bonus is the
    # rollout's, trainer/multi_turn.with_tool_call_bonus).
    ("retool_reward", r"<tool_response>42</tool_response> so \boxed{42}", "42", 1.0),
    ("retool_reward", r"\boxed{42}" + " and more" * 20, "42", -1.0),
    ("retool_reward", "no box", "42", -1.0),
]


@pytest.mark.parametrize("name, response, label, expected", CASES)
def test_verifier_scores_table(name, response, label, expected):
    assert VERIFIERS[name](response, label) == pytest.approx(expected)


def test_table_covers_every_registered_verifier():
    assert {case[0] for case in CASES} == set(VERIFIERS)
    assert len(CASES) >= 40


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        (r"a \boxed{1} b \boxed { 2 } c", "2"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed{}", ""),
        (r"\boxed{\frac{1}{2}", None),
        ("no box", None),
    ],
)
def test_last_boxed_content_balances_nested_braces(text, expected):
    assert last_boxed_content(text) == expected


def test_last_answer_line_reads_only_the_tail():
    assert last_answer_line("Answer: 1\nANSWER :  2 \n") == "2"
    assert last_answer_line("Answer: 1\n" + "x" * 400) is None


def test_pathological_expression_returns_within_time_limit():
    started = time.monotonic()
    rewards = compute_rule_rewards([PATHOLOGICAL_BOX], ["1"], ["math_17k_acc", "acc"], [1.0, 1.0],
                                   timeout_seconds=1.0)
    elapsed = time.monotonic() - started
    # One whole-second alarm for parsing plus at most one for the comparison (module docstring);
    # the second verifier reuses the cached verdict.
    assert elapsed < 3.5
    assert rewards.per_verifier["math_17k_acc"].tolist() == [0.0]
    assert rewards.per_verifier["acc"].tolist() == [-0.5]


def test_fractional_time_limit_still_checks_answers():
    # signal.alarm takes whole seconds; a float passed straight to math-verify makes it fail silently.
    with sample_time_limit(0.25):
        assert answers_equivalent("0.125", r"\frac{1}{8}")


def test_equivalence_works_off_the_main_thread():
    results = []
    worker = threading.Thread(target=lambda: results.append(answers_equivalent("0.25", r"\frac{1}{4}")))
    worker.start()
    worker.join(timeout=30)
    assert results == [True]


def test_time_limit_must_be_positive():
    with pytest.raises(ValueError, match="positive number of seconds"):
        compute_rule_rewards(["x"], ["1"], ["format"], [1.0], timeout_seconds=0.0)


def test_compute_rule_rewards_weights_and_per_verifier_scores():
    responses = [
        r"<think>6*7</think><answer>\boxed{42}</answer>",
        r"<think>6*7</think><answer>\boxed{41}</answer>",
        r"\boxed{42}",
        "42",
    ]
    got = compute_rule_rewards(responses, ["42"] * 4, ["math_17k_acc", "format"], [1.0, 0.5])
    assert isinstance(got, RuleRewards)
    torch.testing.assert_close(got.per_verifier["math_17k_acc"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(got.per_verifier["format"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(got.total, torch.tensor([1.5, 0.5, 1.0, 0.0]))
    assert got.total.dtype == torch.float32
    assert set(got.per_verifier) == {"math_17k_acc", "format"}


def test_compute_rule_rewards_adds_weights_of_a_repeated_name():
    got = compute_rule_rewards([r"\boxed{-1}"], ["2"], ["acc", "acc"], [1.0, 2.0])
    torch.testing.assert_close(got.total, torch.tensor([-1.5]))
    torch.testing.assert_close(got.per_verifier["acc"], torch.tensor([-0.5]))


def test_unknown_verifier_name_lists_registered_ones():
    with pytest.raises(ValueError, match=r"'nope'.*acc_for_dapo.*math_17k_acc.*strict_format"):
        compute_rule_rewards(["7"], ["7"], ["nope"], [1.0])
    with pytest.raises(ValueError, match=r"'nope'"):
        accuracy(["7"], ["7"], ["nope"])


def test_mismatched_weights_are_rejected():
    with pytest.raises(ValueError, match="verifier_weight has 2"):
        compute_rule_rewards(["7"], ["7"], ["acc"], [1.0, 1.0])


def test_rule_rewards_rejects_misshaped_scores():
    with pytest.raises(ValueError, match=r"per_verifier\['acc'\]"):
        RuleRewards(total=torch.zeros(2), per_verifier={"acc": torch.zeros(3)})


def test_answer_is_correct_for_arith_demo_needs_exact_integer():
    assert answer_is_correct(" 7", "7", ["arith_acc"])
    assert not answer_is_correct("12", "1", ["arith_acc"])  # the 0.2 format credit is not correct


def test_answer_is_correct_for_boxed_verifiers_ignores_format():
    assert answer_is_correct(r"\boxed{\frac{1}{2}}", "0.5", ["base_acc", "format"])
    assert not answer_is_correct(r"\boxed{2}", "0.5", ["math_17k_acc"])
    assert answer_is_correct(r"\boxed{0.5}", "1/2", ["format"])  # no accuracy verifier: last box


def test_answer_is_correct_for_dapo_reads_answer_line():
    assert answer_is_correct("Answer: 0.5", r"\frac12", ["acc_for_dapo"])
    assert not answer_is_correct(r"\boxed{0.5}", r"\frac12", ["acc_for_dapo"])


def test_accuracy_is_mean_of_correct_answers():
    responses = [r"\boxed{1}", r"\boxed{2}", r"\boxed{\frac{6}{2}}", "4"]
    assert accuracy(responses, ["1", "1", "3", "4"], ["math_17k_acc"]) == pytest.approx(0.5)
    assert accuracy([], [], ["math_17k_acc"]) == 0.0
