"""
The papers' claims, each tested on our grids by one stated rule (RULE,
stats.verdict): a method against its baseline on the same seeds, one
quantity, the paper's direction and number. The rule, and what stands in
for what the toy cannot measure: docs/statistics.md.
"""

import collections
import functools
import operator
import os

import numpy as np
import torch

import metrics
from tools import stats
from tools.identity import read_json
from utils import markdown_table, read_log


def _metric(*path):
    """A quantity read from a run's metrics.json, e.g. _metric("low", "accuracy")."""
    return lambda run: functools.reduce(operator.getitem, path, run["metrics"])


def isotropy_authors_of(lang, of=metrics.isotropy_authors):
    """The paper's I(W) (or `of`) of one language's rows of a tied-weight
    char run's archived embedding.npz."""
    def value(run):
        with np.load(os.path.join(run["dir"], "embedding.npz")) as data:
            W = torch.from_numpy(data["wte"])
            shift = len(data["itos"])
        return of(W[:shift] if lang == "high" else W[shift:2 * shift])
    return value


def _marginalization(key):
    return lambda run: read_json(os.path.join(run["dir"], "marginalization.json"))[key]


def val_curve(run_dir, key="val"):
    """[(step, value)] of key in a run's log.jsonl; by default its val loss
    (the mixed HR/LR loss on the char grids)."""
    log = read_log(os.path.join(run_dir, "log.jsonl"))
    return [(r["iter"], r[key]) for r in log if key in r]


def steps_to_reach(curve, target):
    """The first step at which a val curve reaches target, interpolated
    between evaluations; None if it never does."""
    for (step0, v0), (step1, v1) in zip(curve, curve[1:]):
        if v1 <= target:
            return step0 + (v0 - target) / (v0 - v1) * (step1 - step0) if v0 > target else step0
    return None


def speed_up(method_dir, baseline_dir):
    """SimReg's speed-up on one seed (docs/statistics.md)."""
    return speed_up_of_curves(val_curve(method_dir), val_curve(baseline_dir))


def speed_up_of_curves(curve, baseline_curve):
    """1 - (the steps curve needs to reach baseline_curve's final loss) /
    (the baseline's steps); 0 if it never does."""
    steps = steps_to_reach(curve, baseline_curve[-1][1])
    return 0.0 if steps is None else 1.0 - steps / baseline_curve[-1][0]


def claim(paper, method, quantity, value, direction, paper_says, paper_effect=None,
          baseline=None, kind="difference", digits=3, role="claim"):
    """A claim: these arguments as a dict. value(run): the quantity;
    direction: +1 or -1, as the paper reports it; paper_effect: the
    paper's own difference, where it ran this same toy; baseline: None for
    the grid's. kind: "difference" (method - baseline), "relative"
    (method / baseline - 1, in %) or "speed-up". role: "claim", "check"
    or "description" (docs/statistics.md)."""
    return dict(locals())


DESCRIPTION = "description, not a claim"
NO_RUNS = "no runs"  # the method or its baseline has no archived runs
CHECK_WORDS = {stats.REPRODUCES: "check passed", stats.NOT_SHOWN: "check not shown",
               stats.CONTRADICTED: "check failed"}


SJ = "Stop Jostling"
SR = "SimReg"
DI = "Dispersion"
LR_ACCURACY = _metric("low", "accuracy")
HR_PPL = _metric("high", "ppl")
# Stop Jostling's quantities (name, value, direction, its baseline's, digits) and its runs':
# a toy identical to ours, so its effect is on our scale
_SJ_QUANTITIES = (("LR PPL_best", _metric("low", "ppl_best"), -1, 10.63, 2),
                  ("LR accuracy", LR_ACCURACY, +1, .315, 3),
                  ("LR I(W), authors' way", isotropy_authors_of("low"), +1, .417, 3))
_SJ_RUNS = {"margin 2": (9.62, .358, .642), "margin 1": (9.54, .371, .765),
            "margin 0.6 + SE": (6.17, .487, .762)}


