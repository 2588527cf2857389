"""
results/<grid>.md, a grid's page, from its archived runs (results/runs/<grid>/).
What the pages say: results/README.md; how they are made: docs/grids.md.
"""

import collections
import os
import statistics

import torch

import metrics
import scoring
from tools import claims, identity, preregistered, stats, transition
from tools.grid_runs import Grid
from tools.grids import METRICS, PAPER, POOLABLE, RERUN_OF, runs_of
from tools.identity import read_json
from tools.runner import UnpooledRuns, grid_calls
from utils import markdown_table, read_log, save_json

FORM_INTRO = (
    "The rows marked *authors' form* train with `dispersion_form = \"authors\"`: the constants of "
    "the released code where it differs from the paper's Algorithm 1 (`docs/fidelity.md`). Each is "
    "judged against CE, as its paper-form row is above, and against its paper-form row on the same "
    "seeds. The paper does not say which form produced its numbers; against the paper's form, "
    "\"reproduces\" reads \"the released form gives the lower HR PPL\" and \"contradicted\" the "
    "higher. The verdict rule is the one above; these rows are Holm-adjusted together, apart from "
    "the papers' claims, so they leave those verdicts as they were.")
NORM_INTRO = (
    "The released l2_repel is its norm term 0.1 · mean(z²) plus a log-sum-exp repulsion whose "
    "off-diagonal terms vanish once the states are far apart. This row trains with the norm term "
    "alone. The rule is the one above, Holm-adjusted over these two rows only, and was registered "
    "in `results/preregistration.md` (T6). The row's effect counts as the norm term's when the "
    "first row reproduces and the second row's interval lies within ±0.04.")


def mean_std(values):
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(values) > 1 else 0.0)


def fmt(values, digits=3, style="f"):
    m, s = mean_std(values)
    return f"{m:.{digits}{style}} ± {s:.{digits}{style}}"


def column(runs, key, digits=3):
    return fmt([r[key] for r in runs], digits)


def build_table(grid, root):
    """(results/<grid>.md, {method: {seed: metrics}}) from the runs under root."""
    g = Grid(grid, root)
    seeds = sorted({s for per_seed in g.results.values() for s in per_seed})
    paper = (" `paper` rows: the authors' numbers (Stop Jostling Table 7; baseline and margin "
             "0.6 + SE from their published single-seed runs)." if grid in PAPER else "")
    lines = [f"# Grid `{grid}`", "",
             f"Produced by `python -m tools.compare {grid}` from the runs' `metrics.json` (mean "
             f"± std over seeds {', '.join(map(str, seeds))}, as many as each method lists). "
             "Evaluation on the whole val split, never thresholded; the checkpoint with the best "
             f"{'mixed ' if g.low_resource else ''}val loss.{paper}", ""]
    pair_lines, identities = machine_lines(g)
    lines += pair_lines
    if grid == "jostling":  # the transition: found beyond the paper's claims
        transition_lines, record = transition.findings(g)
        save_json(record, os.path.join(root, grid, "transition.json"))
        lines += transition_lines + preregistered.section(root)
    lines += claims_sections(g)
    if grid == "bpe_1600":  # issue 40: whether CE has converged at 1600 steps (T7)
        lines += preregistered.convergence_lines(g.runs.get(g.baseline, {})) + [""]
    lines += metric_tables(g) + rare_target_table(g) + paired_table(g) + rerun_table(g)
    lines += speed_up_table(g)
    if g.low_resource:
        lines += transition.per_seed_table(g) + embedding_geometry_table(g)
    lines += hidden_geometry_table(g) + marginalization_table(g)
    speed_lines, seconds = speed_table(g)
    devices = identity.run_devices(identities)
    lines += speed_lines + speed_summary(grid, root, seconds, devices)
    return "\n".join(lines) + "\n", g.results


