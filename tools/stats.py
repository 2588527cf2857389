"""
The grids' tests, without scipy: the paired t-test with Holm's correction
for the papers' claims, exact tests for rates and paired yes/no outcomes.
Their rules and why exact: docs/statistics.md.
"""

import math


def _nonzero(x):
    return x if abs(x) > 1e-300 else 1e-300


def _beta_continued_fraction(a, b, x):
    """The continued fraction of I_x(a, b) (valid, and fast, for
    x < (a + 1) / (a + b + 2)), by the modified Lentz method:
    x^a (1-x)^b / (a B(a,b)) times 1 / (1 + d1 / (1 + d2 / (1 + ...))), where
    d_{2m} = m(b-m)x / ((a+2m-1)(a+2m)),
    d_{2m+1} = -(a+m)(a+b+m)x / ((a+2m)(a+2m+1))."""
    c = 1.0
    d = 1.0 / _nonzero(1.0 - (a + b) * x / (a + 1.0))
    h = d
    for m in range(1, 301):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for coefficient in (even, odd):
            d = 1.0 / _nonzero(1.0 + coefficient * d)
            c = _nonzero(1.0 + coefficient / c)
            h *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a, b, x):
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta: x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - log_beta)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    # I_x(a,b) = 1 - I_{1-x}(b,a)
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    # P(T > |t|)
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def _bisect(cdf, q, high):
    """The x in [0, high] with cdf(x) = q, to a relative 1e-12."""
    low = 0.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if cdf(mid) < q:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


def t_quantile(q, df):
    """The t with P(T <= t) = q."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_quantile: q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    high = 1.0
    while t_cdf(high, df) < q:
        high *= 2.0
    return _bisect(lambda t: t_cdf(t, df), q, high)


def paired(differences):
    """Paired t statistics of per-seed differences d_s = method_s - baseline_s:

        mean = sum(d) / n,   sd = sample std (n - 1),   se = sd / sqrt(n)
        95 % CI = mean -+ t_{0.975, n-1} * se
        p = two-sided p of the paired t-test, t = mean / se

    Returns n, mean, sd, low, high, p and how many seeds go up / down. With
    one seed sd, low, high and p are None; with zero spread low = high =
    mean and p is 0 (1 when the mean is 0)."""
    d = [float(x) for x in differences]
    n = len(d)
    if n == 0:
        raise ValueError("paired: no differences (the method and its baseline share no seed)")
    mean = sum(d) / n
    out = {"n": n, "mean": mean, "sd": None, "low": None, "high": None, "p": None,
           "up": sum(x > 0 for x in d), "down": sum(x < 0 for x in d)}
    if n == 1:
        return out
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    if se == 0.0:
        p = 1.0 if mean == 0.0 else 0.0
    else:
        p = 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    return out | {"sd": sd, "low": mean - half, "high": mean + half, "p": p}


def clopper_pearson(k, n):
    """Exact (Clopper-Pearson) 95 % interval of a rate seen k times in n
    trials: the 0.025 quantile of Beta(k, n - k + 1) and the 0.975 one of
    Beta(k + 1, n - k), 0 and 1 at the edges."""
    if not 0 <= k <= n or n == 0:
        raise ValueError(f"clopper_pearson: need 0 <= k <= n and n > 0, got k={k}, n={n}")

    def quantile(q, a, b):  # the x with I_x(a, b) = q
        return _bisect(lambda x: incomplete_beta(a, b, x), q, 1.0)
    low = 0.0 if k == 0 else quantile((1 - 0.95) / 2, k, n - k + 1)
    high = 1.0 if k == n else quantile(0.975, k + 1, n - k)
    return low, high


def rate_interval(k, n):
    """'0.10 [0.02, 0.27]': the rate k / n and its clopper_pearson interval."""
    low, high = clopper_pearson(k, n)
    return f"{k / n:.2f} [{low:.2f}, {high:.2f}]"


def rate_cell(k, n):
    return f"{k} of {n}: {rate_interval(k, n)}"


def holm(p_values):
    """Holm's step-down correction: sort the m p-values, multiply the i-th
    smallest by (m - i + 1), make the sequence non-decreasing. In the
    input's order; None stays None and is not counted."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (len(indexed) - rank) * p))
        adjusted[i] = running
    return adjusted


REPRODUCES = "reproduces"
CONTRADICTED = "contradicted"
NOT_SHOWN = "not shown"


def verdict(mean, p_adjusted, direction, alpha=0.05):
    """The claims tables' rule. direction: +1 if the paper says the method
    raises the metric, -1 if it lowers it. Reproduces: Holm-adjusted
    p < alpha and the paired mean goes the paper's way; contradicted:
    adjusted p < alpha and it goes the other way; else not shown."""
    if direction not in (1, -1):
        raise ValueError(f"verdict: direction must be +1 or -1, got {direction}")
    if p_adjusted is None or p_adjusted >= alpha or mean == 0:
        return NOT_SHOWN
    return REPRODUCES if (mean > 0) == (direction > 0) else CONTRADICTED


def fisher_exact(k1, n1, k2, n2):
    """Two-sided p of Fisher's exact test that k1 of n1 and k2 of n2 come
    from one rate: the sum, over the tables with the same margins, of the
    hypergeometric probabilities not above the observed table's (with a
    relative tolerance of 1e-7 for ties)."""
    total = n1 + n2
    k = k1 + k2

    def probability(a):  # a of the k successes in the first group
        return math.comb(n1, a) * math.comb(n2, k - a) / math.comb(total, k)
    observed = probability(k1)
    return min(1.0, sum(p for a in range(max(0, k - n2), min(k, n1) + 1)
                        if (p := probability(a)) <= observed * (1 + 1e-7)))


def fisher_verdict(k1, n1, k2, n2, words):
    """(fisher_exact's p, words[0], [1] or [2]: p < 0.05 and k1 / n1 the
    higher rate, the lower, or p >= 0.05)."""
    p = fisher_exact(k1, n1, k2, n2)
    if p >= 0.05:
        return p, words[2]
    return p, words[0] if k1 / n1 > k2 / n2 else words[1]


def exact_paired_p(b, c):
    """Two-sided exact McNemar test: b pairs where only the first arm says
    yes, c where only the second does. p is the Binomial(b + c, 1/2)
    probability of a split at least as uneven as min(b, c), both tails, at
    most 1."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n)


def paired_power(n, p_first, p_second, alpha=0.05):
    """P(exact_paired_p < alpha with the first arm ahead) over n pairs whose
    arms say yes independently with probabilities p_first and p_second
    (exact, over every (b, c))."""
    only_first = p_first * (1 - p_second)
    only_second = p_second * (1 - p_first)
    agree = 1 - only_first - only_second
    terms = (math.comb(n, b) * math.comb(n - b, c)
             * only_first ** b * only_second ** c * agree ** (n - b - c)
             for b in range(n + 1) for c in range(n - b + 1)
             if b > c and exact_paired_p(b, c) < alpha)
    return sum(terms, 0.0)
