"""
The Stop Jostling transition, from the jostling grid's archived runs (tools/grids.py): how often
CE and margin 0.6 make it, whether the initialisation or the data order decides it (the grid's
factorial, EXTRA_RUNS), and what the LR rows do while it happens (twin_cos and twin_top3, logged
at every evaluation: evaluate.validation_losses). tools/report.py puts these sections at the top
of results/jostling.md and writes transition.json beside the archived runs: every run's values and
the threshold, so that a reader can check each count.

A run "makes the transition" when its LR accuracy (best checkpoint) reaches
grids.TRANSITION_LR_ACCURACY. Every rate has its exact (Clopper-Pearson) 95 % interval; two rates
are compared with Fisher's exact test (two-sided: the probability, with both margins of the 2 x 2
table fixed, of a table no more likely than the one seen).
"""

import math
import os

from tools import figures, stats
from tools.grids import CROSSING_SEEDS, NON_CROSSING_SEEDS, PAPER_SE_LR_ACCURACY, TRANSITION_LR_ACCURACY
from utils import read_log

RATE_METHODS = ("baseline", "margin 0.6")   # CE and thresholding, 30 seeds each
FACTORIAL_METHOD = "margin 0.6"             # the factorial's runs with data order = initialisation
EARLY_STEPS = (0, 250, 500, 1000, 1500, 2000)  # the early readings tried as predictors


def crossed(metrics):
    return metrics["low"]["accuracy"] >= TRANSITION_LR_ACCURACY


def fisher_exact(k1, n1, k2, n2):
    """Two-sided p of Fisher's exact test that k1 of n1 and k2 of n2 come from one rate: the sum,
    over the tables with the same margins, of the hypergeometric probabilities not above the
    observed table's (with a relative tolerance of 1e-7 for ties)."""
    total, k = n1 + n2, k1 + k2

    def probability(a):  # a of the k successes in the first group
        return math.comb(n1, a) * math.comb(n2, k - a) / math.comb(total, k)
    observed = probability(k1)
    return min(1.0, sum(p for a in range(max(0, k - n2), min(k, n1) + 1)
                        if (p := probability(a)) <= observed * (1 + 1e-7)))


def rate_cell(k, n):
    low, high = stats.clopper_pearson(k, n)
    return f"{k} of {n}: {k / n:.2f} [{low:.2f}, {high:.2f}]"


def factorial_runs(g):
    """(initialisation seed, data-order seed, LR accuracy, crossed) of the factorial's runs: margin
    0.6 on the seeds the factorial draws from (data order = initialisation) and the grid's runs
    with another data order."""
    runs = []
    for seed, metrics in g.results.get(FACTORIAL_METHOD, {}).items():
        if seed in CROSSING_SEEDS + NON_CROSSING_SEEDS:
            runs.append((seed, seed, metrics["low"]["accuracy"], crossed(metrics)))
    for method, per_seed in g.results.items():
        if method.startswith(f"{FACTORIAL_METHOD}, data order of "):
            data = int(method.rsplit(" ", 1)[1])
            runs += [(seed, data, m["low"]["accuracy"], crossed(m)) for seed, m in per_seed.items()]
    return sorted(runs)


def factorial_verdict(cells):
    """The rule: the off-diagonal cells, initialisation from a crossing seed with data order from a
    non-crossing one against the reverse, compared by Fisher's exact test. 'initialisation' when
    p < 0.05 and the first crosses more often, 'data order' when p < 0.05 and the second does,
    'neither shown' otherwise."""
    (k1, n1), (k2, n2) = cells[("C", "N")], cells[("N", "C")]
    if not n1 or not n2:
        return None, "not enough runs yet"
    p = fisher_exact(k1, n1, k2, n2)
    if p < 0.05:
        return p, "the initialisation decides" if k1 / n1 > k2 / n2 else "the data order decides"
    return p, "neither shown to decide"


def twin_curves(g):
    """{method: {seed: (steps, twin_cos)}} of every run that logged the twin alignment."""
    curves = {}
    for method, per_seed in g.runs.items():
        for seed, run in per_seed.items():
            points = [(r["iter"], r["twin_cos"]) for r in read_log(os.path.join(run["dir"], "log.jsonl"))
                      if "twin_cos" in r]
            if points:
                curves.setdefault(method, {})[seed] = tuple(map(list, zip(*points)))
    return curves


def parting_step(curve, others):
    """The first evaluation from which the curve stays above every curve in others (steps, values
    pairs), None if it never does."""
    steps, values = curve
    above = [all(step in o_steps and value > o_values[o_steps.index(step)] for o_steps, o_values in others)
             for step, value in zip(steps, values)]
    for i in range(len(steps)):
        if all(above[i:]):
            return steps[i]
    return None