def claims_sections(g):
    """The claims tables (claims.py), each family Holm-adjusted on its own."""
    lines = []
    for title, family, intro in (
            ("The papers' claims", claims.CLAIMS, []),
            ("Dispersion as its authors' released code computes it", claims.FORM_CLAIMS,
             [FORM_INTRO, ""])):
        table = claims.claims_table(g.name, g.runs, g.baseline, family,
                                    with_rule=family is claims.CLAIMS)
        if table:
            lines += [f"## {title}", "", *intro, *table, ""]
    if g.name in claims.NORM_CLAIMS and claims.NORM_METHOD in g.results:
        norm = (g.name, g.runs, g.baseline, claims.NORM_CLAIMS)
        outcome = preregistered.norm_term_outcome(claims.evaluate_claims(*norm))
        lines += ["## l2_repel's norm term alone (issue 40)", "", NORM_INTRO, "",
                  *claims.claims_table(*norm, with_rule=False), "",
                  f"Outcome: **{outcome}**." if outcome
                  else "Outcome: none until both rows have their 5 seeds.", ""]
    return lines


def machine_lines(g):
    """(lines on the code and CPUs of the runs the tables compare, {run directory:
    identity.of_run or None})."""
    cpu = identity.grid_cpu(g.root, g.name)
    identities = {run["dir"]: identity.of_run(run["dir"], cpu)
                  for per_seed in g.runs.values() for run in per_seed.values()}
    compared = {(c["method"], c["baseline"] or g.baseline)
                for family in (claims.CLAIMS, claims.FORM_CLAIMS) for c in family.get(g.name, [])}
    compared |= {(m, g.baseline) for m in list(g.methods)[1:]}
    pairs = [(a, b, s, g.runs[a][s]["dir"], g.runs[b][s]["dir"])
             for a, b in sorted(compared) if a in g.runs and b in g.runs
             for s in sorted(set(g.runs[a]) & set(g.runs[b]))]
    check_poolable(g.name, pairs, identities)
    lines = [identity.machines_line([p[3:] for p in pairs], identities), ""] if pairs else []
    lines += provenance_lines(g, identities)
    unrecorded = [f"{m} (seed {s})" for m, per_seed in sorted(g.runs.items())
                  for s, run in sorted(per_seed.items()) if identities[run["dir"]] is None]
    if unrecorded:
        lines += ["Runs without a record of what trained them (no run.json; declared in "
                  "`tools/grids.py`, UNRECORDED_RUNS, since a comparison refuses any other): "
                  f"{', '.join(unrecorded)}.", ""]
    return lines, identities


def check_poolable(grid, pairs, identities):
    """Raise UnpooledRuns for the first pair (method, baseline, seed,
    dir, dir) whose runs may not pool, unless grids.POOLABLE lists the grid."""
    if grid in POOLABLE:
        return
    for method, baseline, seed, *dirs in pairs:
        a, b = (identity.machine(identities[d]) for d in dirs)
        if not identity.pools(a, b):
            raise UnpooledRuns(
                f"grid {grid}: {method} and {baseline} on seed {seed} ran code "
                f"{identity.short_code(a[0])} on {a[1]} and code {identity.short_code(b[0])} on "
                f"{b[1]}: a comparison pairs runs of one code on one CPU model; train both again "
                "on one machine, or declare the grid in tools/grids.py's POOLABLE with why its "
                "runs pool")


def provenance_lines(g, identities):
    """Which code and CPU each method's runs came from, and why a grid pools them."""
    def counted(values):
        counts = sorted(collections.Counter(values).items())
        return ", ".join(f"{value} ×{n}" if n > 1 else value for value, n in counts)
    rows = []
    for method in g.every_method():
        found = [identity.machine(identities[run["dir"]])
                 for run in g.runs.get(method, {}).values()]
        if found:
            codes, cpus = zip(*found)
            rows.append((method, len(found), counted(map(identity.short_code, codes)),
                         counted(cpus)))
    lines = ["Code and machines: the commit each run trained at (+ the hash of its uncommitted "
             "changes; +dirty where they were not recorded) and its CPU model, per method.", ""]
    lines += markdown_table(["method", "runs", "code", "CPU"], rows) + [""]
    if g.name in POOLABLE:
        lines += ["This grid's pairs may mix code and machines, by declaration (tools/grids.py, "
                  f"POOLABLE): {POOLABLE[g.name]}.", ""]
    return lines


