"""
The Stop Jostling transition from the jostling grid's archived runs:
how often CE and margin 0.6 make it, whether the initialisation or the
data order decides it, and what twin_cos does meanwhile. tools/report.py
puts these sections into results/jostling.md and writes transition.json
beside the runs. The analysis: docs/statistics.md.
"""

import math
import os

from tools import figures
from tools.claims import val_curve
from tools.grids import (CROSSING_SEEDS, NON_CROSSING_SEEDS, PAPER_SE_LR_ACCURACY,
                         TRANSITION_LR_ACCURACY)
from tools.stats import fisher_exact, fisher_verdict, rate_cell, rate_interval
from utils import markdown_table

RATE_METHODS = ("baseline", "margin 0.6")   # CE and thresholding, 30 seeds each
FACTORIAL_METHOD = "margin 0.6"             # the factorial's runs with data order = initialisation
EARLY_STEPS = (0, 250, 500, 1000, 1500, 2000)  # the early readings tried as predictors
POWER_RATE = 0.10
THRESHOLDS = (0.38, 0.39, 0.40, 0.41, 0.42, 0.43, 0.44, 0.45)  # the sweep beside the stated one
DEPARTURE_NATS = 0.1
OTHER_ORDER = ", data order of "  # the factorial's methods: f"{FACTORIAL_METHOD}{OTHER_ORDER}{seed}"
RAISES = ("thresholding raises the rate", "thresholding lowers the rate", "no difference shown")
DECIDES = ("the initialisation decides", "the data order decides")


def crosses(metrics, threshold=TRANSITION_LR_ACCURACY):
    return metrics["low"]["accuracy"] >= threshold


def count(runs, threshold):
    """(k, n): how many of the runs {key: metrics} cross the threshold, of how many."""
    return sum(crosses(m, threshold) for m in runs.values()), len(runs)


def factorial_runs(g):
    """(initialisation seed, data-order seed, LR accuracy, crossed) of the factorial's runs."""
    runs = [(seed, seed, m) for seed, m in g.results.get(FACTORIAL_METHOD, {}).items()
            if seed in CROSSING_SEEDS + NON_CROSSING_SEEDS]
    for method, per_seed in g.results.items():
        if method.startswith(FACTORIAL_METHOD + OTHER_ORDER):
            data = int(method.rsplit(" ", 1)[1])
            runs += [(seed, data, m) for seed, m in per_seed.items()]
    return sorted((i, d, m["low"]["accuracy"], crosses(m)) for i, d, m in runs)


def factorial_verdict(cells):
    """The rule: initialisation from a crossing seed with data order from a non-crossing one
    against the reverse, by Fisher's exact test; p < 0.05 names the factor."""
    (k1, n1), (k2, n2) = cells[("C", "N")], cells[("N", "C")]
    if not n1 or not n2:
        return None, "not enough runs yet"
    return fisher_verdict(k1, n1, k2, n2, (*DECIDES, "neither shown to decide"))


def twin_curves(g):
    """{method: {seed: (steps, twin_cos)}} of every run that logged the twin alignment."""
    curves = {}
    for method, per_seed in g.runs.items():
        for seed, run in per_seed.items():
            points = val_curve(run["dir"], "twin_cos")
            if points:
                curves.setdefault(method, {})[seed] = tuple(map(list, zip(*points)))
    return curves


def parting_step(curve, others):
    """The first step from which the curve stays above every curve in others, or None."""
    steps, values = curve
    above = [all(step in o_steps and value > o_values[o_steps.index(step)]
                 for o_steps, o_values in others)
             for step, value in zip(steps, values)]
    return next((steps[i] for i in range(len(steps)) if all(above[i:])), None)


def tally(calls):
    """(hits, crossing runs, false alarms, other runs) of [(called, crossed)]."""
    crossing = [called for called, crossed in calls if crossed]
    other = [called for called, crossed in calls if not crossed]
    return sum(crossing), len(crossing), sum(other), len(other)


def leave_one_out(readings):
    """tally of readings [(value, crossed)], each run called a crossing when its value is above
    the midpoint of the other runs' crossing and non-crossing means (never when the others
    lack either)."""
    calls = []
    for i, (value, is_crossing) in enumerate(readings):
        others = readings[:i] + readings[i + 1:]
        yes = [v for v, c in others if c]
        no = [v for v, c in others if not c]
        called = bool(yes and no) and value > (sum(yes) / len(yes) + sum(no) / len(no)) / 2
        calls.append((called, is_crossing))
    return tally(calls)


