"""A pairwise (strength-2) covering design for the combination tests: every value of every factor meets every value of
every other factor in at least one case, in far fewer cases than the full product. Greedy and deterministic (AETG's
idea: each new case starts from a pair not yet covered and fills the other factors with the values that cover the most
new pairs), so the cases and their order never change between runs."""
from __future__ import annotations

from itertools import combinations


def pairs_of(case: dict, names: list[str]) -> set[tuple]:
    return {((a, case[a]), (b, case[b])) for a, b in combinations(names, 2)}


def _first_uncovered(uncovered: set, factors: dict[str, list]) -> tuple:
    """The uncovered pair that comes first in the factors' and their values' listed order (cases never change)."""
    names = list(factors)
    return min(uncovered, key=lambda pair: (names.index(pair[0][0]), names.index(pair[1][0]),
                                            factors[pair[0][0]].index(pair[0][1]), factors[pair[1][0]].index(pair[1][1])))


def all_pairs(factors: dict[str, list]) -> list[dict]:
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in combinations(names, 2) for x in factors[a] for y in factors[b]}
    cases: list[dict] = []
    while uncovered:
        (a, x), (b, y) = _first_uncovered(uncovered, factors)
        case = {a: x, b: y}
        for name in names:
            if name in case:
                continue
            # The value covering the most uncovered pairs with the values already chosen; ties: the first listed.
            case[name] = max(factors[name], key=lambda value: sum(
                ((other, case[other]), (name, value)) in uncovered or ((name, value), (other, case[other])) in uncovered
                for other in case))
        ordered = {name: case[name] for name in names}
        uncovered -= pairs_of(ordered, names)
        cases.append(ordered)
    return cases


def all_pairs_where(factors: dict[str, list], valid) -> list[tuple[dict, bool]]:
    """Pairwise cases under constraints that `valid(case)` decides (e.g. the config's own checks): (case, valid).
    Each case starts from an uncovered pair and fills the other factors with the value covering the most new pairs
    among those that keep the case valid (the factors not yet filled at their first value, the neutral one); where
    none does, with the neutral value. A valid case covers all its pairs; a case that cannot be made valid covers its
    starting pair only: it is that pair's refusal, every other value neutral, so the refusal is the pair's."""
    names = list(factors)
    neutral = {name: values[0] for name, values in factors.items()}
    uncovered = {((a, x), (b, y)) for a, b in combinations(names, 2) for x in factors[a] for y in factors[b]}
    cases: list[tuple[dict, bool]] = []
    while uncovered:
        (a, x), (b, y) = _first_uncovered(uncovered, factors)
        case = {a: x, b: y}
        for name in names:
            if name in case:
                continue
            gain = lambda value: sum(  # noqa: E731
                ((other, case[other]), (name, value)) in uncovered or ((name, value), (other, case[other])) in uncovered
                for other in case)
            ranked = sorted(factors[name], key=lambda value: -gain(value))  # stable: ties keep the listed order
            case[name] = next((value for value in ranked if valid({**neutral, **case, name: value})), neutral[name])
        ordered = {name: case[name] for name in names}
        holds = valid(ordered)
        uncovered -= pairs_of(ordered, names) if holds else {((a, x), (b, y))}
        cases.append((ordered, holds))
    return _without_redundant(cases, names)


def _without_redundant(cases: list[tuple[dict, bool]], names: list[str]) -> list[tuple[dict, bool]]:
    """Drop, first one first, each valid case whose pairs the other valid cases all cover (cases made late for the
    last uncovered pairs can cover an early case's): every pair stays covered, in fewer runs."""
    kept = list(cases)
    while True:
        covers = [pairs_of(case, names) if holds else set() for case, holds in kept]
        redundant = next((i for i, (_, holds) in enumerate(kept) if holds and covers[i] <= set().union(
            *(covers[j] for j in range(len(kept)) if j != i))), None)
        if redundant is None:
            return kept
        del kept[redundant]
