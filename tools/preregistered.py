"""
Issue 40's pre-registered tests T1-T7 (results/preregistration.md: each
follows its rule there) from the archived grids jostling, jostling_prereg
and jostling_swap, for results/jostling.md. An incomplete grid's counts
are labelled partial, without a verdict. The tests: docs/statistics.md.
"""

import collections

from tools import stats
from tools.claims import val_curve
from tools.grid_runs import Grid
from tools.grids import EMBEDDING_SWAPS, CROSSING_SEEDS, FRESH_SEEDS
from tools.stats import fisher_exact, fisher_verdict, rate_cell
from tools.transition import RAISES, count, crosses, marked_figure, tally, twin_curves

THRESHOLDS = (0.43, 0.40, 0.38)   # primary, then the two secondary ones
# T3's predictor: twin_cos at step 1000 above the cut-off calls a crossing
PREDICTOR_STEP = 1000
PREDICTOR_CUTOFF = 0.1224
EXPECTED_RATE = 0.10              # the earlier claim T1 checks: about one seed in ten
FRESH = "margin 0.6"
NEXT = "margin 0.6, data order of the next seed"
SWAPPED = ("margin 0.6, embeddings swapped",
           "margin 0.6, embeddings swapped, data order of the embeddings' seed")


def joined(first, second):
    """{(0 or 1, seed): value} of two {seed: value}."""
    return {(i, s): v for i, runs in enumerate((first, second)) for s, v in runs.items()}


def partial_note(n, registered=len(FRESH_SEEDS), unit="runs"):
    return "" if n == registered else f" (partial: {n} of {registered} {unit}; no verdict until all are in)"


def ending(n, word, registered=len(FRESH_SEEDS)):
    """A line's end: the verdict word once all registered runs are in."""
    return f": **{word}**." if n == registered else "."


def rate_test(archive, fresh, threshold):
    """T1. archive, fresh: {seed: metrics}."""
    k_old, n_old = count(archive, threshold)
    k_new, n_new = count(fresh, threshold)
    if not n_new:
        return ["T1: no fresh margin-0.6 run yet."]
    low, high = stats.clopper_pearson(k_new, n_new)
    p = fisher_exact(k_old, n_old, k_new, n_new)
    line = (f"T1, margin 0.6 on fresh seeds{partial_note(n_new)}: "
            f"{rate_cell(k_new, n_new)}; pooled with the archive's {k_old} of {n_old}: "
            f"{rate_cell(k_old + k_new, n_old + n_new)}. Archive against fresh: Fisher's exact p = {p:.3g}")
    if n_new != len(FRESH_SEEDS):
        return [line + "."]
    line += (": **the fresh seeds cross at another rate**, the pooled rate mixes two rates" if p < 0.05
             else ": no difference shown, the pooled rate is the estimate")
    inside = low <= EXPECTED_RATE <= high
    return [line + f". The earlier claim (about {EXPECTED_RATE}) is **"
            + ("confirmed" if inside else "not confirmed")
            + f"**: {EXPECTED_RATE} is {'inside' if inside else 'outside'} [{low:.2f}, {high:.2f}]."]


def concordance_test(own, other, threshold):
    """T2: the 2 x 2 of the fresh pairs (crossing with the own order x the next seed's)."""
    seeds = sorted(set(own) & set(other))
    if not seeds:
        return ["T2: no fresh seed has both of its runs yet."]
    pairs = collections.Counter((crosses(own[s], threshold), crosses(other[s], threshold))
                                for s in seeds)
    both, only_own, only_next, neither = (pairs[x, y] for x in (True, False)
                                          for y in (True, False))
    n = len(seeds)
    k_own = both + only_own
    k_next = both + only_next
    expected = [n * p * q for p in (k_own / n, 1 - k_own / n)
                for q in (k_next / n, 1 - k_next / n)]
    line = (f"T2, the same initialisation under two data orders{partial_note(n, unit='pairs')}: "
            f"both cross {both}, only own order {only_own}, only the next seed's {only_next}, neither "
            f"{neither} (independence predicts {expected[0]:.2f}, {expected[1]:.2f}, {expected[2]:.2f}, "
            f"{expected[3]:.2f})")
    if not k_own or not k_next:
        return [line + ". **Not testable**: no seed crosses under one of the two orders."]
    p = fisher_exact(both, k_own, k_next - both, n - k_own)
    word = ("crossing follows the initialisation" if p < 0.05 and both > expected[0] else
            "the two orders push apart" if p < 0.05 else "not shown")
    return [line + f"; Fisher's exact p = {p:.3g}" + ending(n, word)]