def findings(g):
    """(Markdown lines for results/jostling.md, transition.json) of the grid g (a Grid)."""
    lines = ["## The Stop Jostling transition: how often, what decides it, what it looks like", "",
             "A run makes the transition when its LR accuracy (best checkpoint) reaches "
             f"{TRANSITION_LR_ACCURACY}. Rates: k of n seeds, with the exact (Clopper-Pearson) 95 % "
             "interval; two rates are compared with Fisher's exact test (two-sided). Produced by "
             "`python -m tools.compare jostling` (tools/transition.py).", ""]
    runs = factorial_runs(g)
    record = [(method, seed, seed, m["low"]["accuracy"], crosses(m))
              for method in RATE_METHODS
              for seed, m in sorted(g.results.get(method, {}).items())]
    record += [("factorial", *run) for run in runs if run[0] != run[1]]
    keys = ("method", "seed", "data_seed", "lr_accuracy", "crossed")
    rates = {m: count(g.results[m], TRANSITION_LR_ACCURACY)
             for m in RATE_METHODS if g.results.get(m)}
    made = {m: [seed for method, seed, _, _, crossed in record if method == m and crossed]
            for m in rates}
    rows = [(m, n, rate_cell(k, n), ", ".join(map(str, made[m])) or "—")
            for m, (k, n) in rates.items()]
    lines += markdown_table(("method", "seeds", "makes it: k of n, rate [95 % CI]",
                             "seeds that make it"), rows)
    if len(rates) == 2:
        (k1, n1), (k2, n2) = rates[RATE_METHODS[1]], rates[RATE_METHODS[0]]
        p, word = fisher_verdict(k1, n1, k2, n2, RAISES)
        lines += ["", f"Margin 0.6 against CE: {k1 / n1 - k2 / n2:+.2f} in rate, Fisher's exact p = "
                      f"{p:.3g} ({n1} and {n2} seeds): **{word}** (rule: p < 0.05 decides, the sign "
                      f"says which way). Were the rates {POWER_RATE} and 0, {seeds_for_power()} "
                      "seeds per method would give Fisher's p < 0.05 with 80 % probability (exact, "
                      "over the binomial outcomes).", "",
                  f"The threshold {TRANSITION_LR_ACCURACY} is a choice; the same counts at others:",
                  "", *threshold_table(g)]
    lines += factorial_lines(runs) + curve_lines(g) + [""]
    return lines, {"threshold": TRANSITION_LR_ACCURACY,
                   "runs": [dict(zip(keys, run)) for run in record]}


def factorial_lines(runs):
    """The factorial's table (initialisation x data order), its rule, the count per init."""
    def kind(seed):
        return "C" if seed in CROSSING_SEEDS else "N"
    members = {(a, b): [] for a in "CN" for b in "CN"}
    for init, data, acc, is_crossing in runs:
        members[kind(init), kind(data)].append((f"{init}/{data}: {acc:.3f}", is_crossing))
    cells = {key: (sum(c for _, c in m), len(m)) for key, m in members.items()}
    p, verdict = factorial_verdict(cells)
    names = {"C": f"a crossing seed ({', '.join(map(str, CROSSING_SEEDS))})",
             "N": f"a non-crossing seed ({', '.join(map(str, NON_CROSSING_SEEDS))})"}
    lines = ["", "### Initialisation or data order?", "",
             "Margin 0.6 with `seed` (the initialisation) and `data_seed` (the order of the training "
             "windows) taken from different seeds. Rule: the runs initialised from a crossing seed "
             "with a non-crossing seed's data order against the reverse, by Fisher's exact test; "
             "p < 0.05 names the factor that decides.", ""]
    lines += markdown_table(
        ("initialisation from", "data order from", "makes it: k of n, rate [95 % CI]",
         "runs (init/data: LR accuracy)"),
        [(names[a], names[b], rate_cell(k, n) if n else "—",
          ", ".join(text for text, _ in members[a, b]) or "—")
         for (a, b), (k, n) in cells.items()])
    lines += ["", f"Counted in runs, as the rule does: {verdict}"
              + (f" (Fisher's exact p = {p:.3g})." if p is not None else ".")
              + " Runs that share an initialisation are not independent: the count that is the sample "
                "size is the one per initialisation, next."]
    return lines + per_initialisation_lines(runs)