def metric_tables(g):
    """Mean ± std over seeds of every metric, per val split, with the paper's rows."""
    lines = []
    header = METRICS
    with_authors = g.name in PAPER
    if with_authors:
        header = [*METRICS, "isotropy, authors' way", "authors' way over all signs"]
        lines = [
            "`isotropy` is our I(W), well defined (both signs of each eigenvector); `isotropy, "
            "authors' way` is I(W) computed as the paper computed its I(W) column (one sign per "
            "eigenvector, no negatives), so the paper's value sits in that column only. The paper "
            "took the signs its eigensolver returned, which change with the solver; ours are set "
            "by a stated rule, each eigenvector's largest-magnitude component positive, so any "
            "solver gives the same value (`metrics.isotropy_authors`). The last column is the "
            "spread the choice of signs allows: the mean over seeds of each run's lowest and "
            "highest value over all 2^C sign choices (`metrics.isotropy_sign_range`).", ""]
    for lang in g.langs:
        rows = []
        for method in g.methods:
            runs = list(g.runs.get(method, {}).values())
            if runs:
                values = [r["metrics"][lang] for r in runs]
                cells = [column(values, k, 2 if k in ("ppl", "ppl_best", "t_best") else 3)
                         for k in METRICS]
                if with_authors:
                    ranges = claims.isotropy_authors_of(lang, metrics.isotropy_sign_range)
                    low, high = zip(*map(ranges, runs))
                    cells += [fmt(list(map(claims.isotropy_authors_of(lang), runs))),
                              f"[{mean_std(low)[0]:.3f}, {mean_std(high)[0]:.3f}]"]
                rows.append((method, len(runs), *cells))
            paper = [f"*{v[0 if lang == 'high' else 1]}*"
                     for v in PAPER.get(g.name, {}).get(method, ())]
            if paper:  # only a PAPER grid's, so with the authors' columns
                rows.append((f"*paper: {method}*", 1, *paper[:-1], "—", paper[-1], "—"))
        title = {"high": "HR validation", "low": "LR validation"}.get(lang, "Validation")
        lines += [f"## {title}", "", *markdown_table(["method", "seeds", *header], rows), ""]
    return lines


# (title, key, digits) of the rare-target table
RARE_COLUMNS = [("fraction of val", "fraction", 3), ("PPL", "ppl", 0),
                ("PPL at the run's T_best", "ppl_at_t_best", 0), ("accuracy", "accuracy", 3),
                ("MRR", "mrr", 3)]


def rare_target_table(g):
    """The rare-target section (BPE grids)."""
    keys = [key for _, lang, key in g.paired_columns() if lang == "rare"]
    if not keys:
        return []
    # older runs lack ppl_at_t_best
    columns = [c for c in RARE_COLUMNS if c[1] != "ppl_at_t_best" or c[1] in keys]
    rows = []
    for method in g.methods:
        runs = [r["rare"] for r in g.results.get(method, {}).values()]
        if runs:
            rows.append((method, len(runs), *(column(runs, k, d) for _, k, d in columns)))
    return (["## Rare targets", "",
             "The val positions whose target token occurs at most "
             f"{scoring.RARE_MAX_COUNT} times in the training split (the long tail; Stop "
             "Jostling's low-resource tokens on a natural vocabulary).", ""]
            + markdown_table(["method", "seeds", *(title for title, *_ in columns)], rows) + [""])


