"""tools/preregistered.py: issue 40's registered tests (results/preregistration.md) on made-up
archives whose outcomes are known by construction, each rule's verdict word and its counts."""

import math

from tools import preregistered as pr
from tools.grids import FRESH_SEEDS


def metrics(lr_accuracy):
    return {"low": {"accuracy": lr_accuracy}}


def hypergeometric_two_sided(k1, n1, k2, n2):
    """Fisher's exact p, written out again: the tables with the same margins no likelier than the one seen."""
    k, total = k1 + k2, n1 + n2
    prob = [math.comb(n1, a) * math.comb(n2, k - a) / math.comb(total, k) for a in range(max(0, k - n2), min(k, n1) + 1)]
    seen = math.comb(n1, k1) * math.comb(n2, k2) / math.comb(total, k)
    return sum(p for p in prob if p <= seen * (1 + 1e-9))


def made_up():
    """The archive as it is (3 of 30 margin seeds cross, no CE seed); on the fresh seeds 1367 and
    1368 cross under both orders (and nothing else), their twin_cos at step 1000 is 0.2, every other
    run's 0.05 except 1369's own-order run (0.13: a false alarm); the swap: every run with a crossing
    seed's embeddings crosses, none with its blocks."""
    archive = {"margin 0.6": {s: metrics(0.49 if s in (1342, 1346, 1356) else 0.37) for s in range(1337, 1367)},
               "baseline": {s: metrics(0.31) for s in range(1337, 1367)}}
    crossing = (1367, 1368)
    fresh = {method: {s: metrics(0.49 if s in crossing and method != "baseline" else 0.37) for s in FRESH_SEEDS}
             for method in ("baseline", pr.FRESH, pr.NEXT)}
    curve = lambda s, method: ([0, 1000], [0.0, 0.2 if s in crossing and method != "baseline" else  # noqa: E731
                                         0.13 if (s, method) == (1369, pr.FRESH) else 0.05])
    curves = {method: {s: curve(s, method) for s in FRESH_SEEDS} for method in fresh}
    swap = {method: {b: metrics(0.49 if e in (1342, 1346) else 0.37) for b, e in pr.EMBEDDING_SWAPS.items()}
            for method in pr.SWAPPED}
    return archive, fresh, swap, curves


def test_each_registered_rule_on_a_made_up_archive():
    archive, fresh, swap, curves = made_up()
    text = "\n".join(pr.findings(archive, fresh, swap, curves))
    primary = text.split("### LR accuracy ≥ 0.43 (primary)")[1].split("### ")[0]
    # T1: 2 of 24 fresh; pooled 5 of 54; 0.10 inside the fresh interval [0.01, 0.27]
    assert "T1, margin 0.6 on fresh seeds: 2 of 24: 0.08 [0.01, 0.27]; pooled with the archive's 3 of 30: 5 of 54" in primary
    assert f"p = {hypergeometric_two_sided(3, 30, 2, 24):.3g}: no difference shown" in primary
    assert "**confirmed**" in primary
    # T2: both 2, neither 22: concordant beyond independence (2 x 2/24 x 2/24 = 0.17 expected)
    assert "both cross 2, only own order 0, only the next seed's 0, neither 22 (independence predicts 0.17" in primary
    assert f"p = {hypergeometric_two_sided(2, 2, 0, 22):.3g}: **crossing follows the initialisation**" in primary
    # T3: hits 2 of 2, false alarms 1 of 22
    assert "hits 2 of 2: 1.00 [0.16, 1.00], false alarms 1 of 22: 0.05 [0.00, 0.23]" in primary
    assert f"p = {hypergeometric_two_sided(2, 2, 1, 22):.3g}: **the step-1000 reading predicts" in primary
    assert "hits 4 of 4" in primary and "false alarms 1 of 44" in primary and "fresh CE runs 0 of 24" in primary
    # T4: 5 of 54 against 0 of 54, pooled; 2 of 24 against 0 of 24, fresh only
    assert f"margin 5 of 54: 0.09 [0.03, 0.20], CE 0 of 54: 0.00 [0.00, 0.07]; difference +0.09, Fisher's exact p = " \
           f"{hypergeometric_two_sided(5, 54, 0, 54):.3g}: **no difference shown**" in primary
    # T5: 4 of 4 against 0 of 4
    assert "embeddings from a crossing initialisation 4 of 4 cross, blocks from one 0 of 4" in primary
    assert "**follows the embeddings**" in primary
    # at 0.38 the same runs (0.37 stays below): the same outcomes
    assert "### LR accuracy ≥ 0.38 (secondary)" in text


