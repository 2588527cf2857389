"""tools/intervention.py: the rotation of the LR rows against loops over its definition, and a
branch made from a real trunk's checkpoint that train.py continues."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import metrics
from tools import intervention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dot(x, y):
    return sum(a * b for a, b in zip(x, y))


def cosine(x, y):
    return dot(x, y) / math.sqrt(dot(x, x) * dot(y, y))


def angle(x, y):
    return math.acos(max(-1.0, min(1.0, cosine(x, y))))


def table(shift=6, extra=3, dim=5, seed=0):
    """2*shift + extra rows: HR, LR, then rows of neither language (a padded vocabulary)."""
    return torch.randn(2 * shift + extra, dim, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def rows(E):
    return [list(map(float, r)) for r in E]


@pytest.mark.parametrize("arm,target", [("raised", 0.6), ("lowered", -0.4)])
def test_rotation_reaches_the_target_by_one_angle_and_keeps_everything_else(arm, target):
    shift = 6
    E = table(shift)
    out, theta = intervention.rotate_twins(E, shift, arm, target)
    before, after = rows(E), rows(out)
    assert after[:shift] == before[:shift] and after[2 * shift:] == before[2 * shift:]
    mean = sum(cosine(after[i + shift], after[i]) for i in range(shift)) / shift
    assert mean == pytest.approx(target, abs=1e-9)
    for i in range(shift):
        old, new, twin = before[i + shift], after[i + shift], before[i]
        assert dot(new, new) == pytest.approx(dot(old, old), rel=1e-12)
        # each row turns by theta in the plane of itself and its twin, stopping at 0 or pi
        want = max(angle(old, twin) - theta, 0) if arm == "raised" else min(angle(old, twin) + theta, math.pi)
        assert angle(new, twin) == pytest.approx(want, abs=1e-9)
        assert angle(old, new) == pytest.approx(abs(angle(old, twin) - want), abs=1e-7)
        gram = torch.tensor([old, twin, new], dtype=torch.float64)
        assert torch.linalg.matrix_rank(gram, tol=1e-9) == 2


def test_sham_moves_each_row_as_far_as_raised_without_changing_its_twin_cosine():
    shift = 6
    E = table(shift, dim=8)
    raised, _ = intervention.rotate_twins(E, shift, "raised", 0.6)
    sham, _ = intervention.rotate_twins(E, shift, "sham", 0.6, torch.Generator().manual_seed(3))
    before, up, side = rows(E), rows(raised), rows(sham)
    assert side[:shift] == before[:shift] and side[2 * shift:] == before[2 * shift:]
    for i in range(shift):
        old = before[i + shift]
        assert dot(side[i + shift], side[i + shift]) == pytest.approx(dot(old, old), rel=1e-12)
        assert cosine(side[i + shift], before[i]) == pytest.approx(cosine(old, before[i]), abs=1e-12)
        assert angle(old, side[i + shift]) == pytest.approx(angle(old, up[i + shift]), abs=1e-6)
        assert angle(old, side[i + shift]) > 0.01


def test_a_mean_already_past_the_target_is_left_as_it_is():
    E = table()
    mean = metrics.twin_alignment(E, 6)["twin_cos"]
    for arm, target in (("raised", mean - 0.1), ("sham", mean - 0.1), ("lowered", mean + 0.1)):
        out, theta = intervention.rotate_twins(E, 6, arm, target, torch.Generator().manual_seed(0))
        assert theta == 0.0 and torch.equal(out, E)


@pytest.mark.slow
def test_a_branch_continues_the_trunks_run_with_only_the_lr_rows_changed(tmp_path, data_dir):
    """A 20-step trunk, its raised branch made by the command line and trained to 40 steps by a
    resume: the optimizer state is the trunk's, the branch's first evaluation logs the target, the
    branch refuses to be made twice."""
    trunk, branch = tmp_path / "trunk", tmp_path / "branch"
    common = [sys.executable, "train.py", "config/lowres_margin_0.6.py", f"--data_dir={data_dir}", "--seed=5",
              "--n_layer=1", "--n_embd=32", "--n_head=2", "--eval_interval=10", "--eval_iters=2",
              "--check_memory=False", "--final_eval=False", "--num_threads=1"]
    subprocess.run(common + ["--max_iters=20", f"--out_dir={trunk}"], cwd=REPO, check=True, capture_output=True)
    made = subprocess.run([sys.executable, "-m", "tools.intervention", "branch", str(trunk), str(branch),
                           "--arm=raised", "--seed=5"], cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    record = json.loads(made.stdout)
    assert record["twin_cos_after"] == pytest.approx(intervention.RAISED_COS, abs=1e-6)
    old = torch.load(trunk / "ckpt.pt", weights_only=False)
    new = torch.load(branch / "ckpt.pt", weights_only=False)
    shift = old["meta"]["vocab_size"]
    for key, value in old["model"].items():
        if key in ("wte.weight", "lm_head.weight"):
            assert torch.equal(new["model"][key][:shift], value[:shift])
            assert not torch.equal(new["model"][key][shift:2 * shift], value[shift:2 * shift])
        else:
            assert torch.equal(new["model"][key], value), key
    assert torch.equal(new["model"]["wte.weight"], new["model"]["lm_head.weight"])
    assert str(new["optimizers"]) == str(old["optimizers"])
    assert all(torch.equal(a, b) for a, b in zip(new["torch_rng"], old["torch_rng"])) \
        if isinstance(old["torch_rng"], (list, tuple)) else torch.equal(new["torch_rng"], old["torch_rng"])
    again = subprocess.run([sys.executable, "-m", "tools.intervention", "branch", str(trunk), str(branch),
                            "--arm=raised", "--seed=5"], cwd=REPO, capture_output=True, text=True)
    assert again.returncode != 0 and "already exists" in again.stderr and len(again.stderr.splitlines()) == 1
    subprocess.run(common + ["--max_iters=40", f"--out_dir={branch}", "--init_from=resume"], cwd=REPO,
                   check=True, capture_output=True)
    log = [json.loads(line) for line in open(branch / "log.jsonl")]
    at_20 = [r for r in log if r["iter"] == 20 and "twin_cos" in r]
    assert at_20 and at_20[0]["twin_cos"] == pytest.approx(intervention.RAISED_COS, abs=1e-5)
    assert max(r["iter"] for r in log) >= 39


@pytest.mark.slow
def test_an_untouched_branch_trains_as_the_run_without_a_break(tmp_path, data_dir):
    """The trunk's 20 steps, then its untouched branch to 40: the same losses as 40 steps straight
    (the optimizer, data order and RNGs continue exactly; only best.pt starts anew)."""
    common = [sys.executable, "train.py", "config/lowres_margin_0.6.py", f"--data_dir={data_dir}", "--seed=5",
              "--n_layer=1", "--n_embd=32", "--n_head=2", "--eval_interval=10", "--eval_iters=2",
              "--check_memory=False", "--final_eval=False", "--num_threads=1", "--log_interval=1"]

    def run(*args):
        subprocess.run(common + list(args), cwd=REPO, check=True, capture_output=True)
    run("--max_iters=40", f"--out_dir={tmp_path / 'straight'}")
    run("--max_iters=20", f"--out_dir={tmp_path / 'trunk'}")
    intervention.make_branch(str(tmp_path / "trunk"), str(tmp_path / "branch"), "untouched", 5)
    run("--max_iters=40", f"--out_dir={tmp_path / 'branch'}", "--init_from=resume")
    losses = [{r["iter"]: r.get("loss", r.get("val")) for r in map(json.loads, open(tmp_path / d / "log.jsonl"))}
              for d in ("straight", "branch")]
    assert losses[0] == losses[1] and len(losses[0]) >= 40


@pytest.mark.slow
def test_the_study_trains_trunks_and_branches_and_archives_them_with_provenance(tmp_path, data_dir,
                                                                              monkeypatch):
    """run_study on one seed of 40-step runs branched at step 20: every arm archived with its
    intervention and provenance, lowered only when the trunk's reading is above the cut-off, the
    call in wall.json; a second call trains nothing."""
    config = tmp_path / "tiny.py"
    config.write_text(f'include = "{REPO}/config/lowres_margin_0.6.py"\ndata_dir = "{data_dir}"\n'
                      "n_layer = 1\nn_embd = 32\nn_head = 2\neval_interval = 10\neval_iters = 2\n"
                      "max_iters = 40\ncheck_memory = False\n")
    monkeypatch.setattr(intervention, "SEEDS", [5])
    monkeypatch.setattr(intervention, "CE_SEEDS", [5])
    monkeypatch.setattr(intervention, "TRUNK_STEP", 20)
    monkeypatch.setattr(intervention, "CUTOFF", -1.0)  # every trunk is "above": the lowered arm runs
    monkeypatch.setattr(intervention, "CONFIGS", {"margin 0.6": str(config), "CE": str(config)})
    monkeypatch.chdir(REPO)
    root, archive = str(tmp_path / "root"), str(tmp_path / "archive")
    intervention.run_study(root, archive, workers=2)
    grid = os.path.join(archive, intervention.GRID)
    made = sorted(os.listdir(grid))
    assert made == sorted(["CE_raised", "CE_trunk", "CE_untouched", "margin_0.6_lowered", "margin_0.6_raised",
                           "margin_0.6_sham", "margin_0.6_trunk", "margin_0.6_untouched", "wall.json"])
    for arm in ("raised", "sham", "lowered", "untouched"):
        run = json.load(open(os.path.join(grid, f"margin_0.6_{arm}", "seed5", "run.json")))
        assert run["intervention"]["arm"] == arm and run["intervention"]["step"] == 20
        assert {"utc_start", "utc_end", "commit", "dirty", "config_sha256", "cpu", "torch"} <= set(run["provenance"])
        log = [json.loads(line) for line in open(os.path.join(grid, f"margin_0.6_{arm}", "seed5", "log.jsonl"))]
        reading = next(r["twin_cos"] for r in log if r["iter"] == 20 and "twin_cos" in r)
        before = run["intervention"]["twin_cos_before"]
        want = {"raised": max(intervention.RAISED_COS, before),
                "lowered": min(intervention.LOWERED_COS, before)}.get(arm, before)
        assert reading == pytest.approx(want, abs=1e-5)
    calls = json.load(open(os.path.join(grid, "wall.json")))["calls"]
    assert len(calls) == 1 and len(calls[0]["runs"]) == 8
    intervention.run_study(root, archive, workers=2)
    calls = json.load(open(os.path.join(grid, "wall.json")))["calls"]
    assert len(calls) == 2 and calls[1]["runs"] == []


def archived(archive, name, seed, accuracy=None, reading=None):
    from tools.grids import run_dir
    directory = run_dir(str(archive), intervention.GRID, name, seed)
    os.makedirs(directory)
    if accuracy is not None:
        with open(os.path.join(directory, "metrics.json"), "w") as f:
            json.dump({"low": {"accuracy": accuracy}}, f)
    if reading is not None:
        with open(os.path.join(directory, "log.jsonl"), "w") as f:
            f.write(json.dumps({"iter": 1000, "val": 3.0, "twin_cos": reading}) + "\n")


def test_the_registered_tests_follow_their_rules_and_wait_for_every_seed(tmp_path, monkeypatch):
    """8 seeds: raised crosses on 7, untouched and sham on none: I1 and I2 decide for the raise
    (exact p = 2 / 2^7) and the causal claim is made; one trunk reads above the cut-off, so I3 has
    one seed, and no verdict until its lowered branch is in; CE raised crosses nowhere: not shown."""
    from tools import intervention_tests as tests
    seeds = list(range(1391, 1399))
    monkeypatch.setattr(tests, "SEEDS", seeds)
    monkeypatch.setattr(tests, "CE_SEEDS", seeds[:4])
    for seed in seeds:
        archived(tmp_path, "margin 0.6 trunk", seed, reading=0.2 if seed == 1391 else 0.05)
        archived(tmp_path, "margin 0.6 untouched", seed, 0.37)
        archived(tmp_path, "margin 0.6 raised", seed, 0.37 if seed == 1398 else 0.48)
        archived(tmp_path, "margin 0.6 sham", seed, 0.37)
    for seed in seeds[:4]:
        archived(tmp_path, "CE trunk", seed, reading=0.1)
        archived(tmp_path, "CE untouched", seed, 0.31)
        archived(tmp_path, "CE raised", seed, 0.32)
    lines, verdicts = tests.test_lines(str(tmp_path), 0.43)
    assert verdicts == {"I1": "raising the alignment made runs cross",
                        "I2": "the direction towards the twin matters, not the size of the move",
                        "I3": None, "I4": "not shown"}
    assert f"exact paired p = {2 / 2 ** 7:.3g}: **raising the alignment made runs cross**." in lines[0]
    assert "I3, margin 0.6 untouched against lowered: 0 seed(s) where only untouched crosses, 0 where only " \
           "lowered does, of 0; exact paired p = 1: partial (0 of 1 seeds)" in lines[2]
    assert "**the alignment causes the crossing**" in tests.causal_line(verdicts)
    archived(tmp_path, "margin 0.6 lowered", 1391, 0.37)
    _, verdicts = tests.test_lines(str(tmp_path), 0.43)
    assert verdicts["I3"] == "not shown"
    report = tests.report(str(tmp_path))
    assert "| 1391 | 0.2000 | 0.1000 | 0.370 | 0.480 | 0.370 | 0.370 | 0.310 | 0.320 |" in report
    # at 0.50 nothing crosses: every complete test says not shown, and no causal claim
    _, low = tests.test_lines(str(tmp_path), 0.50)
    assert set(low.values()) == {"not shown"} and "not made" in tests.causal_line(low)
