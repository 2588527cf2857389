"""claims.py: paired quantities, the claims table's verdicts and Holm p-values on hand-made runs."""

import json
import math
import os

import numpy as np
import pytest
import torch

import metrics  # noqa: E402
from tools import claims, stats  # noqa: E402


def run(acc, ppl, directory=""):
    return {"dir": directory, "metrics": {"high": {"accuracy": acc, "ppl": ppl}}}


def test_steps_to_reach_interpolates_between_evaluations():
    curve = [(0, 4.0), (100, 3.0), (200, 2.0), (300, 1.9)]
    assert claims.steps_to_reach(curve, 2.5) == pytest.approx(150.0)      # halfway from 3.0 to 2.0
    assert claims.steps_to_reach(curve, 2.0) == pytest.approx(200.0)      # exactly at an evaluation
    assert claims.steps_to_reach(curve, 1.0) is None                      # never
    assert claims.steps_to_reach([(0, 4.0), (100, 3.0), (200, 3.5), (300, 2.9)], 3.0) == pytest.approx(100.0)


def test_speed_up_against_the_baselines_final_loss(tmp_path):
    def write(name, curve):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "log.jsonl", "w") as f:
            f.writelines(json.dumps({"iter": i, "val": v}) + "\n" for i, v in curve)
        return str(tmp_path / name)
    base = write("base", [(0, 5.0), (400, 3.0), (800, 2.0)])               # final 2.0 at its 800 steps
    fast = write("fast", [(0, 5.0), (400, 2.5), (800, 1.5)])               # 2.0 at 400 + 0.5/1.0*400 = 600
    slow = write("slow", [(0, 5.0), (400, 4.0), (800, 2.5)])
    assert claims.speed_up(fast, base) == pytest.approx(1 - 600 / 800)
    assert claims.speed_up(slow, base) == 0.0
    assert claims.speed_up(base, base) == 0.0


def test_claims_table_verdicts_follow_the_rule(monkeypatch):
    """Three claims on 4 seeds: a clear gain, noise, and a clear effect against the paper's
    direction; the Holm p-values of the table are the hand-computed paired t p-values x 3, 2, 1."""
    seeds = [1, 2, 3, 4]
    base_acc, base_ppl = [0.30, 0.32, 0.31, 0.29], [5.0, 5.2, 5.1, 4.9]
    runs = {"base": {s: run(a, p) for s, a, p in zip(seeds, base_acc, base_ppl)},
            "good": {s: run(a + d, p) for s, a, p, d in zip(seeds, base_acc, base_ppl, [0.05, 0.06, 0.055, 0.05])},
            "noisy": {s: run(a + d, p) for s, a, p, d in zip(seeds, base_acc, base_ppl, [0.02, -0.03, 0.01, -0.01])},
            "worse": {s: run(a, p + d) for s, a, p, d in zip(seeds, base_acc, base_ppl, [0.5, 0.6, 0.55, 0.5])}}
    accuracy, ppl = claims._metric("high", "accuracy"), claims._metric("high", "ppl")
    monkeypatch.setitem(claims.CLAIMS, "toy", [
        claims.claim("P", "good", "acc", accuracy, +1, ".30 → .35", 0.05),
        claims.claim("P", "noisy", "acc", accuracy, +1, ".30 → .35", 0.05),
        claims.claim("P", "worse", "ppl", ppl, -1, "5.0 → 4.5", -0.5, digits=2)])
    evaluated = claims.evaluate_claims("toy", runs, "base")
    assert [v for *_, v in evaluated] == [stats.REPRODUCES, stats.NOT_SHOWN, stats.CONTRADICTED]
    # good: d = .05 .06 .055 .05 -> mean .05375, sd .004787, t = .05375 / (.004787 / 2) = 22.46, 3 df
    good, noisy, worse = (r for _, r, _, _ in evaluated)
    assert good["mean"] == pytest.approx(0.05375) and good["sd"] == pytest.approx(0.0047871, rel=1e-4)
    assert good["p"] == pytest.approx(2 * (1 - stats.t_cdf(0.05375 / (0.0047871 / 2), 3)), rel=1e-3)
    ps = [good["p"], noisy["p"], worse["p"]]
    order = sorted(range(3), key=lambda i: ps[i])
    expected = [None] * 3
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * ps[i]))
        expected[i] = running
    assert [p for _, _, p, _ in evaluated] == pytest.approx(expected)
    table = "\n".join(claims.claims_table("toy", runs, "base"))
    assert "Verdict rule" in table and "1 reproduce, 1 not shown, 1 contradicted, of 3 claims." in table
    assert "| P | good | base | acc ↑ | .30 → .35 | +0.054 [+0.046, +0.061], 4/4 up |" in table
    assert [l for l in table.splitlines() if "| good |" in l][0].endswith("| reproduces | yes |")  # 0.05 in the CI
    assert "ours larger" in [l for l in table.splitlines() if "| worse |" in l][0]  # +0.54 against the paper's -0.5


