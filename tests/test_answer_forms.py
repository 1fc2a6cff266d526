"""Answer spellings MindSpeed-RL's verifiers equate and math-verify alone does not (data/answer_forms.py):
a table of cases through answers_equivalent, and the verifiers that read them."""

import pytest

from mindspeed_rl.data.answer_forms import canonical_answer, number_from_words
from mindspeed_rl.data.math_answers import answers_equivalent
from mindspeed_rl.data.rewards import VERIFIERS

EQUIVALENT = [
    # scientific notation (math-verify alone reads a lower-case e as Euler's number)
    ("1e3", "1000"), ("1E3", "1000"), ("2.5e-3", "0.0025"), ("-4e2", "-400"), ("+3e1", "30"), ("1.5e0", "1.5"),
    ("7e-1", r"\frac{7}{10}"), ("1000", "1e3"), (".5e1", "5"), ("6.02e3", "6020"),
    # the empty set
    (r"\varnothing", r"\emptyset"), (r"\emptyset", r"\varnothing"), ("∅", r"\emptyset"), (r"\varnothing", "∅"),
    (r"\{\}", r"\varnothing"), ("∅", r"\{\}"),
    # full-width digits, signs and separators
    ("１２", "12"), ("３．５", "3.5"), ("－５", "-5"), ("１／２", "0.5"), ("１０００", "1e3"), ("１２３４５", "12345"),
    ("（１，２）", "(1,2)"), ("２＋３", "5"), ("ｘ＝３", "3"), ("１２　", "12"),
    # number words
    ("zero", "0"), ("one", "1"), ("seven", "7"), ("twelve", "12"), ("nineteen", "19"), ("twenty", "20"),
    ("twenty-one", "21"), ("forty two", "42"), ("ninety-nine", "99"), ("one hundred", "100"),
    ("one hundred and five", "105"), ("three hundred twenty-one", "321"), ("two thousand", "2000"),
    ("two thousand and twenty-six", "2026"), ("one million", "1000000"), ("minus five", "-5"),
    ("negative twelve", "-12"), ("Seven", "7"), ("THREE", "3"), ("eight.", "8"), ("12", "twelve"),
    ("one thousand, two hundred", "1200"), ("fifteen", r"\frac{30}{2}"),
]

NOT_EQUIVALENT = [
    ("1e3", "100"), ("2.5e-3", "0.025"), ("one two", "3"), ("one two", "12"), ("twenty twenty", "40"),
    (r"\varnothing", "0"), ("１２", "21"), ("three apples", "3"), ("hundred", "100"), ("seven", "8"),
    ("e", "2.718"),
]


@pytest.mark.parametrize("predicted, label", EQUIVALENT)
def test_equivalent_spellings(predicted, label):
    assert answers_equivalent(predicted, label)


@pytest.mark.parametrize("predicted, label", NOT_EQUIVALENT)
def test_other_answers_stay_different(predicted, label):
    assert not answers_equivalent(predicted, label)


def test_the_table_is_large():
    assert len(EQUIVALENT) + len(NOT_EQUIVALENT) >= 60


@pytest.mark.parametrize("text", ["x^2", "x²", r"\frac{1}{2}", "3.14", "e^{2}", "one two", ""])
def test_other_answers_are_not_rewritten(text):
    assert canonical_answer(text) == text.strip()


def test_number_words_reject_what_is_not_a_number_phrase():
    assert number_from_words("and") is None
    assert number_from_words("hundred thousand") is None
    assert number_from_words("five hundred thousand") == 500_000


@pytest.mark.parametrize("name, response, expected", [
    ("acc", r"\boxed{three}", 1.0), ("acc", r"\boxed{1e3}", -0.5), ("math_17k_acc", r"\boxed{３}", 1.0),
    ("base_acc", r"<think>t</think><answer>\boxed{three}</answer>", 1.0),
])
def test_the_verifiers_read_these_forms(name, response, expected):
    assert VERIFIERS[name](response, "3") == expected


@pytest.mark.parametrize("response, expected", [
    (r"<think>t</think><answer>\boxed{3}</answer>", 1.0),
    (r"<think>t</think><answer>\boxed{3</answer>", -0.5),  # an unclosed box is malformed
])
def test_strict_format_needs_the_box_closed(response, expected):
    assert VERIFIERS["strict_format"](response, "") == expected