def leave_one_out(readings):
    """readings: [(value, crossed)]. Each run is predicted from the others alone: it is called a
    crossing when its value is above the midpoint of the others' mean over crossing runs and mean
    over the rest (with no crossing run among the others, it is called not crossing). Returns
    (hits, crossing runs, false alarms, other runs)."""
    hits = false_alarms = 0
    for i, (value, is_crossing) in enumerate(readings):
        others = readings[:i] + readings[i + 1:]
        yes = [v for v, c in others if c]
        no = [v for v, c in others if not c]
        called = bool(yes and no) and value > (sum(yes) / len(yes) + sum(no) / len(no)) / 2
        hits += called and is_crossing
        false_alarms += called and not is_crossing
    crossing = sum(c for _, c in readings)
    return hits, crossing, false_alarms, len(readings) - crossing


def findings(g):
    """(Markdown lines for the top of results/jostling.md, the archive's transition.json) of the
    grid g (tools.grid_runs.Grid)."""
    lines = ["## The Stop Jostling transition: how often, what decides it, what it looks like", "",
             "A run makes the transition when its LR accuracy (best checkpoint) reaches "
             f"{TRANSITION_LR_ACCURACY}. Rates: k of n seeds, with the exact (Clopper-Pearson) 95 % "
             "interval; two rates are compared with Fisher's exact test (two-sided). Produced by `python -m "
             "tools.compare jostling` (tools/transition.py).",
             ""]
    record = {"threshold": TRANSITION_LR_ACCURACY, "runs": []}
    rates = {}
    lines += ["| method | seeds | makes it: k of n, rate [95 % CI] | seeds that make it |",
              "|---|---|---|---|"]
    for method in RATE_METHODS:
        per_seed = g.results.get(method, {})
        made = sorted(seed for seed, m in per_seed.items() if crossed(m))
        if per_seed:
            rates[method] = (len(made), len(per_seed))
            lines.append(f"| {method} | {len(per_seed)} | {rate_cell(len(made), len(per_seed))} | "
                         f"{', '.join(map(str, made)) or '—'} |")
        record["runs"] += [{"method": method, "seed": seed, "data_seed": seed,
                            "lr_accuracy": m["low"]["accuracy"],
                            "crossed": crossed(m)} for seed, m in sorted(per_seed.items())]
    if len(rates) == 2:
        (k1, n1), (k2, n2) = rates[RATE_METHODS[1]], rates[RATE_METHODS[0]]
        p = fisher_exact(k1, n1, k2, n2)
        word = "thresholding raises the rate" if p < 0.05 and k1 / n1 > k2 / n2 else \
            "thresholding lowers the rate" if p < 0.05 else "no difference shown"
        lines += ["", f"Margin 0.6 against CE: {k1 / n1 - k2 / n2:+.2f} in rate, Fisher's exact p = {p:.3g} "
                      f"({n1} and {n2} seeds): **{word}** (rule: p < 0.05 decides, the sign says which way). "
                      f"Were the rates {POWER_RATE} and 0, {seeds_for_power()} seeds per method would give "
                      "Fisher's p < 0.05 with 80 % probability (exact, over the binomial outcomes)."]
        lines += threshold_lines(g)

    runs = factorial_runs(g)
    cells = {(a, b): [0, 0] for a in "CN" for b in "CN"}
    for init, data, _, is_crossing in runs:
        cell = cells[("C" if init in CROSSING_SEEDS else "N", "C" if data in CROSSING_SEEDS else "N")]
        cell[0] += is_crossing
        cell[1] += 1
    p, verdict = factorial_verdict({key: tuple(v) for key, v in cells.items()})
    names = {"C": f"a crossing seed ({', '.join(map(str, CROSSING_SEEDS))})",
             "N": f"a non-crossing seed ({', '.join(map(str, NON_CROSSING_SEEDS))})"}
    lines += ["", "### Initialisation or data order?", "",
              "Margin 0.6 with `seed` (the initialisation) and `data_seed` (the order of the training "
              "windows) taken from different seeds. Rule: the runs initialised from a crossing seed with a "
              "non-crossing seed's data order against the reverse, by Fisher's exact test; p < 0.05 names "
              "the factor that decides.",
              "",
              "| initialisation from | data order from | makes it: k of n, rate [95 % CI] | runs (init/data: "
              "LR accuracy) |",
              "|---|---|---|---|"]
    for (a, b), (k, n) in cells.items():
        members = [f"{i}/{d}: {acc:.3f}" for i, d, acc, _ in runs
                   if (i in CROSSING_SEEDS) == (a == "C") and (d in CROSSING_SEEDS) == (b == "C")]
        lines.append(f"| {names[a]} | {names[b]} | {rate_cell(k, n) if n else '—'} | "
                     f"{', '.join(members) or '—'} |")
    lines += ["", f"Counted in runs, as the rule does: {verdict}"
              + (f" (Fisher's exact p = {p:.3g})." if p is not None else ".")
              + " Runs that share an initialisation are not independent: the count that is the sample "
                "size is the one per initialisation, next."]
    lines += per_initialisation_lines(runs)
    record["runs"] += [{"method": "factorial", "seed": i, "data_seed": d, "lr_accuracy": acc, "crossed": c}
                       for i, d, acc, c in runs if i != d]

    curves = twin_curves(g)
    thresholded = {}  # (method, seed) -> (steps, values), crossed: the runs at margin 0.6
    for method, per_seed in curves.items():
        if method.startswith(FACTORIAL_METHOD):
            for seed, curve in per_seed.items():
                thresholded[(method, seed)] = curve, crossed(g.results[method][seed])
    if curves:
        lines += ["", "### What the transition looks like", "",
                  "At every evaluation each run logs `twin_cos`, the mean cosine between each LR row of the "
                  "tied embedding and its HR twin, and `twin_top3`, the fraction of rows whose twin is "
                  f"among their 3 nearest. {sum(len(c) for c in curves.values())} runs have these curves "
                  "(runs archived before they were logged have none)."]
        crossing = [c for c, is_crossing in thresholded.values() if is_crossing]
        rest = [c for c, is_crossing in thresholded.values() if not is_crossing]
        if crossing and rest:
            parts = sorted((parting_step(curve, rest), f"{seed}" if "," not in method else
                            f"{seed}/{method.rsplit(' ', 1)[1]}")
                           for (method, seed), (curve, is_crossing) in thresholded.items() if is_crossing)
            lines += ["", f"Margin 0.6 runs with curves: {len(crossing)} make the transition, {len(rest)} do "
                          "not. Step from which each crossing run's twin_cos stays above every non-crossing "
                          "run's: "
                          + ", ".join(f"{name}: {step if step is not None else 'never'}"
                                      for step, name in parts) + "."]
            inits = sorted({seed for (method, seed), (_, is_crossing) in thresholded.items() if is_crossing})
            lines += ["", "Does an early reading predict it? Each run is called from the others alone "
                          "(leave one out: above the midpoint of the others' crossing and non-crossing "
                          f"means of twin_cos at that step). The crossing runs come from {len(inits)} "
                          f"initialisation(s) ({', '.join(map(str, inits))}), and runs that share one are "
                          "not independent calls: the rates below hold for these runs; the registered "
                          "T3 below tests the step-1000 reading on new seeds.", "",
                          "| step | hits | false alarms |", "|---|---|---|"]
            for step in EARLY_STEPS:
                readings = [(values[steps.index(step)], is_crossing)
                            for (steps, values), is_crossing in thresholded.values() if step in steps]
                hits, n_yes, alarms, n_no = leave_one_out(readings)
                lines.append(f"| {step} | {hits} of {n_yes} | {alarms} of {n_no} |")
    return lines + [""], record