def curve_lines(g):
    """When the crossing runs' twin_cos parts from the rest; does an early reading predict it?"""
    curves = twin_curves(g)
    if not curves:
        return []
    lines = ["", "### What the transition looks like", "",
             "At every evaluation each run logs `twin_cos`, the mean cosine between each LR row of the "
             "tied embedding and its HR twin, and `twin_top3`, the fraction of rows whose twin is among "
             f"their 3 nearest. {sum(len(c) for c in curves.values())} runs have these curves (runs "
             "archived before they were logged have none)."]
    # (method, seed) -> ((steps, values), crossed): the runs at margin 0.6
    thresholded = {(method, seed): (curve, crosses(g.results[method][seed]))
                   for method, per_seed in curves.items() if method.startswith(FACTORIAL_METHOD)
                   for seed, curve in per_seed.items()}
    crossing = [(key, c) for key, (c, is_crossing) in thresholded.items() if is_crossing]
    rest = [c for c, is_crossing in thresholded.values() if not is_crossing]
    if not crossing or not rest:
        return lines
    parts = sorted((parting_step(curve, rest), run_label(method, seed))
                   for (method, seed), curve in crossing)
    inits = sorted({seed for (_, seed), _ in crossing})
    lines += ["", f"Margin 0.6 runs with curves: {len(crossing)} make the transition, {len(rest)} do "
                  "not. Step from which each crossing run's twin_cos stays above every non-crossing "
                  "run's: " + ", ".join(f"{name}: {step if step is not None else 'never'}"
                                        for step, name in parts) + ".",
              "", "Does an early reading predict it? Each run is called from the others alone (leave "
                  "one out: above the midpoint of the others' crossing and non-crossing means of "
                  f"twin_cos at that step). The crossing runs come from {len(inits)} initialisation(s) "
                  f"({', '.join(map(str, inits))}), and runs that share one are not independent calls: "
                  "the rates below hold for these runs; the registered T3 below tests the step-1000 "
                  "reading on new seeds.", ""]
    rows = []
    for step in EARLY_STEPS:
        readings = [(values[steps.index(step)], is_crossing)
                    for (steps, values), is_crossing in thresholded.values() if step in steps]
        hits, n_yes, alarms, n_no = leave_one_out(readings)
        rows.append((step, f"{hits} of {n_yes}", f"{alarms} of {n_no}"))
    return lines + markdown_table(("step", "hits", "false alarms"), rows)


def run_label(method, seed):
    """'1342', or '1342/1337' for a factorial run with another seed's data order."""
    return f"{seed}/{method.rsplit(' ', 1)[1]}" if OTHER_ORDER in method else str(seed)


def seeds_for_power():
    """The fewest seeds per method at which rates of POWER_RATE and 0 give Fisher's p < 0.05
    with probability 0.8 (exact over the first method's outcomes, the second at 0 of n)."""
    n = 1
    while sum(math.comb(n, k) * POWER_RATE ** k * (1 - POWER_RATE) ** (n - k)
              for k in range(n + 1) if fisher_exact(k, n, 0, n) < 0.05) < 0.8:
        n += 1
    return n


def threshold_table(g):
    """How the rates and Fisher's p move with the threshold."""
    rows = []
    for threshold in THRESHOLDS:
        (k2, n2), (k1, n1) = (count(g.results[method], threshold) for method in RATE_METHODS)
        rows.append((f"{threshold:.2f}", f"{k2} of {n2}", f"{k1} of {n1}",
                     f"{fisher_exact(k1, n1, k2, n2):.3g}"))
    return markdown_table(("LR accuracy threshold", *RATE_METHODS, "Fisher's exact p"), rows)


def per_initialisation_lines(runs):
    """The factorial counted per initialisation (docs/statistics.md: why)."""
    by_init = {}
    for init, data, _, is_crossing in runs:
        if init != data:
            by_init.setdefault(init, []).append(is_crossing)
    if not by_init:
        return []
    groups = [[init for init in sorted(by_init) if (init in CROSSING_SEEDS) == crossing]
              for crossing in (True, False)]
    k1, k2 = (sum(all(by_init[i]) for i in group) for group in groups)
    n1, n2 = map(len, groups)
    cells = ", ".join(f"{i}: {sum(by_init[i])} of {len(by_init[i])}" for i in sorted(by_init))
    p, word = fisher_verdict(k1, n1, k2, n2, (*DECIDES, "not shown at this size"))
    return ["", f"Per initialisation (runs with another seed's data order that make it: {cells}): {k1} of "
                f"{n1} crossing initialisations make it in every run, against {k2} of {n2} non-crossing "
                f"ones, Fisher's exact p = {p:.3g}: **{word}**. The {n1} crossing initialisations were "
                "picked because they crossed; the fresh seeds' T2 below tests the question on seeds "
                "nobody picked."]


