"""
Issue 61's registered tests (results/preregistration_intervention.md, I1-I4) on the study's
archived runs (tools/intervention.py): `python -m tools.intervention_tests` writes
results/jostling_intervention.md. While a test's arms are incomplete its counts are labelled
partial and it gives no verdict.
"""

import argparse
import os

from tools import stats
from tools.grids import run_dir
from tools.identity import read_json
from tools.intervention import ARMS, CE_SEEDS, CUTOFF, GRID, SEEDS, TRUNK_STEP, step_reading
from utils import markdown_table, save_text

THRESHOLDS = (0.43, 0.40, 0.38)  # primary, then the two secondary ones


def accuracies(archive, loss, arm, seeds):
    """{seed: LR accuracy at the best checkpoint} of one arm's archived runs."""
    paths = {s: os.path.join(run_dir(archive, GRID, f"{loss} {arm}", s), "metrics.json")
             for s in seeds}
    return {s: read_json(path)["low"]["accuracy"]
            for s, path in paths.items() if os.path.exists(path)}


def readings(archive, loss, seeds):
    """{seed: twin_cos at TRUNK_STEP} of the archived trunks."""
    folders = {s: run_dir(archive, GRID, f"{loss} trunk", s) for s in seeds}
    return {s: step_reading(folder, TRUNK_STEP) for s, folder in folders.items()
            if os.path.exists(os.path.join(folder, "log.jsonl"))}


# each test: (name, the two arms, the words when it decides for the first arm, and against it)
TESTS = [
    ("I1", ("margin 0.6", "raised"), ("margin 0.6", "untouched"),
     "raising the alignment made runs cross", "raising the alignment stopped runs from crossing"),
    ("I2", ("margin 0.6", "raised"), ("margin 0.6", "sham"),
     "the direction towards the twin matters, not the size of the move",
     "moving the rows sideways made more runs cross than turning them towards their twins"),
    ("I3", ("margin 0.6", "untouched"), ("margin 0.6", "lowered"),
     "lowering the alignment stopped crossings", "lowering the alignment made runs cross"),
    ("I4", ("CE", "raised"), ("CE", "untouched"),
     "the alignment alone makes a CE run cross",
     "raising the alignment stopped CE runs from crossing"),
]


def registered_seeds(name, trunk_readings):
    """The seeds a test is registered on: I3's are the trunks read above
    the cut-off (None until all 16 trunks are in)."""
    if name == "I3":
        if set(trunk_readings) < set(SEEDS):
            return None
        return [s for s in SEEDS if trunk_readings[s] > CUTOFF]
    return CE_SEEDS if name == "I4" else SEEDS


def test_lines(archive, threshold):
    """One line per registered test at one threshold, and {name: verdict
    or None}: b counts the seeds both arms hold where only the first
    crosses, c where only the second does."""
    trunk_readings = readings(archive, "margin 0.6", SEEDS)
    lines = []
    verdicts = {}
    for name, first, second, yes, no in TESTS:
        label = f"{name}, {first[0]} {first[1]} against {second[1]}"
        registered = registered_seeds(name, trunk_readings)
        verdicts[name] = None
        if registered == []:
            lines.append(f"{label}: no trunk read above {CUTOFF} at step {TRUNK_STEP}, so "
                         "the test has no seeds.")
            continue
        seeds = registered or []
        one, two = (accuracies(archive, loss, arm, seeds) for loss, arm in (first, second))
        shared = sorted(set(one) & set(two))
        b = sum(one[s] >= threshold > two[s] for s in shared)
        c = sum(two[s] >= threshold > one[s] for s in shared)
        p = stats.exact_paired_p(b, c)
        counts = (f"{b} seed(s) where only {first[1]} crosses, {c} where only {second[1]} does, "
                  f"of {len(shared)}; exact paired p = {p:.3g}")
        if set(shared) >= set(seeds):
            verdicts[name] = (yes if b > c else no) if p < 0.05 else "not shown"
            lines.append(f"{label}: {counts}: **{verdicts[name]}**.")
        else:
            lines.append(f"{label}: {counts}: partial ({len(shared)} of {len(seeds)} seeds); "
                         "no verdict until all are in.")
    return lines, verdicts


def causal_line(verdicts):
    """The registered words for the causal claim: I1 and I2 both for the raise."""
    if verdicts["I1"] is None or verdicts["I2"] is None:
        return "The causal claim: none until I1 and I2 are complete."
    rule = "The causal claim, by the registered rule: "
    if verdicts["I1"] != TESTS[0][3]:
        return rule + "not made (I1 does not decide for the raise)."
    if verdicts["I2"] == TESTS[1][3]:
        return rule + "**the alignment causes the crossing** in this experiment."
    return (rule + "*moving the LR rows made runs cross; that the alignment, rather than the "
            "move, does so is not shown*.")


def per_seed_lines(archive):
    """The trunks' readings and every arm's LR accuracy, seed by seed."""
    arms = [(loss, arm) for loss in ARMS for arm in ARMS[loss]]
    columns = [(readings(archive, "margin 0.6", SEEDS), 4),
               (readings(archive, "CE", CE_SEEDS), 4)]
    columns += [(accuracies(archive, *arm, SEEDS), 3) for arm in arms]
    header = ["seed", "margin trunk twin_cos", "CE trunk twin_cos",
              *(f"{loss} {arm}" for loss, arm in arms)]
    rows = [[seed, *("—" if table.get(seed) is None else f"{table[seed]:.{digits}f}"
                     for table, digits in columns)]
            for seed in SEEDS]
    return markdown_table(header, rows)


def provenance_line(archive):
    """Which machines and commits the archived runs came from (their run.json provenance)."""
    cpus = set()
    commits = set()
    runs = 0
    for root, _, files in os.walk(os.path.join(archive, GRID)):
        if "run.json" in files:
            record = read_json(os.path.join(root, "run.json")).get("provenance", {})
            runs += 1
            cpus.add(record.get("cpu", "not recorded"))
            changed = " (with changes)" if record.get("dirty") else ""
            commits.add(record.get("commit", "not recorded")[:12] + changed)
    return (f"Provenance: {runs} archived runs, trained on {', '.join(sorted(cpus)) or 'none'}, "
            f"from commit(s) {', '.join(sorted(commits)) or 'none'} (each run's run.json).")


def report(archive):
    """results/jostling_intervention.md; the causal claim is made at the
    primary threshold only."""
    lines = ["# The intervention on the step-1000 twin alignment (issue 61)", "",
             "Registered in `results/preregistration_intervention.md` before the first run; "
             "computed by `python -m tools.intervention_tests` from "
             "`results/runs/jostling_intervention/`. A run crosses when its LR accuracy at the "
             "best checkpoint reaches the threshold; each test is the exact paired (McNemar) "
             "test over the seeds both arms hold.", "",
             provenance_line(archive), ""]
    for k, threshold in enumerate(THRESHOLDS):
        test, found = test_lines(archive, threshold)
        lines += [f"## LR accuracy ≥ {threshold} ({'secondary' if k else 'primary'})", ""]
        lines += [f"- {line}" for line in test] + [""]
        if k == 0:
            verdicts = found
    lines += [causal_line(verdicts), "", "## Every seed", "",
              f"twin_cos at step {TRUNK_STEP} of each trunk (the cut-off {CUTOFF}), and each "
              "arm's LR accuracy at its best checkpoint.", ""] + per_seed_lines(archive)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tools.intervention_tests",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", default="results/runs")
    parser.add_argument("--out", default="results/jostling_intervention.md")
    args = parser.parse_args()
    save_text(report(args.archive), args.out)
    print(f"wrote {args.out}")
