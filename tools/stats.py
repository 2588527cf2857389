"""
Paired statistics for the comparison grids: is a method's effect bigger than seed noise?

A seed fixes the init and the data order, and moves every method of a grid together, so each
method is compared with its baseline on the same seeds: d_s = method_s - baseline_s. Over the n
shared seeds:

    mean = sum(d) / n,   sd = sample std (n - 1),   se = sd / sqrt(n)
    95 % CI = mean -+ t_{0.975, n-1} * se          (Student's t, n - 1 degrees of freedom)
    p = two-sided p-value of the paired t-test, t = mean / se

A grid asks many such questions at once (one per claim); with 15 claims at alpha = 0.05 about
one would pass by chance. Holm's step-down correction controls that (the family-wise error rate)
without assuming the tests are independent: sort the m p-values, multiply the i-th smallest by
(m - i + 1), and make the sequence non-decreasing.

The verdict of a claim then follows from the numbers by one rule (verdict()): reproduces when
the Holm-adjusted p < alpha and the mean goes the paper's way; contradicted when adjusted p <
alpha and it goes the other way; otherwise not shown. Nothing here needs scipy: the t
distribution comes from the regularized incomplete beta function, by its continued fraction.
"""

import math


def _beta_continued_fraction(a, b, x, iterations=300, tol=1e-15):
    """The continued fraction of I_x(a, b) (valid, and fast, for x < (a + 1) / (a + b + 2)),
    evaluated with the modified Lentz method: x^a (1-x)^b / (a B(a,b)) times 1 / (1 + d1 / (1 +
    d2 / (1 + ...))), d_{2m} = m(b-m)x / ((a+2m-1)(a+2m)), d_{2m+1} = -(a+m)(a+b+m)x / ((a+2m)(a+2m+1))."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, iterations + 1):
        for coefficient in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + coefficient * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + coefficient / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < tol:
            break
    return h


def incomplete_beta(a, b, x):
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta: x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    # I_x(a,b) = 1 - I_{1-x}(b,a)
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))   # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(q, df):
    """The t with P(T <= t) = q (bisection on t_cdf, to ~1e-12)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_quantile: q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < q:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, df) < q else (low, mid)
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


def paired(differences, confidence=0.95):
    """Summary of per-seed paired differences: n, mean, sd, the t confidence interval (low,
    high), the two-sided p of the paired t-test, and how many seeds go up / down. With one seed
    there is no interval (None) and p is None; with zero spread the interval is the point and p
    is 0 (or 1 when the mean is 0)."""
    d = [float(x) for x in differences]
    n = len(d)
    if n == 0:
        raise ValueError("paired: no differences (the method and its baseline share no seed)")
    mean = sum(d) / n
    up, down = sum(x > 0 for x in d), sum(x < 0 for x in d)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "low": None, "high": None, "p": None, "up": up,
                "down": down}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * se
    if se == 0.0:
        p = 1.0 if mean == 0.0 else 0.0
    else:
        p = 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "p": p, "up": up,
            "down": down}


def beta_quantile(q, a, b):
    """The x with I_x(a, b) = q (bisection on incomplete_beta, to ~1e-12)."""
    low, high = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if incomplete_beta(a, b, mid) < q else (low, mid)
        if high - low < 1e-12:
            break
    return 0.5 * (low + high)


def clopper_pearson(k, n, confidence=0.95):
    """Exact (Clopper-Pearson) confidence interval of a rate seen k times in n trials, e.g. how
    often a seed makes a transition: the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles
    of Beta(k, n - k + 1) and Beta(k + 1, n - k), with 0 and 1 at the edges. It never undercovers,
    which matters at k = 0 or k = n with 10 seeds, where a normal approximation gives nonsense."""
    if not 0 <= k <= n or n == 0:
        raise ValueError(f"clopper_pearson: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    alpha = 1.0 - confidence
    low = 0.0 if k == 0 else beta_quantile(alpha / 2, k, n - k + 1)
    high = 1.0 if k == n else beta_quantile(1 - alpha / 2, k + 1, n - k)
    return low, high


def holm(p_values):
    """Holm-adjusted p-values, in the input's order (None stays None and is not counted)."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m, adjusted, running = len(indexed), [None] * len(p_values), 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


REPRODUCES, CONTRADICTED, NOT_SHOWN = "reproduces", "contradicted", "not shown"


def verdict(mean, p_adjusted, direction, alpha=0.05):
    """The rule behind every claims table. direction: +1 if the paper says the method raises the
    metric, -1 if it lowers it. Reproduces: Holm-adjusted p < alpha and the paired mean goes the
    paper's way; contradicted: adjusted p < alpha and it goes the other way; otherwise (too few
    seeds, too much spread, or no effect) not shown."""
    if direction not in (1, -1):
        raise ValueError(f"verdict: direction must be +1 or -1, got {direction}")
    if p_adjusted is None or p_adjusted >= alpha or mean == 0:
        return NOT_SHOWN
    return REPRODUCES if (mean > 0) == (direction > 0) else CONTRADICTED


def exact_paired_p(b, c):
    """Two-sided exact McNemar test of paired yes/no outcomes: b pairs where only the first arm
    says yes, c where only the second does (the pairs that agree carry no information). Under
    no difference each discordant pair goes either way with probability 1/2, so p is the
    binomial probability of a split at least as uneven as min(b, c), both tails, at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n)


def paired_power(n, p_first, p_second, alpha=0.05):
    """The probability that exact_paired_p < alpha with the first arm ahead, over n pairs whose
    arms say yes independently with probabilities p_first and p_second: every (b, c) weighed
    by its multinomial probability."""
    only_first, only_second = p_first * (1 - p_second), p_second * (1 - p_first)
    agree = 1 - only_first - only_second
    power = 0.0
    for b in range(n + 1):
        for c in range(n - b + 1):
            if b > c and exact_paired_p(b, c) < alpha:
                ways = math.comb(n, b) * math.comb(n - b, c)
                power += ways * only_first ** b * only_second ** c * agree ** (n - b - c)
    return power