def twin_figure(g, results_dir):
    """marked_figure of CE, margin 0.6 and the factorial (a panel each)."""
    def panel(method):
        if method in RATE_METHODS:
            return method
        return "factorial (init/data)" if OTHER_ORDER in method else None
    return marked_figure(g, results_dir, panel, run_label, TRANSITION_LR_ACCURACY,
                         "make the transition")


def marked_figure(g, results_dir, panel, label, threshold, marked):
    """[(title, path)] of the twin_cos curves of g's runs, a panel per
    panel(method) (None: left out), those that reach threshold in red;
    [] without curves or matplotlib."""
    panels = {}
    for method, per_seed in twin_curves(g).items():
        if panel(method) is not None:
            for seed, curve in per_seed.items():
                crossed = crosses(g.results[method][seed], threshold)
                panels.setdefault(panel(method), {})[label(method, seed)] = (*curve, crossed)
    path = os.path.join(results_dir, "figures", f"{g.name}_twin_cosine.png")
    path = figures.marked_curves(panels, path, "twin_cos")
    return [("Mean cosine of each LR row with its HR twin at every evaluation (runs that "
             f"{marked} in red)", path)] if path else []


def per_seed_table(g):
    """How many seeds of each method make the transition and when, then every seed's LR
    accuracy and twin-in-top-3 (a section of their own: 30 values are wider than a screen)."""
    lines = ["", "## Per seed: LR accuracy and the Stop Jostling transition", "",
             f"A seed \"makes the transition\" when its LR accuracy reaches {TRANSITION_LR_ACCURACY} (about "
             f"halfway from the ≈ .37 of thresholded runs to the authors' {PAPER_SE_LR_ACCURACY}). Values "
             "sorted, best checkpoint (best mixed val loss). The rate's interval is the exact "
             "(Clopper-Pearson) 95 % interval of k in n seeds. When: the first evaluation at which the "
             f"seed's LR val loss is {DEPARTURE_NATS} nats below that of every seed of the method that does "
             "not make it.", ""]
    rows = []
    every_seed = ["", "### Every seed, sorted", "",
                  "LR accuracy and the share of rows whose twin is among their 3 nearest (twin in top-3), "
                  "each sorted on its own.", ""]
    for method in g.every_method():
        runs = g.results.get(method, {})
        if not runs:
            continue
        acc = sorted(r["low"]["accuracy"] for r in runs.values())
        twins = sorted(r["translations"]["twin_top3_fraction"] for r in runs.values())
        made = sorted(seed for seed, r in runs.items() if crosses(r))
        when = departures(g, method, made)
        departed = ", ".join(f"{s} (step {when[s]})" if when[s] is not None
                             else f"{s} (never {DEPARTURE_NATS} nats below)" for s in made)
        rows.append((method, len(acc), f"{len(made)} of {len(acc)}",
                     rate_interval(len(made), len(acc)), departed or "—"))
        every_seed.append(f"- **{method}** ({len(acc)} seeds): LR accuracy "
                          f"{' '.join(f'{a:.3f}' for a in acc)}; twin in top-3 "
                          f"{' '.join(f'{t:.3f}' for t in twins)}")
    header = ("method", "seeds", "seeds at or above the threshold", "rate [95 % CI]",
              "seeds that make it (when)")
    return lines + markdown_table(header, rows) + every_seed


def departures(g, method, made):
    """{seed in made: the first step its LR val loss is DEPARTURE_NATS
    below that of every seed of the method not in made, or None}."""
    curves = {seed: dict(val_curve(run["dir"], "val_low")) for seed, run in g.runs[method].items()}
    others = [c for seed, c in curves.items() if seed not in made]
    return {seed: next((step for step in sorted(curves[seed])
                        if others and all(step in c for c in others)
                        and curves[seed][step] <= min(c[step] for c in others) - DEPARTURE_NATS),
                       None)
            for seed in made}