def test_released_form_claims_pair_with_the_paper_form_and_are_their_own_family():
    """FORM_CLAIMS (lowres): "dispersion, authors' form" against CE and against "dispersion" on the
    same seeds; a variant without runs yet is "no runs" / not shown; the family's Holm adjustment
    counts only its own claims, and the papers' claims get the same verdicts with or without the
    authors' form runs."""
    seeds = [1, 2, 3, 4]
    ce, paper_form = [5.0, 5.2, 5.1, 4.9], [4.8, 5.1, 4.9, 4.8]
    released = [4.9, 5.1, 5.0, 4.9]  # between the two on every seed
    runs = {"CE": {s: run(0.3, p) for s, p in zip(seeds, ce)},
            "dispersion": {s: run(0.3, p) for s, p in zip(seeds, paper_form)},
            "dispersion, authors' form": {s: run(0.3, p) for s, p in zip(seeds, released)}}
    for per_seed in runs.values():  # the papers' dispersion claims also read the condensation
        for r in per_seed.values():
            r["metrics"]["geometry"] = {"high": {"mu": [0.5]}}
    evaluated = claims.evaluate_claims("lowres", runs, "CE", claims.FORM_CLAIMS)
    assert [(c["method"], c["baseline"] or "CE") for c, *_ in evaluated] == [
        (f"dispersion{v}, authors' form", base) for v in ("", " l2_repel", " orthogonalization")
        for base in ("CE", f"dispersion{v}")]
    against_ce, against_paper = evaluated[0][1], evaluated[1][1]
    assert against_ce["mean"] == pytest.approx(sum(r - c for r, c in zip(released, ce)) / 4)
    assert against_paper["mean"] == pytest.approx(sum(r - p for r, p in zip(released, paper_form)) / 4)
    ps = sorted([against_ce["p"], against_paper["p"]])
    assert sorted(p for _, _, p, _ in evaluated[:2]) == pytest.approx([2 * ps[0], max(2 * ps[0], ps[1])])
    assert all(r is None and p is None and v == claims.NO_RUNS for _, r, p, v in evaluated[2:])
    table = "\n".join(claims.claims_table("lowres", runs, "CE", claims.FORM_CLAIMS, with_rule=False))
    assert "Verdict rule" not in table and table.count("| no runs | — | no runs | — |") == 4
    # the untested rows are neither "not shown" nor counted among the claims
    assert table.endswith(" of 2 claims. 4 of the table's 6 rows have no runs in this archive: they are "
                          "neither counted nor judged.")
    assert "| Dispersion | dispersion, authors' form | dispersion | HR PPL, against the paper's form ↓ |" in table
    papers = claims.evaluate_claims("lowres", runs, "CE")
    without = claims.evaluate_claims("lowres", {k: v for k, v in runs.items() if "authors" not in k}, "CE")
    assert [(p, v) for *_, p, v in papers] == [(p, v) for *_, p, v in without]
    assert any(p is not None for *_, p, _ in papers)  # the paper-form dispersion claims were evaluated