def predictor_counts(runs, curves, threshold):
    """transition.tally of the registered predictor over runs {key: metrics} with curves
    {key: (steps, twin_cos)}, then how many runs lack a step-1000 reading."""
    calls = []
    for seed, metrics in runs.items():
        steps, values = curves.get(seed, ([], []))
        if PREDICTOR_STEP in steps:
            calls.append((values[steps.index(PREDICTOR_STEP)] > PREDICTOR_CUTOFF,
                          crosses(metrics, threshold)))
    return *tally(calls), len(runs) - len(calls)


def predictor_test(own, next_order, ce, curves):
    """T3 at the primary threshold, on the own-order runs; then its secondary counts."""
    threshold = THRESHOLDS[0]
    hits, n_yes, alarms, n_no, unread = predictor_counts(own, curves.get(FRESH, {}), threshold)
    n = n_yes + n_no
    cell = lambda k, m: rate_cell(k, m) if m else "none"  # noqa: E731
    line = (f"T3, twin_cos at step {PREDICTOR_STEP} > {PREDICTOR_CUTOFF} on the own-order "
            f"runs{partial_note(n)}: hits {cell(hits, n_yes)}, false alarms "
            f"{cell(alarms, n_no)}"
            + (f" ({unread} run(s) without a reading)" if unread else ""))
    if not n_yes or not n_no:
        line += ". **Not testable**: " + ("no own-order run crosses." if not n_yes
                                          else "every own-order run crosses.")
    else:
        p, word = fisher_verdict(hits, n_yes, alarms, n_no, (
            "the step-1000 reading predicts the transition on new seeds", "not shown", "not shown"))
        line += f"; Fisher's exact p = {p:.3g}" + ending(n, word)
    both = joined(own, next_order)
    both_curves = joined(curves.get(FRESH, {}), curves.get(NEXT, {}))
    h2, y2, a2, n2, _ = predictor_counts(both, both_curves, threshold)
    _, _, a3, n3, _ = predictor_counts(ce, curves.get("baseline", {}), threshold)
    return [line, "", "Secondary: over all fresh margin-0.6 runs (pairs share an initialisation), hits "
                  f"{cell(h2, y2)}, false alarms {cell(a2, n2)}; false alarms among the fresh CE runs "
                  f"{cell(a3, n3)}."]


def rates_test(ce, margin, threshold, label):
    """T4: CE against margin 0.6."""
    k1, n1 = count(margin, threshold)
    k2, n2 = count(ce, threshold)
    if not n1 or not n2:
        return [f"T4 ({label}): not enough runs yet."]
    p, word = fisher_verdict(k1, n1, k2, n2, RAISES)
    registered = 2 * (30 + len(FRESH_SEEDS)) if label == "pooled" else 2 * len(FRESH_SEEDS)
    line = (f"T4, CE against margin 0.6, {label}{partial_note(n1 + n2, registered)}: "
            f"margin {rate_cell(k1, n1)}, CE {rate_cell(k2, n2)}; difference {k1 / n1 - k2 / n2:+.2f}, "
            f"Fisher's exact p = {p:.3g}")
    return [line + ending(n1 + n2, word, registered)]


def swap_test(swap, threshold):
    """T5: the runs whose embeddings come from a crossing initialisation against those whose
    blocks do."""
    runs = []  # (blocks, embeddings, data order, LR accuracy, crossed)
    for method, data_of in ((SWAPPED[0], lambda s: s), (SWAPPED[1], lambda s: EMBEDDING_SWAPS[s])):
        for seed, metrics in sorted(swap.get(method, {}).items()):
            runs.append((seed, EMBEDDING_SWAPS[seed], data_of(seed), metrics["low"]["accuracy"],
                         crosses(metrics, threshold)))
    if not runs:
        return ["T5: no swapped run yet."]
    emb_arm = [crossed for _, emb, *_, crossed in runs if emb in CROSSING_SEEDS]
    block_arm = [crossed for blocks, *_, crossed in runs if blocks in CROSSING_SEEDS]
    k1 = sum(emb_arm)
    k2 = sum(block_arm)
    listing = ", ".join(f"blocks {b} / embeddings {e} / data {d}: {acc:.3f}" for b, e, d, acc, _ in runs)
    registered = 2 * len(EMBEDDING_SWAPS)
    line = (f"T5, embeddings or blocks{partial_note(len(runs), registered)}: embeddings from a "
            f"crossing initialisation {k1} of {len(emb_arm)} cross, blocks from one {k2} of {len(block_arm)} "
            f"({listing})")
    if emb_arm and block_arm:
        line += (f"; Fisher's exact p = {fisher_exact(k1, len(emb_arm), k2, len(block_arm)):.3g} "
                 "(2 initialisations per arm)")
    n = len(emb_arm)
    outcome = ("follows the embeddings" if (k1, k2) == (n, 0) else
               "follows the blocks" if (k1, k2) == (0, n) else
               "needs both" if k1 + k2 == 0 else
               "either part suffices" if k1 + k2 == 2 * n else "neither cleanly")
    return [line + ending(len(runs), outcome, registered)]