def paired_table(g):
    """Each method minus the baseline on the same seeds: mean, 95 % t interval, k/n."""
    base = g.results.get(g.baseline, {})
    columns = g.paired_columns()
    rows = []
    for method in list(g.methods)[1:]:
        shared = g.shared_with_baseline(method)
        if not shared:
            continue
        cells = []
        for _, lang, key in columns:
            digits = 3  # rates; perplexities with as many decimals as their size needs
            if key.startswith("ppl"):
                digits = 2 if mean_std([base[s][lang][key] for s in shared])[0] < 100 else 0
            cells.append(claims.paired_cell(stats.paired(g.paired(method, lang, key)), digits))
        rows.append((method, len(shared), *cells))
    return ([f"## Paired difference to {g.baseline} (same seeds, method − {g.baseline})", "",
             "Each cell: the mean of the per-seed differences, its 95 % t interval (n − 1 degrees "
             "of freedom, not adjusted for multiple comparisons) and how many of the n seeds go "
             "the way of the mean.", ""]
            + markdown_table(["method", "seeds", *(title for title, _, _ in columns)], rows))


def rerun_table(g):
    """The rerun section of a grid in grids.RERUN_OF."""
    if g.name not in RERUN_OF:
        return []
    first = Grid(RERUN_OF[g.name], g.root)
    lines = [f"## Rerun of `{first.name}`", "",
             f"The same configs and seeds as the `{first.name}` grid, trained again later. Per "
             "run: the median and the largest |relative difference| of the rerun's number to the "
             "first run's, over the methods and seeds both hold. Per method: the paired mean "
             "difference to the baseline (%, method − baseline) in each grid.", ""]
    columns = [c for c in g.paired_columns() if c in first.paired_columns()]
    rows = []
    for title, lang, key in columns:
        moved = [abs(g.results[m][s][lang][key] / first.results[m][s][lang][key] - 1)
                 for m in g.results if m in first.results for s in g.results[m]
                 if s in first.results[m] and first.results[m][s][lang][key]]
        if moved:
            rows.append((title, len(moved), f"{100 * statistics.median(moved):.1f} %",
                         f"{100 * max(moved):.1f} %"))
    lines += markdown_table(["metric", "runs", "median |difference|", "largest"], rows) + [""]
    rows = []
    for method in list(g.methods)[1:]:
        cells = []
        for grid in (first, g):
            change = [v for _, lang, key in columns if key == "ppl_best"
                      for v in grid.paired(method, lang, key, "relative")]
            cells.append(claims.paired_cell(stats.paired(change), 1) if len(change) > 1 else "—")
        rows.append((method, *cells))
    header = ["method", f"PPL_best (%) in `{first.name}`", f"in `{g.name}`"]
    return lines + markdown_table(header, rows)


def speed_up_table(g):
    """SimReg's claim, the same loss in fewer steps (claims.speed_up), for every method."""
    if "SimReg" not in g.methods:
        return []
    rows = []
    for method in g.methods:
        shared = g.shared_with_baseline(method)
        if not shared or isinstance(g.methods[method][0], tuple):  # a chained method
            continue
        curves = [[claims.val_curve(g.runs[m][s]["dir"]) for m in (method, g.baseline)]
                  for s in shared]
        reached = sum(claims.steps_to_reach(mine, base[-1][1]) is not None
                      for mine, base in curves)
        speed = [100 * claims.speed_up_of_curves(mine, base) for mine, base in curves]
        rows.append((method, f"{reached} of {len(shared)}",
                     claims.paired_cell(stats.paired(speed), 1)))
    header = ["method", "seeds that reach it", "speed-up in %, mean [95 % CI], k/n"]
    return ["", f"## Steps to reach {g.baseline}'s final val loss (same seed)", "",
            "Speed-up = 1 − (steps a method needs to first reach the "
            f"{'mixed ' if g.low_resource else ''}val loss of {g.baseline}'s last evaluation on "
            f"the same seed) / ({g.baseline}'s total steps); the crossing is linearly interpolated "
            "between evaluations (every eval_interval steps), and a run that never reaches it "
            f"counts as 0. {g.baseline}'s own row is the noise floor: its curve can dip below its "
            "final value before the end. Chained methods (CWT + FT) are left out: their log holds "
            "the fine-tune only.", ""] + markdown_table(header, rows)


