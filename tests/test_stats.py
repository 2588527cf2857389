"""The paired statistics behind the claims tables, against closed forms, t tables and hand
computations."""

import math

import pytest

from tools import stats  # noqa: E402


@pytest.mark.parametrize("x", [0.01, 0.3, 0.5, 0.77, 0.99])
def test_incomplete_beta_closed_forms(x):
    assert stats.incomplete_beta(1, 1, x) == pytest.approx(x, rel=1e-12)
    assert stats.incomplete_beta(3.5, 1, x) == pytest.approx(x ** 3.5, rel=1e-10)
    assert stats.incomplete_beta(1, 2.5, x) == pytest.approx(1 - (1 - x) ** 2.5, rel=1e-10)
    assert stats.incomplete_beta(2, 3, x) + stats.incomplete_beta(3, 2, 1 - x) == pytest.approx(1.0, rel=1e-12)
    assert stats.incomplete_beta(4.5, 4.5, 0.5) == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("t", [-30.0, -2.0, -0.3, 0.0, 0.7, 4.0, 60.0])
def test_t_cdf_closed_forms(t):
    # 1 degree of freedom is the Cauchy distribution, 2 and 4 have elementary CDFs
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    u = t / math.sqrt(1 + t * t / 4)
    assert stats.t_cdf(t, 4) == pytest.approx(0.5 + 0.375 * u * (1 - u * u / 12), abs=1e-12)


@pytest.mark.parametrize("df, value", [(1, 12.7062047), (2, 4.3026527), (4, 2.7764451), (9, 2.2621572),
                                       (30, 2.0422725), (10000, 1.9602012)])
def test_t_quantile_matches_t_tables(df, value):
    assert stats.t_quantile(0.975, df) == pytest.approx(value, abs=1e-6)
    assert stats.t_quantile(0.025, df) == pytest.approx(-value, abs=1e-6)


def test_paired_hand_computed():
    # d = 1..5: mean 3, sd sqrt(2.5), se sqrt(0.5), t = 3 / sqrt(0.5) = sqrt(18), 4 degrees of freedom;
    # half-width = 2.7764451 * sqrt(0.5); p from the df = 4 closed form at t^2 = 18
    r = stats.paired([1, 2, 3, 4, 5])
    half = 2.7764451 * math.sqrt(0.5)
    assert r["n"] == 5 and r["mean"] == 3 and r["sd"] == pytest.approx(math.sqrt(2.5))
    assert r["low"] == pytest.approx(3 - half, abs=1e-6) and r["high"] == pytest.approx(3 + half, abs=1e-6)
    u = math.sqrt(18) / math.sqrt(5.5)
    assert r["p"] == pytest.approx(2 * (0.5 - 0.375 * u * (1 - u * u / 12)), rel=1e-9)
    assert r["p"] == pytest.approx(0.0132356, abs=1e-7)
    assert (r["up"], r["down"]) == (5, 0)


def test_paired_edge_cases():
    one = stats.paired([0.4])
    assert one["low"] is None and one["p"] is None and one["up"] == 1
    same = stats.paired([0.25, 0.25, 0.25])                    # exact in binary: zero spread
    assert same["low"] == same["high"] == 0.25 and same["p"] == 0.0
    mixed = stats.paired([1.0, -1.0, 1.0, -1.0])               # mean 0: no evidence either way
    assert mixed["mean"] == 0 and mixed["p"] == pytest.approx(1.0) and (mixed["up"], mixed["down"]) == (2, 2)
    with pytest.raises(ValueError, match="share no seed"):
        stats.paired([])


def test_holm_hand_computed():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> monotone: 0.04 becomes 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adjusted = stats.holm([0.5, None, 0.9])
    assert adjusted[1] is None and adjusted[0] == pytest.approx(1.0) and adjusted[2] == pytest.approx(1.0)