def test_relative_claims_are_per_seed_percentages():
    c = claims.claim("P", "m", "ratio", lambda r: r["metrics"]["x"], +1, "+10 %", 10.0, kind="relative")
    runs = {"b": {1: {"metrics": {"x": 2.0}}, 2: {"metrics": {"x": 4.0}}},
            "m": {1: {"metrics": {"x": 2.2}}, 2: {"metrics": {"x": 5.0}}, 3: {"metrics": {"x": 9.0}}}}
    assert claims.paired_values(c, runs, "b") == pytest.approx([10.0, 25.0])   # seed 3 has no baseline


def test_isotropy_authors_of_reads_the_archived_embedding(tmp_path):
    g = torch.Generator().manual_seed(0)
    wte = torch.randn(130, 8, generator=g) * 0.3 + 0.1
    np.savez(tmp_path / "embedding.npz", wte=wte.numpy(), itos=np.array(list("abcdefghijklm" * 5)))
    r = {"dir": str(tmp_path)}
    assert claims.isotropy_authors_of("high")(r) == pytest.approx(metrics.isotropy_authors(wte[:65]))
    assert claims.isotropy_authors_of("low")(r) == pytest.approx(metrics.isotropy_authors(wte[65:]))
    assert math.isfinite(claims.isotropy_authors_of("low")(r))


def test_a_check_is_judged_but_named_a_check_and_a_description_is_not_judged(monkeypatch):
    """A check (a loss lowered what it penalises) gets a verdict worded as a check and stays in the
    Holm family; a description gets no p and no verdict, and the claims' p-values are adjusted as
    if it were not there."""
    seeds = [1, 2, 3, 4]
    base_acc = [0.30, 0.32, 0.31, 0.29]
    runs = {"base": {s: run(a, 5.0) for s, a in zip(seeds, base_acc)},
            "good": {s: run(a + d, 5.0 + e) for s, a, d, e in zip(seeds, base_acc, [0.05, 0.06, 0.055, 0.05],
                                                                  [0.5, 0.7, 0.4, 0.6])}}
    accuracy, ppl = claims._metric("high", "accuracy"), claims._metric("high", "ppl")
    monkeypatch.setitem(claims.CLAIMS, "toy", [claims.claim("P", "good", "acc", accuracy, +1, "up"),
                                               claims.claim("P", "good", "ppl", ppl, -1, "down", role="check"),
                                               claims.claim("P", "good", "acc", accuracy, +1, "up", role="description")])
    (_, acc, p_acc, v_acc), (_, check, _, v_check), (_, _, p_desc, v_desc) = claims.evaluate_claims("toy", runs, "base")
    assert (v_acc, v_check, v_desc) == (stats.REPRODUCES, "check failed", claims.DESCRIPTION) and p_desc is None
    assert p_acc == pytest.approx(stats.holm([acc["p"], check["p"]])[0])  # the claim and the check, not the description
    assert p_acc != pytest.approx(stats.holm([acc["p"], check["p"], check["p"]])[0])
    table = "\n".join(claims.claims_table("toy", runs, "base"))
    assert "1 reproduce, 0 not shown, 0 contradicted, of 1 claims. Beside them: check failed: 1, description: 1." in table


def test_the_papers_claims_are_stated_as_the_papers_state_them():
    """CWT's validation PPL is a description (the headless paper reports it higher after fine-tuning
    and claims LAMBADA); the BPE grid judges margin 0.6 + SE at PPL_best, the claim's temperature
    rule, its rare-target PPL at T = 1 only described; dispersion's μ is a check."""
    def role(grid, method, quantity):
        (c,) = [c for c in claims.CLAIMS[grid] if c["method"] == method and c["quantity"] == quantity]
        return c["role"]
    for grid, ppl in (("lowres", "HR PPL"), ("bpe", "PPL (%)")):
        assert role(grid, "CWT + FT", ppl) == "description"
    assert role("bpe", "margin 0.6 + SE", "PPL_best (%)") == "claim"
    assert role("bpe", "margin 0.6 + SE", "rare-target PPL at T = 1 (%)") == "description"
    assert role("lowres", "dispersion", "HR μ(last block), condensation") == "check"
    assert role("bpe", "dispersion", "μ(last block), condensation") == "check"
