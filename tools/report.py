"""
results/<grid>.md from a grid's archived runs (results/runs/<grid>/<method>/seed<S>:
metrics.json, marginalization.json, run.json, log.jsonl; wall.json per grid). The table opens with
the papers' claims, each judged by the rule in claims.py / stats.py, then gives mean ± std over
seeds of every metric, the paper's number beside ours where it has one, and each method's paired
difference to the baseline on the same seeds with its 95 % t interval: a seed moves every method
together, so the paired figure is what separates an effect from noise. It ends with the grid's
efficiency = (grid FLOPs / peak) / wall time over all its compare.py calls. Its figures:
grid_figures.make_figures.
"""

import collections
import json
import os
import statistics

import torch

import evaluate
import metrics
from tools import claims, identity, preregistered, stats, transition
from tools.grid_runs import Grid, paired_columns
from tools.grids import METRICS, PAPER, POOLABLE, RERUN_OF, run_dir, runs_of
from tools.runner import UnpooledRuns, grid_calls
from utils import read_log, save_json

# the char grids score two languages; their tables use the paper's names
LANGUAGE_NAMES = {"high": "HR", "low": "LR"}


def mean_std(values):
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(values) > 1 else 0.0)


def fmt(values, digits=3):
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def table_lines(header, rows):
    """A Markdown table: its header, the rule under it and a line per row of cells."""
    return (["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
            + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def build_table(grid, root):
    """results/<grid>.md from the archived runs under root (metrics.json, marginalization.json,
    run.json, log.jsonl) and root/<grid>/wall.json, one section after the other."""
    g = Grid(grid, root)
    seeds = ", ".join(map(str, sorted({s for per_seed in g.results.values() for s in per_seed})))
    lines = [f"# Grid `{grid}`", "",
             f"Produced by `python -m tools.compare {grid}` from the runs' `metrics.json` (mean ± std over "
             f"seeds {seeds}, as many as each method lists). Evaluation on the whole val split, never "
             "thresholded; the checkpoint with the best " + ("mixed " if g.low_resource else "")
             + "val loss." +
             (" `paper` rows: the authors' numbers (Stop Jostling Table 7; baseline and margin 0.6 + SE from "
              "their published single-seed runs)." if grid in PAPER else ""), ""]
    pair_lines, identities = machine_lines(g)
    lines += pair_lines
    if grid == "jostling":  # what the grid found beyond the paper's claims: the transition
        transition_lines, record = transition.findings(g)
        lines += transition_lines
        save_json(record, os.path.join(root, grid, "transition.json"))
        lines += preregistered.section(root)  # issue 40's registered tests, once any of its runs is in
    claim_lines = claims.claims_table(grid, g.runs, g.baseline)
    if claim_lines:
        lines += ["## The papers' claims", ""] + claim_lines + [""]
    form_lines = claims.claims_table(grid, g.runs, g.baseline, claims.FORM_CLAIMS, with_rule=False)
    if form_lines:
        lines += ["## Dispersion as its authors' released code computes it", "",
                  "The rows marked *authors' form* train with `dispersion_form = \"authors\"`: the "
                  "constants of the released code where it differs from the paper's Algorithm 1 "
                  "(`docs/fidelity.md`). Each is judged against CE, as its paper-form row is above, and "
                  "against its paper-form row on the same seeds. The paper does not say which form produced "
                  "its numbers; against the paper's form, \"reproduces\" reads \"the released form gives "
                  "the lower HR PPL\" and \"contradicted\" the higher. The verdict rule is the one above; "
                  "these rows are Holm-adjusted together, apart from the papers' claims, so they leave "
                  "those verdicts as they were.", ""] + form_lines + [""]
    norm_lines = claims.claims_table(grid, g.runs, g.baseline, claims.NORM_CLAIMS, with_rule=False)
    if norm_lines and claims.NORM_METHOD in g.results:
        lines += ["## l2_repel's norm term alone (issue 40)", "",
                  "The released l2_repel is its norm term 0.1 · mean(z²) plus a log-sum-exp repulsion "
                  "whose off-diagonal terms vanish once the states are far apart. This row trains with the "
                  "norm term alone. The rule is the one above, Holm-adjusted over these two rows only, and "
                  "was registered in `results/preregistration.md` (T6). The row's effect counts as the norm "
                  "term's when the first row reproduces and the second row's interval lies within ±0.04.",
                  ""] + norm_lines + [""]
        evaluated = claims.evaluate_claims(grid, g.runs, g.baseline, claims.NORM_CLAIMS)
        outcome = preregistered.norm_term_outcome(evaluated)
        lines += [f"Outcome: **{outcome}**." if outcome
                  else "Outcome: none until both rows have their 5 seeds.", ""]
    if grid == "bpe_1600":  # issue 40: whether CE has converged at 1600 steps (T7)
        lines += preregistered.convergence_lines(g.runs.get(g.baseline, {})) + [""]
    lines += metric_tables(g) + rare_target_table(g) + paired_table(g) + rerun_table(g)
    lines += speed_up_table(g)
    if g.low_resource:
        lines += transition.per_seed_table(g) + embedding_geometry_table(g)
    lines += hidden_geometry_table(g) + marginalization_table(g)
    speed_lines, seconds = speed_table(g)
    lines += speed_lines + speed_summary(grid, root, seconds, set(identity.run_devices(identities)))
    return "\n".join(lines) + "\n", g.results


def machine_lines(g):
    """How many of the pairs the tables compare (claims, paired differences) mix CPUs; and every
    run's identity (tools/identity.py), {run directory: identity or None}."""
    cpu = identity.grid_cpu(g.root, g.name)
    identities = {run["dir"]: identity.of_run(run["dir"], cpu) for per_seed in g.runs.values()
                  for run in per_seed.values()}
    compared = {(c["method"], c["baseline"] or g.baseline) for family in (claims.CLAIMS, claims.FORM_CLAIMS)
                for c in family.get(g.name, [])} | {(m, g.baseline) for m in list(g.methods)[1:]}
    pairs = [(g.runs[a][s]["dir"], g.runs[b][s]["dir"])
             for a, b in sorted(compared) if a in g.runs and b in g.runs
             for s in sorted(set(g.runs[a]) & set(g.runs[b]))]
    check_poolable(g.name, g.runs, compared, identities)
    lines = [identity.machines_line(pairs, identities), ""] if pairs else []
    lines += provenance_lines(g, identities)
    unrecorded = sorted((m, s) for m, per_seed in g.runs.items() for s, run in per_seed.items()
                        if identities[run["dir"]] is None)
    if unrecorded:
        named = ", ".join(f"{m} (seed {s})" for m, s in unrecorded)
        lines += [f"Runs without a record of what trained them (no run.json; declared in "
                  f"`tools/grids.py`, UNRECORDED_RUNS, since a comparison refuses any other): {named}.", ""]
    return lines, identities


def check_poolable(grid, runs, compared, identities):
    """Raise UnpooledRuns for the first compared pair (method, baseline, seed) whose two runs differ
    in code or CPU model, or do not record one, unless grids.POOLABLE declares the grid."""
    if grid in POOLABLE:
        return
    for method, baseline in sorted(compared):
        for seed in sorted(set(runs.get(method, {})) & set(runs.get(baseline, {}))):
            a, b = (identity.machine(identities[runs[m][seed]["dir"]]) for m in (method, baseline))
            (code_a, cpu_a), (code_b, cpu_b) = a, b
            if not identity.pools(a, b):
                raise UnpooledRuns(
                    f"grid {grid}: {method} and {baseline} on seed {seed} ran code {identity.short_code(code_a)} "
                    f"on {cpu_a} and code {identity.short_code(code_b)} on {cpu_b}: a comparison pairs runs of "
                    "one code on one CPU model; "
                    "train both again on one machine, or declare the grid in tools/grids.py's POOLABLE "
                    "with why its runs pool")


def provenance_lines(g, identities):
    """Which code (commit) and which CPU each method's runs came from, and, for a grid whose
    pairs may mix them, why it pools them (grids.POOLABLE)."""
    def counted(values):
        counts = sorted(collections.Counter(values).items())
        return ", ".join(f"{value} ×{n}" if n > 1 else value for value, n in counts)
    rows = []
    for method in g.every_method():
        found = [identity.machine(identities[run["dir"]]) for run in g.runs.get(method, {}).values()]
        if found:
            codes = counted(identity.short_code(code) for code, _ in found)
            rows.append((method, len(found), codes, counted(cpu for _, cpu in found)))
    lines = ["Code and machines: the commit each run trained at (+ the hash of its uncommitted changes; "
             "+dirty where they were not recorded) and its CPU model, per method.", ""]
    lines += table_lines(["method", "runs", "code", "CPU"], rows) + [""]
    if g.name in POOLABLE:
        lines += [f"This grid's pairs may mix code and machines, by declaration (tools/grids.py, "
                  f"POOLABLE): {POOLABLE[g.name]}.", ""]
    return lines


def metric_tables(g):
    """Mean ± std over seeds of every metric, per val split, with the paper's rows."""
    lines = []
    # where the paper's I(W) sits beside ours, ours is also computed the authors' way (a different metric:
    # metrics.isotropy_authors), from the archived tied embedding; the paper's value goes in that column
    with_authors = g.name in PAPER
    header = [*METRICS, "isotropy, authors' way", "authors' way over all signs"] if with_authors else METRICS
    if with_authors:
        lines += ["`isotropy` is our I(W), well defined (both signs of each eigenvector); `isotropy, "
                  "authors' way` is I(W) computed as the paper computed its I(W) column (one sign per "
                  "eigenvector, no negatives), so the paper's value sits in that column only. The paper "
                  "took the signs its eigensolver returned, which change with the solver; ours are set by a "
                  "stated rule, each eigenvector's largest-magnitude component positive, so any solver "
                  "gives the same value (`metrics.isotropy_authors`). The last column is the spread the "
                  "choice of signs allows: the mean over seeds of each run's lowest and highest value over "
                  "all 2^C sign choices (`metrics.isotropy_sign_range`).", ""]
    for lang in g.langs:
        rows = []
        for method in g.methods:
            method_runs = g.results.get(method, {})
            if method_runs:
                cells = [fmt([r[lang][k] for r in method_runs.values()],
                             2 if k in ("ppl", "ppl_best", "t_best") else 3)
                         for k in METRICS]
                if with_authors:
                    cells.append(fmt([claims.isotropy_authors_of(lang)(run)
                                      for run in g.runs[method].values()]))
                    ranges = [claims.isotropy_authors_of(lang, metrics.isotropy_sign_range)(run)
                              for run in g.runs[method].values()]
                    cells.append(f"[{mean_std([r[0] for r in ranges])[0]:.3f}, "
                                 f"{mean_std([r[1] for r in ranges])[0]:.3f}]")
                rows.append((method, len(method_runs), *cells))
            paper = PAPER.get(g.name, {}).get(method)
            if paper:
                values = [f"*{v[0 if lang == 'high' else 1]}*" for v in paper]
                if with_authors:
                    values = values[:-1] + ["—", values[-1], "—"]
                rows.append((f"*paper: {method}*", 1, *values))
        lines += [f"## {LANGUAGE_NAMES[lang]} validation" if g.low_resource else "## Validation", ""]
        lines += table_lines(["method", "seeds", *header], rows) + [""]
    return lines


def rare_target_table(g):
    """The BPE grid: the metrics of the val positions whose target is rare in the training split."""
    if not any(lang == "rare" for _, lang, _ in paired_columns(g.results)):
        return []
    lines = ["## Rare targets", "",
             f"The val positions whose target token occurs at most {evaluate.RARE_MAX_COUNT} times in the "
             "training split (the long tail; Stop Jostling's low-resource tokens on a natural "
             "vocabulary).", ""]
    at_t_best = ("rare", "ppl_at_t_best") in [(lang, key) for _, lang, key in paired_columns(g.results)]
    rows = []
    for method in g.methods:
        runs = [r["rare"] for r in g.results.get(method, {}).values()]
        if runs:
            rows.append((method, len(runs), fmt([r["fraction"] for r in runs]),
                         fmt([r["ppl"] for r in runs], 0))
                        + ((fmt([r["ppl_at_t_best"] for r in runs], 0),) if at_t_best else ())
                        + (fmt([r["accuracy"] for r in runs]), fmt([r["mrr"] for r in runs])))
    return lines + table_lines(["method", "seeds", "fraction of val", "PPL"]
                               + (["PPL at the run's T_best"] if at_t_best else []) + ["accuracy", "MRR"],
                               rows) + [""]


def paired_table(g):
    """Each method minus the baseline on the same seeds: mean, 95 % t interval, k/n."""
    base, columns = g.results.get(g.baseline, {}), paired_columns(g.results)
    lines = [f"## Paired difference to {g.baseline} (same seeds, method − {g.baseline})", "",
             "Each cell: the mean of the per-seed differences, its 95 % t interval (n − 1 degrees of "
             "freedom, not adjusted for multiple comparisons) and how many of the n seeds go the way of the "
             "mean.", ""]
    rows = []
    for method in list(g.methods)[1:]:
        runs_m, shared = g.results.get(method, {}), g.shared_with_baseline(method)
        if not shared:
            continue

        def diff(lang, key):
            digits = 3  # rates; perplexities with as many decimals as their size needs
            if key.startswith("ppl"):
                digits = 2 if mean_std([base[s][lang][key] for s in shared])[0] < 100 else 0
            return claims.paired_cell(stats.paired([runs_m[s][lang][key] - base[s][lang][key]
                                                    for s in shared]), digits)
        rows.append((method, len(shared), *(diff(lang, key) for _, lang, key in columns)))
    return lines + table_lines(["method", "seeds", *(title for title, _, _ in columns)], rows)


def rerun_table(g):
    """A grid that reruns another's configs and seeds (grids.RERUN_OF): how far each run's numbers
    moved, and each method's paired difference to the baseline in both, so a reader knows what
    agreement to expect from a rerun (another machine or code version; provenance in run.json)."""
    if g.name not in RERUN_OF:
        return []
    first = Grid(RERUN_OF[g.name], g.root)
    lines = [f"## Rerun of `{first.name}`", "",
             f"The same configs and seeds as the `{first.name}` grid, trained again later. Per run: the median "
             "and the largest |relative difference| of the rerun's number to the first run's, over the "
             "methods and seeds both hold. Per method: the paired mean difference to the baseline "
             "(%, method − baseline) in each grid.", ""]
    columns = [c for c in paired_columns(g.results) if c in paired_columns(first.results)]
    rows = []
    for title, lang, key in columns:
        moved = [abs(g.results[m][s][lang][key] / first.results[m][s][lang][key] - 1)
                 for m in g.results if m in first.results
                 for s in g.results[m] if s in first.results[m] and first.results[m][s][lang][key]]
        if moved:
            median = 100 * statistics.median(moved)
            rows.append((title, len(moved), f"{median:.1f} %", f"{100 * max(moved):.1f} %"))
    lines += table_lines(["metric", "runs", "median |difference|", "largest"], rows) + [""]
    rows = []
    for method in list(g.methods)[1:]:
        cells = []
        for grid in (first, g):
            shared = grid.shared_with_baseline(method)
            base, runs = grid.results[grid.baseline], grid.results.get(method, {})
            change = [100 * (runs[s][lang][key] / base[s][lang][key] - 1)
                      for s in shared for _, lang, key in columns if key == "ppl_best"]
            cells.append(claims.paired_cell(stats.paired(change), 1) if len(change) > 1 else "—")
        rows.append((method, *cells))
    return lines + table_lines(["method", f"PPL_best (%) in `{first.name}`", f"in `{g.name}`"], rows)


def speed_up_table(g):
    """SimReg's claim, the same loss in fewer steps (claims.speed_up), for every method."""
    if "SimReg" not in g.methods:
        return []
    lines = ["", f"## Steps to reach {g.baseline}'s final val loss (same seed)", "",
             "Speed-up = 1 − (steps a method needs to first reach the "
             f"{'mixed ' if g.low_resource else ''}val loss of {g.baseline}'s last evaluation on the same "
             f"seed) / ({g.baseline}'s total steps); the crossing is linearly interpolated between "
             "evaluations (every eval_interval steps), and a run that never reaches it counts as 0. "
             f"{g.baseline}'s own row is the noise floor: its curve can dip below its final value before the "
             "end. Chained methods (CWT + FT) are left out: their log holds the fine-tune only.", ""]
    rows = []
    for method in g.methods:
        shared = g.shared_with_baseline(method)
        if not shared or isinstance(g.methods[method][0], tuple):
            continue
        curves = [(claims.val_curve(run_dir(g.root, g.name, method, s)),
                   claims.val_curve(run_dir(g.root, g.name, g.baseline, s)))
                  for s in shared]
        reached = sum(claims.steps_to_reach(mine, base[-1][1]) is not None for mine, base in curves)
        speed = [100 * claims.speed_up_of_curves(mine, base) for mine, base in curves]
        rows.append((method, f"{reached} of {len(shared)}", claims.paired_cell(stats.paired(speed), 1)))
    return lines + table_lines(["method", "seeds that reach it", "speed-up in %, mean [95 % CI], k/n"], rows)


def embedding_geometry_table(g):
    """The char grids: isotropy of all rows and how often a letter's twin in the other language is near it."""
    rows = []
    for method in g.methods:
        runs = list(g.results.get(method, {}).values())
        if runs:
            t = [r["translations"] for r in runs]
            rows.append((method, fmt([r["isotropy_all"] for r in runs]),
                         fmt([x["twin_top3_fraction"] for x in t]),
                         fmt([x["cases_12"] for x in t], 1), fmt([x["cases_letters"] for x in t], 1)))
    header = ["method", "I(W) all rows", "twin in top-3 (of 130 rows)", "12 cases (A/a, HR/LR)",
              "all letters (of 312)"]
    return ["", "## Embedding geometry", ""] + table_lines(header, rows)


def hidden_geometry_table(g):
    """Condensation of the hidden states with depth (runs evaluated with geometry metrics)."""
    if not any("geometry" in r for per_seed in g.results.values() for r in per_seed.values()):
        return []
    lines = ["", "## Hidden-state geometry" + (" (HR val)" if g.low_resource else " (val)"), "",
             "mu(l): mean pairwise cosine of a sequence's states after block l; rho / tau: Spearman and "
             "Kendall correlation of mu(l) with depth (positive = condensing with depth); SimReg value of "
             "the final states at tau 0.01.", ""]
    rows = []
    for method in g.methods:
        runs = [r["geometry"][g.langs[0]] for r in g.results.get(method, {}).values() if "geometry" in r]
        if runs:
            simreg_values = [x["simreg_final"] for x in runs]
            corr = {k: [x[k] for x in runs if x[k] is not None] for k in ("spearman_rho", "kendall_tau")}
            rho, tau = (fmt(corr[k], 2) if corr[k] else "n/a" for k in ("spearman_rho", "kendall_tau"))
            rows.append((method, fmt([x["mu"][-1] for x in runs]), rho, tau,
                         fmt([x["final_cosine"] for x in runs]),
                         f"{mean_std(simreg_values)[0]:.1e} ± {mean_std(simreg_values)[1]:.1e}"))
    header = ["method", "mu(last block)", "Spearman rho", "Kendall tau", "final-state cosine",
              "SimReg(final)"]
    return lines + table_lines(header, rows)


def marginalization_table(g):
    """Stop Jostling's gradient-norm ratios of the low-resource rows (runs with log_marginalization),
    and the first two such methods compared on the same seeds."""
    per_seed = {}
    for method, seed, *_, out in runs_of(g.name, g.root):
        path = os.path.join(out, "marginalization.json")
        if os.path.exists(path):
            with open(path) as f:
                per_seed.setdefault(method, {})[seed] = json.load(f)
    if not per_seed:
        return []
    lines = ["", "## Marginalization of low-resource tokens (gradient-norm ratios, whole run)", "",
             "Per LR token: Ratio of Average = (avg g_input + avg g_target) / avg g_non-target; Average of "
             "Ratio = avg over steps of (g_input + g_target) / g_non-target (Stop Jostling Sec. 4.2). Means "
             "over the 65 LR tokens, then mean ± std over seeds. Paper: baseline has the 14 rarest tokens "
             "below 1 in Ratio of Average and all 65 below 1 in Average of Ratio; thresholding raises them "
             "by 12 % and 45 %.", ""]
    header = ["method", "seeds", "mean Ratio of Average", "mean Average of Ratio", "tokens with RoA < 1",
              "tokens with AoR < 1"]
    keys = {"mean_ratio_of_average": 3, "mean_average_of_ratio": 3, "n_ratio_of_average_below_1": 1,
            "n_average_of_ratio_below_1": 1}  # -> digits
    lines += table_lines(header, [(method, len(by_seed), *(fmt([r[k] for r in by_seed.values()], digits)
                                                            for k, digits in keys.items()))
                                  for method, by_seed in per_seed.items()])
    names = list(per_seed)
    if len(names) >= 2:
        a, b = per_seed[names[0]], per_seed[names[1]]
        shared = sorted(set(a) & set(b))
        cells = [claims.paired_cell(stats.paired([100 * (b[s][key] / a[s][key] - 1) for s in shared]), 1)
                 for key in ("mean_ratio_of_average", "mean_average_of_ratio")]
        lines += ["", f"{names[1]} vs {names[0]}, paired on seeds {', '.join(map(str, shared))} (relative "
                  f"change per seed, %): Ratio of Average {cells[0]}; Average of Ratio {cells[1]} (paper: "
                  "+12 % and +45 %)."]
    return lines


def speed_table(g):
    """Training throughput from each run's log and wall times from run.json; also returns the
    seconds time_breakdown needs, summed while reading them."""
    seconds, rows = {"steps": 0.0, "single_stage_runs": 0.0, "runs": 0.0, "trained_runs": 0}, []
    for method in g.every_method():
        speeds, walls = [], []
        for out in (run["dir"] for run in g.runs.get(method, {}).values()):
            run_speeds = [r for r in read_log(os.path.join(out, "log.jsonl")) if "tokens_per_s" in r]
            speeds += run_speeds
            if os.path.exists(os.path.join(out, "run.json")):
                with open(os.path.join(out, "run.json")) as f:
                    run = json.load(f)
                walls.append(run["wall_s"])
                if "reused_from" not in run:  # a run copied from another grid took none of this grid's time
                    seconds["runs"] += run["wall_s"]
                    seconds["trained_runs"] += 1
                # a chained run's log holds its last stage
                if run_speeds and len(run.get("commands", [])) == 1:
                    iterations = run_speeds[-1]["iter"] + 1
                    seconds["steps"] += iterations * statistics.median(r["ms_per_iter"]
                                                                       for r in run_speeds) / 1000
                    seconds["single_stage_runs"] += run["wall_s"]
        if speeds:
            med = {k: torch.tensor([r[k] for r in speeds]).median().item()
                   for k in ("tokens_per_s", "ms_per_iter", "mfu")}
            wall = f"{sum(walls) / len(walls) / 60:.1f} min" if walls else "n/a"
            rows.append((method, len(g.results.get(method, {})), f"{med['tokens_per_s']:.0f}",
                         f"{med['ms_per_iter']:.1f}", f"{med['mfu']:.2f}" if med["mfu"] >= 0.01 else
                         f"{med['mfu']:.1e}", wall))
    header = ["method", "runs", "median tokens/s per run", "median ms/iter", "median MFU",
              "mean wall time per run"]
    return ["", "## Speed", ""] + table_lines(header, rows), seconds


def peak_range(calls):
    """'measured peak of 176 GFLOP/s (float32, all cores)', or, when calls measured different
    peaks, their range per dtype: each call's FLOPs are divided by the peak measured at that call's
    start, in the dtype it chose (bf16 on a CPU with bf16 units)."""
    calls = [c for c in calls if c["flops"]] or calls  # a call stopped before any FLOPs used no peak
    by_dtype = {}
    for c in calls:
        by_dtype.setdefault(c["peak_dtype"], set()).add(round(c["peak_flops"] / 1e9))
    spans = {dtype: f"{min(p)}–{max(p)}" if len(p) > 1 else str(min(p)) for dtype, p in by_dtype.items()}
    if len(spans) == 1:
        ((dtype, span),) = spans.items()
        if len(by_dtype[dtype]) == 1:
            return f"measured peak of {span} GFLOP/s ({dtype}, all cores)"
        return f"peaks measured at each call's start ({dtype}, all cores: {span} GFLOP/s)"
    return ("peaks measured at each call's start (all cores; "
            + ", ".join(f"{dtype}: {span}" for dtype, span in spans.items()) + " GFLOP/s)")


def speed_summary(grid, root, seconds, trained_on=()):
    """The grid's wall time over all compare.py calls and its efficiency:
    (grid FLOPs / peak) / wall time, where grid FLOPs are what the runs executed (training,
    evaluation, fine-tuning; train.py counts them) and peak is the matmul peak each call
    measured on all cores before starting (the CPU's: calls whose runs trained on a GPU are left
    out); then where the time went (time_breakdown of the `seconds` build_table summed while it
    read the runs' logs). trained_on: the runs' `device` training keys, which name a call's device
    where its wall.json record predates the `device` field."""
    calls = grid_calls(os.path.join(root, grid, "wall.json"))
    lines = ["", "MFU per run = model FLOPs (6N + attention) / that run's own measured fp32 2048² matmul "
             "peak on its thread(s), measured while other runs may share the machine."]
    if "cuda" in trained_on:
        lines[-1] += (" On a GPU that utils.GPU_PEAK_BF16_FLOPS lists, the peak is instead its "
                      "datasheet's dense bf16 peak, whatever dtype the run trained in.")
    if not calls:
        return lines
    wall = sum(c["wall_s"] for c in calls)
    runs = sum(c["runs"] for c in calls)
    last = calls[-1]
    unnamed = "a CUDA GPU (device=cuda; wall.json did not yet name it)" if "cuda" in trained_on else "cpu"
    devices = [c.get("device", unnamed) for c in calls]
    gpus = sorted({d for d in devices if d not in ("cpu", "mps")})
    lines += ["", f"Wall time: {runs} runs in {wall / 3600:.2f} h over {len(calls)} `tools.compare {grid}` "
              f"call(s), {last['workers']} runs at a time with {last['threads_per_run']} thread(s) each, on "
              f"{last['cpu']} ({last['cores']} cores)" + (f", training on {', '.join(gpus)}" if gpus else "")
              + f", torch {last['torch']}."]
    # a call killed before compare.py rewrote its record each minute left no record, while its
    # runs' own wall times (run.json, summed over the calls that worked on them) were kept
    unrecorded = seconds["trained_runs"] - runs
    if unrecorded > 0:
        lines[-1] += (f" wall.json's call records account for {runs} of the {seconds['trained_runs']} runs "
                      f"this grid trained: the calls that trained the other {unrecorded} left no record, so "
                      "this wall time and the figures drawn from it cover the recorded calls only.")
    grid_wall = wall if unrecorded <= 0 else None
    counted = [c for c, d in zip(calls, devices) if c.get("flops") is not None and c.get("peak_flops")
               and d not in gpus]
    if gpus and not counted:
        return lines + ["", "Efficiency: not computed, as the runs trained on a GPU and the peak each call "
                        "measures is its CPU's."] + time_breakdown(seconds, grid_wall, last["workers"])
    if counted:
        flops = sum(c["flops"] for c in counted)
        at_peak = sum(c["flops"] / c["peak_flops"] for c in counted)
        counted_wall = sum(c["wall_s"] for c in counted)
        scope = "" if len(counted) == len(calls) else \
            (f" (the {len(counted)} call(s) whose runs counted their FLOPs{' on the CPU' if gpus else ''}: "
             f"{sum(c['runs'] for c in counted)} runs, {counted_wall / 3600:.2f} h)")
        lines += ["", "**Efficiency = (grid FLOPs / peak) / wall time = "
                  f"{at_peak / counted_wall:.2f}**{scope}: {flops / 1e15:.3f} PFLOP executed (training, "
                  f"evaluation and fine-tuning), which at the {peak_range(counted)} would take "
                  f"{at_peak / 60:.1f} min."]
    else:
        lines += ["", "Efficiency: not available (these runs were made before train.py counted the FLOPs it "
                      "executes)."]
    return lines + time_breakdown(seconds, grid_wall, last["workers"])


def time_breakdown(seconds, grid_wall, workers):
    """Where a grid's wall time went: the share of the runs' wall time spent in training steps
    (each run's iterations x its median ms/iter; single-stage runs only, since a chained run's log
    holds its last stage), and how much of workers x grid wall time the runs themselves filled
    (the rest: the grid's tail, when fewer runs than workers are left, and the gaps between runs).
    `seconds` is summed over the runs by build_table; grid_wall is None where wall.json lacks
    some calls' records (the fill is then left out)."""
    step_s, run_s, all_runs_s = seconds["steps"], seconds["single_stage_runs"], seconds["runs"]
    if not run_s:
        return []
    line = ("Where the time went: training steps (iterations × median ms/iter) are "
            f"{100 * step_s / run_s:.0f} % of the single-stage runs' wall time, the rest being evaluation, "
            "checkpoints and process start")
    if grid_wall is None:
        return ["", line + "."]
    if all_runs_s > workers * grid_wall:  # the calls' records hold less time than the runs took
        return ["", line + f"; the runs' wall times add up to more than {workers} × the calls' recorded "
                "wall time: some calls left no record of their time (killed before their last minute)."]
    return ["", line + f"; the runs' wall times fill {100 * all_runs_s / (workers * grid_wall):.0f} % of "
            f"{workers} × the grid's wall time, the rest being the grid's tail (fewer runs left than run "
            "at a time) and the gaps between runs."]