def _jostling_claims():
    return [
        *(claim(SJ, method, name, value, direction, f"{base} → {ours}", ours - base,
                digits=digits)
          for method, runs in _SJ_RUNS.items()
          for (name, value, direction, base, digits), ours in zip(_SJ_QUANTITIES, runs)),
        claim(SJ, "margin 2", "LR Ratio of Average (%)",
              _marginalization("mean_ratio_of_average"), +1, "+12 % (margin not stated)", 12.0,
              kind="relative", digits=1),
        claim(SJ, "margin 2", "LR Average of Ratio (%)",
              _marginalization("mean_average_of_ratio"), +1, "+45 % (margin not stated)", 45.0,
              kind="relative", digits=1),
        claim(SJ, "margin 0.6 + SE", "12 cases (A/a, HR/LR) in top-3",
              _metric("translations", "cases_12"), +1, "0 → 10 of 12", 10.0, digits=1),
        claim(SJ, "margin 0.6 + SE", "LR accuracy, SE's own effect", LR_ACCURACY, +1,
              "SE is needed for .487", None, baseline="margin 0.6"),
        claim(SJ, "margin 0.6 + SE, rows not decayed", "LR accuracy, rows not decayed",
              LR_ACCURACY, +1, "none: the released SE decays its rows", None,
              baseline="margin 0.6 + SE")]


# the dispersion paper's GPT-2 results (its Table 3), per variant
_DISPERSION_SAYS = {"dispersion": "10-task avg 34.95 → 35.61 (GPT-2)",
                    "dispersion decorrelation": "10-task avg +1.06 (GPT-2)",
                    "dispersion l2_repel": "10-task avg gains in some settings (GPT-2)",
                    "dispersion orthogonalization": "10-task avg +1.07 (GPT-2)"}


def _lm_claims(lang):
    """The claims of SimReg, dispersion, NITP and CWT on a grid whose main language is `lang`
    ("high" or "val"): the toy's PPL stands in for their papers' "a better LM"."""
    hr = "HR " if lang == "high" else ""
    # differences in PPL on a char grid, relative changes (%) on BPE (docs/statistics.md)
    scale = dict(kind="difference", digits=2) if hr else dict(kind="relative", digits=1)

    def ppl(paper, method, says, **role):
        name = "HR PPL" if hr else "PPL (%)"
        return claim(paper, method, name, _metric(lang, "ppl"), -1, says, **scale, **role)
    return [
        ppl(SR, "SimReg", "350M: PPL 15.06 → 14.25"),
        claim(SR, "SimReg", "steps saved to reach CE's final val loss (%)", None, +1,
              "≈ 33 % (1.3B), > 37 % (3B, 7B)", kind="speed-up", digits=1),
        ppl(SR, "SimReg chunk 32", "chunk-wise keeps SimReg's gain"),
        ppl(DI, "dispersion", _DISPERSION_SAYS["dispersion"]),
        claim(DI, "dispersion", hr + "μ(last block), condensation",
              _metric("geometry", lang, "mu", -1), -1,
              "less condensed (Fig. 2); the loss penalises this", role="check"),
        *(ppl(DI, f"dispersion {variant}", _DISPERSION_SAYS[f"dispersion {variant}"])
          for variant in ("decorrelation", "l2_repel", "orthogonalization")),
        ppl("NITP", "NITP", "MMLU-Pro +5.7 % (9B MoE)"),
        claim("CWT", "CWT + FT", hr + "accuracy", _metric(lang, "accuracy"), +1,
              "after fine-tuning, LAMBADA acc 19.52 → 22.2 (Table 3)"),
        ppl("CWT", "CWT + FT", "validation PPL 3.143 → 3.283, higher (Table 3); LAMBADA PPL "
            "170.23 → 153.5", role="description")]


# margin 0.6 + SE's rare targets at T = 1, described beside the PPL_best claim (bpe, bpe_rare)
_RARE_AT_T1 = claim(SJ, "margin 0.6 + SE", "rare-target PPL at T = 1 (%)",
                    _metric("rare", "ppl"), -1,
                    "the claim is at T_best: at T = 1 calibration dominates", kind="relative",
                    digits=1, role="description")