POWER_RATE = 0.10
THRESHOLDS = (0.38, 0.39, 0.40, 0.41, 0.42, 0.43, 0.44, 0.45)


def seeds_for_power(rate=POWER_RATE, power=0.8):
    """The fewest seeds per method at which rates of `rate` and 0 give Fisher's p < 0.05 with
    probability `power` (every binomial outcome of the first method, the second at 0 of n)."""
    n = 1
    while sum(math.comb(n, k) * rate ** k * (1 - rate) ** (n - k) for k in range(n + 1)
              if fisher_exact(k, n, 0, n) < 0.05) < power:
        n += 1
    return n


def threshold_lines(g):
    """How the rates and Fisher's p move with the threshold (the one stated is a choice)."""
    accuracies = {m: [r["low"]["accuracy"] for r in g.results.get(m, {}).values()] for m in RATE_METHODS}
    if not all(accuracies.values()):
        return []
    lines = ["", f"The threshold {TRANSITION_LR_ACCURACY} is a choice; the same counts at others:", "",
             "| LR accuracy threshold | " + " | ".join(RATE_METHODS) + " | Fisher's exact p |",
             "|---|---|---|---|"]
    for threshold in THRESHOLDS:
        (k2, n2), (k1, n1) = ((sum(a >= threshold for a in accuracies[m]), len(accuracies[m]))
                              for m in RATE_METHODS)
        lines.append(f"| {threshold:.2f} | {k2} of {n2} | {k1} of {n1} | "
                     f"{fisher_exact(k1, n1, k2, n2):.3g} |")
    return lines