def embedding_geometry_table(g):
    """The char grids: isotropy of all rows; how often a letter's twin is near it."""
    rows = []
    for method in g.methods:
        runs = list(g.results.get(method, {}).values())
        if runs:
            t = [r["translations"] for r in runs]
            rows.append((method, column(runs, "isotropy_all"), column(t, "twin_top3_fraction"),
                         column(t, "cases_12", 1), column(t, "cases_letters", 1)))
    header = ["method", "I(W) all rows", "twin in top-3 (of 130 rows)", "12 cases (A/a, HR/LR)",
              "all letters (of 312)"]
    return ["", "## Embedding geometry", ""] + markdown_table(header, rows)


def hidden_geometry_table(g):
    """Condensation of the hidden states with depth (runs with geometry metrics)."""
    if not any("geometry" in r for per_seed in g.results.values() for r in per_seed.values()):
        return []
    rows = []
    for method in g.methods:
        runs = [r["geometry"][g.langs[0]] for r in g.results.get(method, {}).values()
                if "geometry" in r]
        if runs:
            corr = [[x[k] for x in runs if x[k] is not None]
                    for k in ("spearman_rho", "kendall_tau")]
            rows.append((method, fmt([x["mu"][-1] for x in runs]),
                         *(fmt(c, 2) if c else "n/a" for c in corr),
                         column(runs, "final_cosine"),
                         fmt([x["simreg_final"] for x in runs], 1, "e")))
    header = ["method", "mu(last block)", "Spearman rho", "Kendall tau", "final-state cosine",
              "SimReg(final)"]
    return (["", "## Hidden-state geometry" + (" (HR val)" if g.low_resource else " (val)"), "",
             "mu(l): mean pairwise cosine of a sequence's states after block l; rho / tau: "
             "Spearman and Kendall correlation of mu(l) with depth (positive = condensing with "
             "depth); SimReg value of the final states at tau 0.01.", ""]
            + markdown_table(header, rows))


def marginalization_table(g):
    """Stop Jostling's gradient-norm ratios (runs with log_marginalization)."""
    per_seed = {}
    for method, seed, *_, out in runs_of(g.name, g.root):
        path = os.path.join(out, "marginalization.json")
        if os.path.exists(path):
            per_seed.setdefault(method, {})[seed] = read_json(path)
    if not per_seed:
        return []
    header = ["method", "seeds", "mean Ratio of Average", "mean Average of Ratio",
              "tokens with RoA < 1", "tokens with AoR < 1"]
    digits = {"mean_ratio_of_average": 3, "mean_average_of_ratio": 3,
              "n_ratio_of_average_below_1": 1, "n_average_of_ratio_below_1": 1}
    rows = [(method, len(by_seed), *(column(by_seed.values(), k, d) for k, d in digits.items()))
            for method, by_seed in per_seed.items()]
    lines = ["", "## Marginalization of low-resource tokens (gradient-norm ratios, whole run)", "",
             "Per LR token: Ratio of Average = (avg g_input + avg g_target) / avg g_non-target; "
             "Average of Ratio = avg over steps of (g_input + g_target) / g_non-target (Stop "
             "Jostling Sec. 4.2). Means over the 65 LR tokens, then mean ± std over seeds. Paper: "
             "baseline has the 14 rarest tokens below 1 in Ratio of Average and all 65 below 1 in "
             "Average of Ratio; thresholding raises them by 12 % and 45 %.", ""]
    lines += markdown_table(header, rows)
    if len(per_seed) >= 2:
        (name_a, a), (name_b, b) = list(per_seed.items())[:2]
        shared = sorted(set(a) & set(b))
        cells = [claims.paired_cell(stats.paired([100 * (b[s][k] / a[s][k] - 1)
                                                  for s in shared]), 1)
                 for k in ("mean_ratio_of_average", "mean_average_of_ratio")]
        lines += ["", f"{name_b} vs {name_a}, paired on seeds {', '.join(map(str, shared))} "
                  f"(relative change per seed, %): Ratio of Average {cells[0]}; Average of Ratio "
                  f"{cells[1]} (paper: +12 % and +45 %)."]
    return lines


