"""Evaluation during training: the unbiased pass@k estimator against its closed form and brute force, and when
an evaluation is due. Runs in-process; the whole path through the CLI: test_train_grpo_e2e."""
import itertools
import math
from types import SimpleNamespace

import pytest

from mindspeed_rl.trainer.evaluation import Evaluation, pass_at_k


@pytest.mark.parametrize("n, correct, k", [(5, 2, 1), (5, 2, 2), (5, 2, 3), (5, 2, 4), (8, 0, 3), (8, 8, 1),
                                           (10, 3, 10), (4, 1, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n, correct, k):
    """Chen et al. 2021: 1 - C(n-c, k) / C(n, k) is exactly the fraction of the C(n, k) size-k subsets of the n
    samples that contain at least one of the c correct ones."""
    samples = [True] * correct + [False] * (n - correct)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, correct, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(n, correct, k) == pytest.approx(1 - math.comb(n - correct, k) / math.comb(n, k))


def test_pass_at_1_is_the_share_correct():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)


def test_pass_at_k_bad_arguments():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def _evaluation(interval: int, before: bool, with_data: bool = True) -> Evaluation:
    config = SimpleNamespace(rl_config=SimpleNamespace(eval_interval=interval, eval_before_train=before))
    return Evaluation(config, scoring=None, dataset=object() if with_data else None, strategy=None)


def test_evaluation_is_due_at_the_interval_and_before_training_only():
    every_3 = _evaluation(3, before=True)
    assert [u for u in range(0, 10) if every_3.due(u)] == [0, 3, 6, 9]
    assert [u for u in range(0, 10) if _evaluation(3, before=False).due(u)] == [3, 6, 9]
    assert not any(_evaluation(0, before=False).due(u) for u in range(10))
    assert not any(_evaluation(1, before=True, with_data=False).due(u) for u in range(10))


def test_majority_vote_takes_the_most_common_answer_and_ignores_samples_without_one():
    from mindspeed_rl.trainer.evaluation import majority_is_correct

    assert majority_is_correct(["7", "5", "7", None], [True, False, True, False])
    assert not majority_is_correct(["5", "7", "5", "7"], [False, True, False, True])  # a tie: the first seen
    assert not majority_is_correct([None, None], [False, False])


def test_final_answers_are_what_the_accuracy_verifier_reads():
    from mindspeed_rl.data.rewards import final_answer

    assert final_answer(" 07+1", ["arith_acc"]) == "7"
    assert final_answer("so \\boxed{3} then \\boxed{ 4 }", ["math_17k_acc", "format"]) == "4"
    assert final_answer("no box here", ["format"]) is None