def test_verdict_rule():
    assert stats.verdict(+0.1, 0.01, +1) == stats.REPRODUCES
    assert stats.verdict(-0.1, 0.01, -1) == stats.REPRODUCES
    assert stats.verdict(-0.1, 0.01, +1) == stats.CONTRADICTED
    assert stats.verdict(+0.1, 0.05, +1) == stats.NOT_SHOWN          # adjusted p must be below alpha
    assert stats.verdict(+0.1, None, +1) == stats.NOT_SHOWN          # one seed: no test
    assert stats.verdict(+0.1, 0.02, +1, alpha=0.01) == stats.NOT_SHOWN
    with pytest.raises(ValueError):
        stats.verdict(0.1, 0.01, 0)


def test_paired_then_holm_then_verdict_on_a_small_grid():
    """Three methods on 5 seeds: a clear gain survives the correction, a noisy one does not."""
    clear = stats.paired([0.05, 0.06, 0.04, 0.05, 0.055])
    noisy = stats.paired([0.05, -0.02, 0.04, 0.01, -0.01])
    worse = stats.paired([-0.03, -0.04, -0.035, -0.03, -0.045])
    adjusted = stats.holm([clear["p"], noisy["p"], worse["p"]])
    assert [stats.verdict(r["mean"], p, +1) for r, p in zip((clear, noisy, worse), adjusted)] == \
        [stats.REPRODUCES, stats.NOT_SHOWN, stats.CONTRADICTED]


def test_clopper_pearson_against_its_closed_forms_and_known_values():
    """k = 0: the upper end solves (1 - p)^n = alpha / 2, i.e. 1 - (alpha/2)^(1/n); k = n mirrors
    it. k = 2 of 10: 0.0252 and 0.5561 (the exact interval as tabulated, e.g. by R's binom.test)."""
    low, high = stats.clopper_pearson(0, 10)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 10), abs=1e-9)
    low, high = stats.clopper_pearson(10, 10)
    assert high == 1.0 and low == pytest.approx(0.025 ** (1 / 10), abs=1e-9)
    low, high = stats.clopper_pearson(2, 10)
    assert low == pytest.approx(0.02521, abs=5e-5) and high == pytest.approx(0.55610, abs=5e-5)
    # the defining tail probabilities, summed term by term: P(X >= 2 | p = low) = P(X <= 2 | p = high) = 0.025
    binom = lambda k, n, p: math.comb(n, k) * p ** k * (1 - p) ** (n - k)  # noqa: E731
    assert sum(binom(j, 10, low) for j in range(2, 11)) == pytest.approx(0.025, abs=1e-9)
    assert sum(binom(j, 10, high) for j in range(0, 3)) == pytest.approx(0.025, abs=1e-9)
    with pytest.raises(ValueError):
        stats.clopper_pearson(3, 2)


def test_exact_paired_p_against_every_split_of_the_discordant_pairs():
    """Two-sided: the probability, under fair coin flips, of a split no more likely than the one seen."""
    from itertools import product
    for b, c in ((6, 0), (0, 6), (5, 1), (3, 3), (7, 2), (0, 0), (1, 0)):
        n = b + c
        seen = math.comb(n, b)
        brute = sum(1 for flips in product((0, 1), repeat=n) if math.comb(n, sum(flips)) <= seen) / 2 ** n
        assert stats.exact_paired_p(b, c) == pytest.approx(brute, abs=1e-12)


def test_paired_power_against_every_outcome_of_four_pairs():
    from itertools import product
    alpha, p1, p2 = 0.2, 0.7, 0.2  # alpha 0.2: with 4 pairs, 0.05 is out of reach
    brute = 0.0
    for outcome in product(product((0, 1), repeat=2), repeat=4):
        probability = math.prod((p1 if x else 1 - p1) * (p2 if y else 1 - p2) for x, y in outcome)
        b, c = sum(x and not y for x, y in outcome), sum(y and not x for x, y in outcome)
        brute += probability * (b > c and stats.exact_paired_p(b, c) < alpha)
    assert stats.paired_power(4, p1, p2, alpha) == pytest.approx(brute, abs=1e-12)
    assert brute > 0