def speed_table(g):
    """(throughput and wall time per method, the seconds time_breakdown needs)."""
    seconds = {"steps": 0.0, "single_stage_runs": 0.0, "runs": 0.0, "trained_runs": 0}
    rows = []
    for method in g.every_method():
        speeds = []
        walls = []
        for run in g.runs.get(method, {}).values():
            run_speeds = [r for r in read_log(os.path.join(run["dir"], "log.jsonl"))
                          if "tokens_per_s" in r]
            speeds += run_speeds
            path = os.path.join(run["dir"], "run.json")
            if not os.path.exists(path):
                continue
            record = read_json(path)
            walls.append(record["wall_s"])
            if "reused_from" not in record:  # a run copied from another grid took none of its time
                seconds["runs"] += record["wall_s"]
                seconds["trained_runs"] += 1
            # a chained run's log holds its last stage
            if run_speeds and len(record.get("commands", [])) == 1:
                ms = statistics.median(r["ms_per_iter"] for r in run_speeds)
                seconds["steps"] += (run_speeds[-1]["iter"] + 1) * ms / 1000
                seconds["single_stage_runs"] += record["wall_s"]
        if speeds:
            tokens_per_s, ms_per_iter, mfu = (
                torch.tensor([r[k] for r in speeds]).median().item()
                for k in ("tokens_per_s", "ms_per_iter", "mfu"))
            rows.append((method, len(g.results.get(method, {})), f"{tokens_per_s:.0f}",
                         f"{ms_per_iter:.1f}", f"{mfu:.2f}" if mfu >= 0.01 else f"{mfu:.1e}",
                         f"{sum(walls) / len(walls) / 60:.1f} min" if walls else "n/a"))
    header = ["method", "runs", "median tokens/s per run", "median ms/iter", "median MFU",
              "mean wall time per run"]
    return ["", "## Speed", ""] + markdown_table(header, rows), seconds


def peak_range(calls):
    """'measured peak of 176 GFLOP/s (float32, all cores)', or the calls' peaks per dtype."""
    peaks = {}  # a call stopped before any FLOPs used no peak
    for c in [c for c in calls if c["flops"]] or calls:
        peaks.setdefault(c["peak_dtype"], set()).add(round(c["peak_flops"] / 1e9))
    spans = {dtype: f"{min(p)}–{max(p)}" if len(p) > 1 else str(min(p))
             for dtype, p in peaks.items()}
    if len(spans) > 1:
        return ("peaks measured at each call's start (all cores; "
                + ", ".join(f"{dtype}: {span}" for dtype, span in spans.items()) + " GFLOP/s)")
    ((dtype, span),) = spans.items()
    if len(peaks[dtype]) > 1:
        return f"peaks measured at each call's start ({dtype}, all cores: {span} GFLOP/s)"
    return f"measured peak of {span} GFLOP/s ({dtype}, all cores)"


