"""The pairwise generator of the combination tests (tests/allpairs.py): every pair of values is in some case, under
constraints every pair that can run runs in a valid case and each one that cannot is one refused case, and no valid
case is made redundant by the others. Runs where: in-process, no torch."""
from itertools import combinations

from allpairs import all_pairs, all_pairs_where, pairs_of

FACTORS = {"a": [0, 1, 2], "b": [0, 1, 2], "c": [False, True], "d": [False, True], "e": ["x", "y", "z"]}
NAMES = list(FACTORS)
EVERY_PAIR = {((p, x), (q, y)) for p, q in combinations(NAMES, 2) for x in FACTORS[p] for y in FACTORS[q]}


def _valid(case: dict) -> bool:
    return not (case["c"] and case["d"]) and not (case["a"] == 2 and case["e"] == "z")


def test_without_constraints_every_pair_is_covered_in_far_fewer_cases_than_the_product():
    cases = all_pairs(FACTORS)
    assert set().union(*(pairs_of(case, NAMES) for case in cases)) == EVERY_PAIR
    assert len(cases) < 3 * 3 * 2 * 2 * 3


def test_under_constraints_each_pair_runs_somewhere_or_is_its_own_refused_case():
    cases = all_pairs_where(FACTORS, _valid)
    assert all(_valid(case) == holds for case, holds in cases)
    covered = set().union(*(pairs_of(case, NAMES) for case, holds in cases if holds))
    refused = {frozenset(pairs_of(case, NAMES)) for case, holds in cases if not holds}
    impossible = {((("c", True), ("d", True))), (("a", 2), ("e", "z"))}
    assert covered == EVERY_PAIR - impossible
    assert all(any(pair in case for case in refused) for pair in impossible) and len(refused) == len(impossible)


def test_no_valid_case_is_covered_by_the_others():
    valid = [pairs_of(case, NAMES) for case, holds in all_pairs_where(FACTORS, _valid) if holds]
    for i, pairs in enumerate(valid):
        assert not pairs <= set().union(*(other for j, other in enumerate(valid) if j != i))