CLAIMS = {
    "jostling": _jostling_claims(),
    "lowres": [claim(SJ, "margin 0.6 + SE", "LR accuracy", LR_ACCURACY, +1, ".315 → .487",
                     .487 - .315),
               claim(SJ, "margin 0.6 + SE", "LR PPL_best", _metric("low", "ppl_best"), -1,
                     "10.63 → 6.17", 6.17 - 10.63, digits=2)] + _lm_claims("high"),
    "bpe": [claim(SJ, "margin 0.6 + SE", "rare-target MRR", _metric("rare", "mrr"), +1,
                  "char toy: LR MRR .480 → .628"),
            claim(SJ, "margin 0.6 + SE", "PPL_best (%)", _metric("val", "ppl_best"), -1,
                  "char toy: LR PPL_best 10.63 → 6.17 (rare-target PPL_best: the bpe_rare grid)",
                  kind="relative", digits=1),
            _RARE_AT_T1] + _lm_claims("val"),
    # the rare targets at the claim's own temperature rule (PPL_best): reruns of two bpe methods
    "bpe_rare": [claim(SJ, "margin 0.6 + SE", "rare-target PPL_best (%)",
                       _metric("rare", "ppl_at_t_best"), -1, "char toy: LR PPL_best 10.63 → 6.17",
                       kind="relative", digits=1),
                 _RARE_AT_T1],
    # the SimReg claims again at 1600 steps (results/preregistration.md, T7): a family of their own
    "bpe_1600": [c for c in _lm_claims("val") if c["paper"] == SR],
}


def _hr_ppl_twice(method, says, versus, versus_name, versus_says):
    """method's HR PPL claims against CE and against the method versus."""
    return [claim(DI, method, "HR PPL", HR_PPL, -1, says, digits=2),
            claim(DI, method, f"HR PPL, against {versus_name}", HR_PPL, -1, versus_says,
                  baseline=versus, digits=2)]


# Not the papers' claims: dispersion as its authors' released code computes it
# (docs/fidelity.md), against CE and against the paper's form, Holm-adjusted on their own.
FORM_CLAIMS = {"lowres": [
    c for method in ("dispersion", "dispersion l2_repel", "dispersion orthogonalization")
    for c in _hr_ppl_twice(f"{method}, authors' form", _DISPERSION_SAYS[method], method,
                           "the paper's form",
                           "form not stated (↓: the released form does better)")]}

# Issue 40's ablation (results/preregistration.md, T6): the released l2_repel's norm term
# alone, against CE and against the released l2_repel, Holm-adjusted on their own.
NORM_METHOD = "dispersion l2_repel norm term alone, authors' form"
NORM_CLAIMS = {"lowres": _hr_ppl_twice(
    NORM_METHOD, "none: an ablation (↓: the norm term alone helps)",
    "dispersion l2_repel, authors' form", "the released l2_repel",
    "none (within ±0.04: the norm term is the released l2_repel's effect)")}


def paired_values(c, runs, baseline):
    """The per-seed paired quantities of claim c. runs: {method: {seed: {"dir", "metrics"}}};
    baseline: the grid's baseline method (unless the claim names one)."""
    method_runs = runs.get(c["method"], {})
    base_runs = runs.get(c["baseline"] or baseline, {})
    pairs = [(method_runs[s], base_runs[s]) for s in sorted(set(method_runs) & set(base_runs))]
    if c["kind"] == "speed-up":
        return [100 * speed_up(m["dir"], b["dir"]) for m, b in pairs]
    if c["kind"] == "relative":
        return [100 * (c["value"](m) / c["value"](b) - 1) for m, b in pairs]
    return [c["value"](m) - c["value"](b) for m, b in pairs]


def paired_cell(result, digits, direction=None):
    """'+0.012 [-0.003, +0.027], 4/5 up' for a stats.paired result: k/n counts the seeds that
    go the paper's way when a direction is given, else the way of the mean."""
    mean = f"{result['mean']:+.{digits}f}"
    if result["low"] is None:
        return f"{mean} (1 seed)"
    up = result["mean"] >= 0 if direction is None else direction > 0
    k = result["up"] if up else result["down"]
    return (f"{mean} [{result['low']:+.{digits}f}, {result['high']:+.{digits}f}], "
            f"{k}/{result['n']} {'up' if up else 'down'}")