def test_incomplete_grids_are_labelled_partial_and_get_no_verdict():
    archive, fresh, swap, curves = made_up()
    fresh = {method: dict(list(runs.items())[:10]) for method, runs in fresh.items()}
    swap = {pr.SWAPPED[0]: swap[pr.SWAPPED[0]]}
    text = "\n".join(pr.findings(archive, fresh, swap, curves))
    assert "(partial: 10 of 24 runs; no verdict until all are in)" in text
    assert "(partial: 4 of 8 runs; no verdict until all are in)" in text
    assert "**" not in text.split("### LR accuracy ≥ 0.43 (primary)")[1].split("### ")[0]


def test_no_crossing_under_one_order_is_not_testable():
    archive, fresh, swap, curves = made_up()
    fresh[pr.NEXT] = {s: metrics(0.37) for s in FRESH_SEEDS}
    text = "\n".join(pr.findings(archive, fresh, swap, curves))
    assert "**Not testable**: no seed crosses under one of the two orders." in text


def test_the_norm_term_outcome_follows_its_rule():
    from tools import stats
    result = lambda mean, low, high, n=5: {"n": n, "mean": mean, "low": low, "high": high}  # noqa: E731
    reproduces = (None, result(-0.12, -0.16, -0.08), 0.01, stats.REPRODUCES)
    assert pr.norm_term_outcome([reproduces, (None, result(0.0, -0.03, 0.03), 1.0, stats.NOT_SHOWN)]) == \
        "its effect is the norm term"
    # the interval reaches past +-0.04: no equivalence, no difference shown either
    assert pr.norm_term_outcome([reproduces, (None, result(0.01, -0.03, 0.05), 0.6, stats.NOT_SHOWN)]) == "not decided"
    assert pr.norm_term_outcome([reproduces, (None, result(0.10, 0.06, 0.14), 0.01, stats.CONTRADICTED)]) == \
        "not the norm term alone"
    assert pr.norm_term_outcome([reproduces, (None, result(0.0, -0.03, 0.03, n=4), 1.0, stats.NOT_SHOWN)]) is None


def test_convergence_rule_on_made_up_ce_curves(tmp_path):
    """T7: best checkpoints before step 1400, or a mean fall below 0.01 nats per 50 steps over the
    last 200 steps, count as converged; here the fall is (0.08 + 0.04) / 2 / 4 = 0.015 and the best
    checkpoints are at 1600, so not converged; flattened curves are."""
    import json
    import os

    def runs(falls, best_iter):
        out = {}
        for seed, fall in zip((1337, 1338), falls):
            d = tmp_path / str(len(os.listdir(tmp_path)))
            os.makedirs(d)
            with open(d / "log.jsonl", "w") as f:
                f.writelines(json.dumps({"iter": it, "val": 5.0 - fall * (it - 1400) / 200 if it >= 1400 else 5.2}) + "\n"
                             for it in range(0, 1650, 50))
            out[seed] = {"dir": str(d), "metrics": {"checkpoint": {"iter": best_iter}}}
        return out
    line = pr.convergence_lines(runs((0.08, 0.04), 1600), registered_seeds=2)[0]
    assert "falls 0.0150 nats per 50 steps from step 1400 to 1600" in line and "**not converged" in line
    assert "**converged by the registered rule**" in pr.convergence_lines(runs((0.02, 0.02), 1600), registered_seeds=2)[0]
    assert "**converged by the registered rule**" in pr.convergence_lines(runs((0.08, 0.08), 1350), registered_seeds=2)[0]
    assert "partial: 2 of 5 seeds" in pr.convergence_lines(runs((0.08, 0.04), 1600))[0]


def test_twin_figure_of_the_new_grids(tmp_path, monkeypatch):
    """A jostling_prereg archive with twin_cos curves gets its figure, one panel per method."""
    import json
    import os
    import pytest
    pytest.importorskip("matplotlib")
    from tools import grids, report
    monkeypatch.setitem(grids.GRIDS, "jostling_prereg", {"margin 0.6": ("config/lowres_margin_0.6.py", [1367, 1368])})
    monkeypatch.setitem(grids.EXTRA_RUNS, "jostling_prereg", {})
    for seed, acc in ((1367, 0.49), (1368, 0.37)):
        out = grids.run_dir(str(tmp_path / "runs"), "jostling_prereg", "margin 0.6", seed)
        os.makedirs(out)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(metrics(acc), f)
        with open(os.path.join(out, "log.jsonl"), "w") as f:
            f.writelines(json.dumps({"iter": it, "val": 3.0, "twin_cos": it / 4000 if acc > 0.4 else 0.01}) + "\n"
                         for it in (0, 1000, 2000))
    g = report.Grid("jostling_prereg", str(tmp_path / "runs"))
    drawn = pr.twin_figure(g, str(tmp_path / "results"))
    assert len(drawn) == 1 and os.path.getsize(drawn[0][1]) > 0
    assert drawn[0][1].endswith("figures/jostling_prereg_twin_cosine.png")
