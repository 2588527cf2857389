"""tools/transition.py: Fisher's exact test against hand-computed tables, the leave-one-out
predictor and the parting step against constructed curves, the factorial's rule."""

import math

import pytest

from tools import transition


def test_fisher_exact_against_hand_computed_tables():
    # the lady tasting tea: 3 of 4 against 1 of 4; tables as or less likely: a = 0, 1, 3, 4 of the 4 successes
    assert transition.fisher_exact(3, 4, 1, 4) == pytest.approx(34 / 70)
    # 5 of 5 against 0 of 5: only the two extreme tables, each 1 / C(10, 5)
    assert transition.fisher_exact(5, 5, 0, 5) == pytest.approx(2 / math.comb(10, 5))
    # 2 of 10 against 0 of 10: P(a) = C(10, a) C(10, 2 - a) / C(20, 2); a = 1 (100/190) is likelier than a = 2
    assert transition.fisher_exact(2, 10, 0, 10) == pytest.approx(90 / 190)
    assert transition.fisher_exact(0, 10, 2, 10) == transition.fisher_exact(2, 10, 0, 10)
    assert transition.fisher_exact(3, 6, 3, 6) == pytest.approx(1.0)


def test_leave_one_out_calls_each_run_from_the_others():
    # well separated: every call right
    readings = [(0.9, True), (0.8, True), (0.1, False), (0.2, False), (0.15, False)]
    assert transition.leave_one_out(readings) == (2, 2, 0, 3)
    # one crossing run alone: without it no crossing run is left to learn from, so it is missed
    assert transition.leave_one_out([(0.9, True), (0.1, False), (0.2, False)]) == (0, 1, 0, 2)
    # a non-crossing run that reads high is a false alarm
    assert transition.leave_one_out([(0.9, True), (0.8, True), (0.85, False), (0.1, False)]) == (2, 2, 1, 2)


def test_parting_step_is_where_a_curve_stays_above_the_rest():
    steps = [0, 250, 500, 750]
    rest = [(steps, [0.1, 0.2, 0.2, 0.2]), (steps, [0.0, 0.1, 0.3, 0.3])]
    assert transition.parting_step((steps, [0.2, 0.1, 0.4, 0.5]), rest) == 500  # above at 0, below at 250
    assert transition.parting_step((steps, [0.2, 0.3, 0.4, 0.25]), rest) is None  # falls back at the end


def test_factorial_rule_names_the_factor_only_when_the_test_does():
    cells = {("C", "C"): (4, 4), ("N", "N"): (0, 3)}
    p, verdict = transition.factorial_verdict({**cells, ("C", "N"): (6, 6), ("N", "C"): (0, 6)})
    assert verdict == "the initialisation decides" and p == pytest.approx(2 / math.comb(12, 6))
    assert transition.factorial_verdict({**cells, ("C", "N"): (0, 6), ("N", "C"): (6, 6)})[1] == \
        "the data order decides"
    assert transition.factorial_verdict({**cells, ("C", "N"): (2, 6), ("N", "C"): (1, 6)})[1] == \
        "neither shown to decide"
    assert transition.factorial_verdict({**cells, ("C", "N"): (0, 0), ("N", "C"): (0, 6)}) == \
        (None, "not enough runs yet")


def test_seeds_for_power_is_the_fewest_with_80_percent():
    """At rates 0.10 and 0, n seeds a method give Fisher's p < 0.05 with probability P(n): the
    answer is the first n with P(n) >= 0.8 (60, the figure once typed in the README, gives 0.56)."""
    def power(n):
        return sum(math.comb(n, k) * 0.1 ** k * 0.9 ** (n - k) for k in range(n + 1)
                   if transition.fisher_exact(k, n, 0, n) < 0.05)
    n = transition.seeds_for_power()
    assert power(n) >= 0.8 > power(n - 1) and 70 < n < 90 and power(60) < 0.6


def test_per_initialisation_count_of_the_factorial():
    """Runs (init, data, acc, crossed): 1342 and 1346 cross in every run with another data order,
    1337-1339 in none: 2 of 2 against 0 of 3, Fisher p = 0.1 (1 / C(5, 2))."""
    runs = [(i, d, 0.0, i in (1342, 1346)) for i in (1337, 1338, 1339, 1342, 1346) for d in (1337, 1342) if i != d]
    (line,) = [l for l in transition.per_initialisation_lines(runs) if l]
    assert "2 of 2 crossing initialisations make it in every run, against 0 of 3 non-crossing ones" in line
    assert "Fisher's exact p = 0.1: **not shown at this size**." in line
    assert transition.fisher_exact(2, 2, 0, 3) == pytest.approx(0.1)