def speed_summary(grid, root, seconds, trained_on):
    """The grid's wall time over its compare.py calls, its efficiency (docs/performance.md)
    and time_breakdown. trained_on: the runs' devices, for wall.json records that name none."""
    calls = grid_calls(os.path.join(root, grid, "wall.json"))
    gpu = "cuda" in trained_on
    lines = ["", "MFU per run = model FLOPs (6N + attention) / that run's own measured fp32 2048² "
             "matmul peak on its thread(s), measured while other runs may share the machine."]
    if gpu:
        lines[-1] += (" On a GPU that utils.GPU_PEAK_BF16_FLOPS lists, the peak is instead its "
                      "datasheet's dense bf16 peak, whatever dtype the run trained in.")
    if not calls:
        return lines
    wall = sum(c["wall_s"] for c in calls)
    runs = sum(c["runs"] for c in calls)
    last = calls[-1]
    unnamed = "a CUDA GPU (device=cuda; wall.json did not yet name it)" if gpu else "cpu"
    devices = [c.get("device", unnamed) for c in calls]
    gpus = sorted({d for d in devices if d not in ("cpu", "mps")})
    lines += ["", f"Wall time: {runs} runs in {wall / 3600:.2f} h over {len(calls)} "
              f"`tools.compare {grid}` call(s), {last['workers']} runs at a time with "
              f"{last['threads_per_run']} thread(s) each, on {last['cpu']} ({last['cores']} cores)"
              + (f", training on {', '.join(gpus)}" if gpus else "") + f", torch {last['torch']}."]
    # a call killed before its first minute's record left none, while its runs' run.json did
    unrecorded = seconds["trained_runs"] - runs
    if unrecorded > 0:
        lines[-1] += (f" wall.json's call records account for {runs} of the "
                      f"{seconds['trained_runs']} runs this grid trained: the calls that trained "
                      f"the other {unrecorded} left no record, so this wall time and the figures "
                      "drawn from it cover the recorded calls only.")
    breakdown = time_breakdown(seconds, wall if unrecorded <= 0 else None, last["workers"])
    counted = [c for c, d in zip(calls, devices)
               if c.get("flops") is not None and c.get("peak_flops") and d not in gpus]
    if not counted:
        why = ("not computed, as the runs trained on a GPU and the peak each call measures "
               "is its CPU's." if gpus else "not available (these runs were made before "
               "train.py counted the FLOPs it executes).")
        return lines + ["", "Efficiency: " + why] + breakdown
    at_peak = sum(c["flops"] / c["peak_flops"] for c in counted)
    counted_wall = sum(c["wall_s"] for c in counted)
    scope = ""
    if len(counted) < len(calls):
        scope = (f" (the {len(counted)} call(s) whose runs counted their FLOPs"
                 f"{' on the CPU' if gpus else ''}: {sum(c['runs'] for c in counted)} runs, "
                 f"{counted_wall / 3600:.2f} h)")
    flops = sum(c["flops"] for c in counted)
    return lines + ["", "**Efficiency = (grid FLOPs / peak) / wall time = "
                    f"{at_peak / counted_wall:.2f}**{scope}: {flops / 1e15:.3f} PFLOP executed "
                    f"(training, evaluation and fine-tuning), which at the {peak_range(counted)} "
                    f"would take {at_peak / 60:.1f} min."] + breakdown


def time_breakdown(seconds, grid_wall, workers):
    """Where the wall time went: the share in training steps, and how much of workers × grid
    wall time the runs filled (left out where grid_wall is None: calls left no record)."""
    if not seconds["single_stage_runs"]:
        return []
    line = ("Where the time went: training steps (iterations × median ms/iter) are "
            f"{100 * seconds['steps'] / seconds['single_stage_runs']:.0f} % of the single-stage "
            "runs' wall time, the rest being evaluation, checkpoints and process start")
    if grid_wall is None:
        return ["", line + "."]
    if seconds["runs"] > workers * grid_wall:  # the records hold less time than the runs took
        return ["", line + f"; the runs' wall times add up to more than {workers} × the calls' "
                "recorded wall time: some calls left no record of their time (killed before their "
                "last minute)."]
    return ["", line + f"; the runs' wall times fill "
            f"{100 * seconds['runs'] / (workers * grid_wall):.0f} % of {workers} × the grid's wall "
            "time, the rest being the grid's tail (fewer runs left than run at a time) and the "
            "gaps between runs."]
