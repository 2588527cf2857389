"""
A grid's archived runs, as its page, its figures and
tools/preregistered.py read them. Notes: docs/grids.md.
"""

import os

from tools import claims
from tools.grids import GRIDS, runs_of
from tools.identity import read_json


class Grid:
    """A grid's methods, baseline and archived runs (results: {method:
    {seed: metrics}}; runs: {method: {seed: {"dir", "metrics"}}}); a char
    grid has HR and LR val splits, a BPE grid one."""

    def __init__(self, grid, root):
        self.name = grid
        self.root = root
        self.methods = GRIDS[grid]
        self.baseline = next(iter(self.methods))
        self.results = {}
        self.runs = {}
        for method, seed, *_, out in runs_of(grid, root):
            path = os.path.join(out, "metrics.json")
            if os.path.exists(path):
                metrics = read_json(path)
                self.results.setdefault(method, {})[seed] = metrics
                self.runs.setdefault(method, {})[seed] = {"dir": out, "metrics": metrics}
        self.low_resource = any("low" in r for per_seed in self.results.values()
                                for r in per_seed.values())
        self.langs = ("high", "low") if self.low_resource else ("val",)

    def paired_columns(self):
        """(title, language, metric) of the paired-difference table and the forest plot."""
        if self.low_resource:
            return [("LR acc", "low", "accuracy"), ("LR MRR", "low", "mrr"),
                    ("LR PPL_best", "low", "ppl_best"), ("HR acc", "high", "accuracy"),
                    ("HR PPL_best", "high", "ppl_best"), ("LR I(W)", "low", "isotropy")]
        columns = [("acc", "val", "accuracy"), ("MRR", "val", "mrr"), ("PPL", "val", "ppl"),
                   ("PPL_best", "val", "ppl_best"), ("I(W)", "val", "isotropy")]
        runs = [r for per_seed in self.results.values() for r in per_seed.values()]
        if runs and all("rare" in r for r in runs):
            columns += [("rare acc", "rare", "accuracy"), ("rare PPL", "rare", "ppl")]
            if all("ppl_at_t_best" in r["rare"] for r in runs):  # not in older runs
                columns.append(("rare PPL_best", "rare", "ppl_at_t_best"))
        return columns

    def every_method(self):
        """The tables' methods, then the grid's extra runs (grids.EXTRA_RUNS) that have results."""
        return list(self.methods) + [m for m in self.results if m not in self.methods]

    def shared_with_baseline(self, method):
        return sorted(set(self.results.get(method, {})) & set(self.results.get(self.baseline, {})))

    def paired(self, method, lang, key, kind="difference", baseline=None):
        """Metric [lang][key] of method minus that of the baseline (kind
        "relative": in %) on each seed both ran (claims.paired_values)."""
        claim = {"method": method, "baseline": baseline, "kind": kind,
                 "value": lambda run: run["metrics"][lang][key]}
        return claims.paired_values(claim, self.runs, self.baseline)