RULE = ("Verdict rule, the same for every row: for each claim the seeds shared by the method and "
        "its baseline give paired differences (method − baseline on the same seed; for the "
        "speed-up, the method's own per-seed value). A two-sided paired t-test gives each claim a "
        "p-value, and the p-values of all claims and checks in this table are Holm-adjusted "
        "together, so the chance of any false verdict in the table stays below 5 %. "
        "**reproduces**: adjusted p < 0.05 and the mean goes the paper's way; **contradicted**: "
        "adjusted p < 0.05 and it goes the other way; **not shown**: otherwise. A *check* (the "
        "loss lowered what it penalises) is judged the same way and says check passed / failed / "
        "not shown; a *description* is not judged. The interval is the unadjusted 95 % t "
        "interval (n − 1 degrees of freedom); k/n counts the seeds that go the paper's way. "
        "\"Paper's effect in CI\" compares the paper's own difference with our interval, only "
        "where the paper ran this same toy experiment.")


def evaluate_claims(grid, runs, baseline, family=None):
    """[(claim, stats.paired result, Holm-adjusted p, verdict)] for the grid's claims in
    family (CLAIMS unless given); None and NO_RUNS where the method or baseline has no runs."""
    rows = []
    for c in (CLAIMS if family is None else family).get(grid, []):
        values = paired_values(c, runs, baseline)
        rows.append((c, stats.paired(values) if values else None))
    adjusted = stats.holm([r["p"] if r and c["role"] != "description" else None for c, r in rows])
    out = []
    for (c, r), p in zip(rows, adjusted):
        verdict = NO_RUNS if r is None else stats.verdict(r["mean"], p, c["direction"])
        if r is not None and c["role"] != "claim":
            verdict = DESCRIPTION if c["role"] == "description" else CHECK_WORDS[verdict]
        out.append((c, r, p, verdict))
    return out


def claims_table(grid, runs, baseline, family=None, with_rule=True):
    """Markdown lines: the rule (unless with_rule is False), then one row per claim of family."""
    evaluated = evaluate_claims(grid, runs, baseline, family)
    if not evaluated:
        return []
    rows = []
    for c, r, p, v in evaluated:
        arrow = "↑" if c["direction"] > 0 else "↓"
        ours = paired_cell(r, c["digits"], c["direction"]) if r else NO_RUNS
        holm_p = "—" if p is None else (f"{p:.3f}" if p >= 0.001 else f"{p:.0e}")
        within = "—"
        if c["paper_effect"] is not None and r and r["low"] is not None:
            within = ("yes" if r["low"] <= c["paper_effect"] <= r["high"] else
                      "ours smaller" if abs(r["mean"]) < abs(c["paper_effect"]) else "ours larger")
        rows.append((c["paper"], c["method"], c["baseline"] or baseline,
                     f"{c['quantity']} {arrow}", c["paper_says"], ours, holm_p, v, within))
    counts = collections.Counter(v for *_, v in evaluated)
    judged = sum(c["role"] == "claim" and v != NO_RUNS for c, *_, v in evaluated)
    summary = (f"{counts[stats.REPRODUCES]} reproduce, {counts[stats.NOT_SHOWN]} not shown, "
               f"{counts[stats.CONTRADICTED]} contradicted, of {judged} claims.")
    others = [f"{w.split(',')[0]}: {counts[w]}" for w in (*CHECK_WORDS.values(), DESCRIPTION)
              if counts[w]]
    if others:
        summary += (f" Beside them: {', '.join(others)}. A check tests only that a loss "
                    "lowered the quantity it penalises; a description is measured beside a "
                    "claim the paper makes about something else, and is not tested (it stays "
                    "out of the Holm adjustment).")
    if counts[NO_RUNS]:
        summary += (f" {counts[NO_RUNS]} of the table's {len(evaluated)} rows have no runs in "
                    "this archive: they are neither counted nor judged.")
    header = ("paper", "method", "vs", "quantity", "paper's claim", "ours: mean [95 % CI], k/n",
              "Holm p", "verdict", "paper's effect in CI")
    return ([RULE, ""] if with_rule else []) + markdown_table(header, rows) + ["", summary]