def findings(archive, fresh, swap, curves):
    """Markdown lines: archive, fresh, swap are {method: {seed: metrics}} of the grids
    jostling, jostling_prereg and jostling_swap; curves are twin_curves of jostling_prereg."""
    lines = ["## Issue 40: the pre-registered tests", "",
             "Registered in `results/preregistration.md` before any of these runs started; each line "
             "follows its rule there. The fresh seeds are 1367–1390; own order means `data_seed` = "
             "`seed`.", ""]
    own = fresh.get(FRESH, {})
    next_order = fresh.get(NEXT, {})
    ce = fresh.get("baseline", {})
    for threshold in THRESHOLDS:
        lines += [f"### LR accuracy ≥ {threshold} "
                  f"({'primary' if threshold == THRESHOLDS[0] else 'secondary'})", ""]
        lines += rate_test(archive.get("margin 0.6", {}), own, threshold) + [""]
        lines += concordance_test(own, next_order, threshold) + [""]
        if threshold == THRESHOLDS[0]:
            lines += predictor_test(own, next_order, ce, curves) + [""]
        pooled_ce = joined(archive.get("baseline", {}), ce)
        pooled_margin = joined(archive.get("margin 0.6", {}), own)
        lines += rates_test(pooled_ce, pooled_margin, threshold, "pooled") + [""]
        lines += rates_test(ce, own, threshold, "fresh seeds only") + [""]
        lines += swap_test(swap, threshold) + [""]
    return lines


def section(root):
    """findings() from the archive under root, or [] while no issue-40 run is archived."""
    fresh = Grid("jostling_prereg", root)
    swap = Grid("jostling_swap", root)
    if not fresh.results and not swap.results:
        return []
    return findings(Grid("jostling", root).results, fresh.results, swap.results, twin_curves(fresh))


NORM_MARGIN = 0.04  # T6: a third of the released l2_repel's -0.12 HR PPL against CE


def norm_term_outcome(evaluated, registered_seeds=5):
    """T6's outcome from claims.evaluate_claims of claims.NORM_CLAIMS (the norm term alone
    (a) against CE, (b) against the released l2_repel); None until both have every seed."""
    (_, vs_ce, _, verdict_ce), (_, vs_released, p_released, _) = evaluated
    if vs_ce is None or vs_released is None or min(vs_ce["n"], vs_released["n"]) < registered_seeds:
        return None
    if (verdict_ce == stats.REPRODUCES and -NORM_MARGIN <= vs_released["low"]
            and vs_released["high"] <= NORM_MARGIN):
        return "its effect is the norm term"
    if p_released is not None and p_released < 0.05 and vs_released["mean"] > 0:
        return "not the norm term alone"
    return "not decided"


# T7: converged when the best checkpoint comes before this step, or when the
# mean val loss falls less than this per 50 steps from then on
CONVERGED_BEFORE = 1400
CONVERGED_FALL = 0.01


def convergence_lines(runs, registered_seeds=5):
    """T7's convergence rule. runs: {seed: {"dir", "metrics"}} of bpe_1600's CE row (each
    log.jsonl holds its val loss every 50 steps)."""
    if not runs:
        return []
    best = {seed: run["metrics"]["checkpoint"]["iter"] for seed, run in sorted(runs.items())}
    curves = {seed: dict(val_curve(run["dir"])) for seed, run in runs.items()}
    start = CONVERGED_BEFORE
    end = max(max(c) for c in curves.values())
    have = [c for c in curves.values() if start in c and end in c]
    fall = sum(c[start] - c[end] for c in have) / len(have) / ((end - start) / 50) if have else None
    line = ("Convergence (results/preregistration.md, T7): CE's best checkpoint per seed at step "
            + ", ".join(f"{best[s]} ({s})" for s in best)
            + (f"; its mean val loss falls {fall:.4f} nats per 50 steps from step {start} to {end}"
               if fall is not None else ""))
    if len(runs) < registered_seeds:
        return [line + f" (partial: {len(runs)} of {registered_seeds} seeds)."]
    converged = (all(step < CONVERGED_BEFORE for step in best.values())
                 or (fall is not None and fall < CONVERGED_FALL))
    return [line + (": **converged by the registered rule**." if converged else
                    ": **not converged by the registered rule**: 1600 steps are not enough either.")]


def twin_figure(g, results_dir):
    """marked_figure of jostling_prereg or jostling_swap, a panel per method."""
    return marked_figure(g, results_dir, lambda method: method, lambda _, seed: str(seed),
                         THRESHOLDS[0], f"reach LR accuracy {THRESHOLDS[0]}")