def per_initialisation_lines(runs):
    """The factorial counted per initialisation: runs sharing one are not independent, and the two
    crossing initialisations were chosen because they crossed."""
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
    p = fisher_exact(k1, n1, k2, n2)
    word = ("the initialisation decides" if k1 / n1 > k2 / n2 else "the data order decides") \
        if p < 0.05 else "not shown at this size"
    return ["", f"Per initialisation (runs with another seed's data order that make it: {cells}): {k1} of "
                f"{n1} crossing initialisations make it in every run, against {k2} of {n2} non-crossing "
                f"ones, Fisher's exact p = {p:.3g}: **{word}**. The {n1} crossing initialisations were "
                "picked because they crossed; the fresh seeds' T2 below tests the question on seeds "
                "nobody picked."]


def twin_figure(g, results_dir):
    """[(title, path)] of the figure of every run's twin_cos curve (CE, margin 0.6 and the
    factorial in panels of their own), the runs that make the transition marked; [] without curves
    or matplotlib."""
    panels = {}
    for method, per_seed in twin_curves(g).items():
        title = (method if method in RATE_METHODS else
                 "factorial (init/data)" if ", data order of " in method else None)
        if title is not None:
            for seed, curve in per_seed.items():
                label = f"{seed}/{method.rsplit(' ', 1)[1]}" if ", data order of " in method else str(seed)
                panels.setdefault(title, {})[label] = (*curve, crossed(g.results[method][seed]))
    path = figures.marked_curves(panels, os.path.join(results_dir, "figures", "jostling_twin_cosine.png"),
                                 "twin_cos")
    return [("Mean cosine of each LR row with its HR twin at every evaluation (runs that make the "
             "transition in red)", path)] if path else []


def per_seed_table(g):
    """Stop Jostling's headline run may be a transition some seeds make, not a shift of the mean:
    how many seeds pass the threshold and when, then every seed's LR accuracy and twin-in-top-3 in
    a section of their own (a table row of 30 values is wider than a screen)."""
    lines = ["", "## Per seed: LR accuracy and the Stop Jostling transition", "",
             f"A seed \"makes the transition\" when its LR accuracy reaches {TRANSITION_LR_ACCURACY} (about "
             f"halfway from the ≈ .37 of thresholded runs to the authors' {PAPER_SE_LR_ACCURACY}). Values "
             "sorted, best checkpoint (best mixed val loss). The rate's interval is the exact "
             "(Clopper-Pearson) 95 % interval of k in n seeds. When: the first evaluation at which the "
             f"seed's LR val loss is {DEPARTURE_NATS} nats below that of every seed of the method that does "
             "not make it.", "",
             "| method | seeds | seeds at or above the threshold | rate [95 % CI] | seeds that make it (when) |",
             "|---|---|---|---|---|"]
    every_seed = ["", "### Every seed, sorted", "",
                  "LR accuracy and the share of rows whose twin is among their 3 nearest (twin in top-3), "
                  "each sorted on its own.", ""]
    for method in g.every_method():
        method_runs = g.results.get(method, {})
        if method_runs:
            acc = sorted(r["low"]["accuracy"] for r in method_runs.values())
            twins = sorted(r["translations"]["twin_top3_fraction"] for r in method_runs.values())
            made = sorted(seed for seed, r in method_runs.items()
                          if r["low"]["accuracy"] >= TRANSITION_LR_ACCURACY)
            low, high = stats.clopper_pearson(len(made), len(acc))
            when = departures(g, method, made)
            departed = ", ".join(f"{s} (step {when[s]})" if when[s] is not None
                                 else f"{s} (never {DEPARTURE_NATS} nats below)" for s in made)
            lines.append(f"| {method} | {len(acc)} | {len(made)} of {len(acc)} | "
                         f"{len(made) / len(acc):.2f} [{low:.2f}, {high:.2f}] | {departed or '—'} |")
            every_seed.append(f"- **{method}** ({len(acc)} seeds): LR accuracy "
                              f"{' '.join(f'{a:.3f}' for a in acc)}; twin in top-3 "
                              f"{' '.join(f'{t:.3f}' for t in twins)}")
    return lines + every_seed


DEPARTURE_NATS = 0.1


def departures(g, method, made):
    """{seed: the first evaluation step at which its LR val loss is DEPARTURE_NATS below the LR val
    loss of every seed of the method that does not make the transition (None if never, or if
    every seed makes it)} for the seeds in made."""
    curves = {}
    for seed, run in g.runs[method].items():
        curves[seed] = {r["iter"]: r["val_low"]
                        for r in read_log(os.path.join(run["dir"], "log.jsonl")) if "val_low" in r}
    others = [curves[s] for s in curves if s not in made]
    when = {}
    for seed in made:
        steps = [step for step in sorted(curves[seed]) if others and all(step in c for c in others)
                 and curves[seed][step] <= min(c[step] for c in others) - DEPARTURE_NATS]
        when[seed] = steps[0] if steps else None
    return when
