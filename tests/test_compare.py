"""tools/compare.py and its parts (grids, runner, report): the results table from known metrics files,
resumability, run reuse, the grids' commands."""

import contextlib
import json
import os
import shutil
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configurator import train_defaults  # noqa: E402
from errors import UsageError  # noqa: E402
from tools import grid_figures, grids, report, runner  # noqa: E402


def fake_metrics(acc_lr, ppl_hr):
    lang = {"ppl": ppl_hr, "ppl_best": ppl_hr - 0.5, "t_best": 0.9, "accuracy": 0.5, "recall_at_5": 0.8,
            "mrr": 0.6, "isotropy": 0.9}
    return {"high": lang, "low": {**lang, "accuracy": acc_lr}, "isotropy_all": 0.7,
            "translations": {"twin_top3_fraction": 0.1, "cases_12": 2, "cases_letters": 30, "cases_letters_total": 312}}


def tiny_dataset(tmp_path):
    """A two-line character dataset in tmp_path/data, prepared as tiny Shakespeare is."""
    import prepare_shakespeare
    text = "\n".join("And the king shall jest, Away!" if i % 2 else "QUEEN: so my lord? Ho, mercy." for i in range(400))
    (tmp_path / "input.txt").write_text(text)
    prepare_shakespeare.prepare(input_path=str(tmp_path / "input.txt"), out_dir=str(tmp_path / "data"))


def processes_naming(path):
    """The pids of the running processes whose command line contains path."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if path.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.fixture
def tiny_grid(tmp_path, monkeypatch):
    monkeypatch.setitem(grids.POOLABLE, "tiny", "test runs that record no code or machine")
    monkeypatch.setitem(grids.GRIDS, "tiny", {"ce": ("config/lowres_baseline.py", 2),
                                                "SimReg": ("config/lowres_simreg.py", 2)})
    values = {("ce", 1337): (0.30, 5.0), ("ce", 1338): (0.40, 7.0), ("SimReg", 1337): (0.35, 6.0),
              ("SimReg", 1338): (0.47, 8.0)}
    for (method, seed), (acc, ppl) in values.items():
        out = grids.run_dir(str(tmp_path), "tiny", method, seed)
        os.makedirs(out)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(fake_metrics(acc, ppl), f)
        curve = [3.0, 2.0, 1.5] if method == "ce" else [3.0, 1.4 + seed - 1337, 1.2 + seed - 1337]
        with open(os.path.join(out, "log.jsonl"), "w") as f:
            f.write(json.dumps({"iter": 0, "loss": 1.0, "tokens_per_s": 1000.0, "ms_per_iter": 10.0, "mfu": 0.5}) + "\n")
            f.writelines(json.dumps({"iter": 250 * k, "val": v}) + "\n" for k, v in enumerate(curve))
    return str(tmp_path)


def test_table_has_mean_std_and_paired_differences(tiny_grid):
    table, results = report.build_table("tiny", tiny_grid)
    assert set(results) == {"ce", "SimReg"}
    # HR ppl of ce: mean 6.00, sample std sqrt(2) = 1.41
    assert "| ce | 2 | 6.00 ± 1.41 |" in table
    # paired LR accuracy differences SimReg - ce: 0.05 and 0.07 -> mean 0.060, sd 0.01414, se 0.01,
    # t(0.975, 1 df) = 12.706 -> 0.060 -+ 0.127
    assert "| SimReg | 2 | +0.060 [-0.067, +0.187], 2/2 up |" in table
    # paired HR PPL_best (two decimals at PPL ~6): +1.0 on both seeds, no spread
    assert "| +1.00 [+1.00, +1.00], 2/2 up |" in table
    assert "| ce | 2 | 1000 | 10.0 | 0.50 |" in table
    # ce's final val 1.5 (step 500, its total). SimReg seed 1337: 3.0 at 0, 1.4 at 250 -> crosses 1.5 at
    # 250 * 1.5 / 1.6 = 234.375, speed-up 53.125 %; seed 1338 never reaches it -> 0. ce itself: 0 on both.
    # mean 26.5625, sd 37.565, half-width 12.7062 * 26.5625 = 337.51
    assert "| SimReg | 1 of 2 | +26.6 [-310.9, +364.1], 1/2 up |" in table
    assert "| ce | 2 of 2 | +0.0 [+0.0, +0.0], 0/2 up |" in table


def test_existing_runs_are_skipped_and_archived(tiny_grid, tmp_path):
    archive = str(tmp_path / "archive")
    assert runner.run_grid("tiny", tiny_grid, workers=2, overrides=[], archive=archive) >= 0  # nothing to run
    assert not os.path.exists(os.path.join(archive, "tiny", "wall.json"))
    assert os.path.exists(grids.run_dir(archive, "tiny", "SimReg", 1338) + "/metrics.json")


@pytest.mark.slow
def test_grid_runs_a_chain_and_a_second_call_does_no_work(tmp_path, monkeypatch):
    tiny_dataset(tmp_path)
    monkeypatch.setitem(grids.GRIDS, "mini", {"CE": ("config/lowres_baseline.py", 1),
                                                "CWT + FT": (("config/lowres_cwt.py", "config/lowres_cwt_ft.py"), 1)})
    monkeypatch.chdir(REPO)
    overrides = [f"--data_dir={tmp_path / 'data'}", "--max_iters=4", "--eval_interval=2", "--eval_iters=1",
                 "--warmup_iters=1", "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16"]
    root, archive = str(tmp_path / "runs"), str(tmp_path / "archive")
    runner.run_grid("mini", root, workers=2, overrides=overrides, archive=archive)
    chained = grids.run_dir(root, "mini", "CWT + FT", 1337)
    with open(os.path.join(chained, "run.json")) as f:
        commands = json.load(f)["commands"]
    assert commands[0][2] == "config/lowres_cwt.py" and commands[1][-1] == f"--init_from={chained}/stage0/best.pt"
    with open(os.path.join(chained, "run.json")) as f:  # each stage's training keys, the code and the machine
        recorded = json.load(f)["identity"]
    assert [stage["max_iters"] for stage in recorded["training"]] == [4, 4] and recorded["cpu"] and recorded["commit"]
    assert recorded["training"][0]["cwt_weight"] > 0 and "out_dir" not in recorded["training"][1]
    assert os.path.exists(os.path.join(chained, "stage0", "metrics.json"))
    with open(os.path.join(archive, "mini", "wall.json")) as f:
        (call,) = json.load(f)["calls"]
    # the grid's FLOPs: what train.py counted in each run, a chain's stages summed
    stage_flops = []
    for stage in (os.path.join(chained, "stage0"), chained):
        with open(os.path.join(stage, "metrics.json")) as f:
            stage_flops.append(json.load(f)["flops"]["total"])
    with open(os.path.join(chained, "run.json")) as f:
        assert json.load(f)["flops"] == sum(stage_flops) > 0
    with open(os.path.join(grids.run_dir(root, "mini", "CE", 1337), "metrics.json")) as f:
        ce_flops = json.load(f)["flops"]["total"]
    assert call["runs"] == 2 and call["flops"] == sum(stage_flops) + ce_flops
    assert sorted(run["method"] for run in call["archived"]) == ["CE", "CWT + FT"]  # every run it archived
    # each run's provenance (tools/identity.provenance): when, from what code, on what machine
    with open(os.path.join(chained, "run.json")) as f:
        provenance = json.load(f)["provenance"]
    assert provenance["utc_start"] <= provenance["utc_end"] and len(provenance["config_sha256"]) == 64
    assert provenance["cpu"] and provenance["torch"] == torch.__version__ and len(provenance["commands"]) == 2
    # the peak is the faster of the dtypes measured (bf16 only on CPUs with bf16 units)
    assert call["peak_flops"] == max(call["measured"].values()) > 1e9 and call["wall_s"] > 0
    assert call["measured"][call["peak_dtype"]] == call["peak_flops"] and "float32" in call["measured"]
    archived = grids.run_dir(archive, "mini", "CWT + FT", 1337)
    assert sorted(os.listdir(archived)) == ["embedding.npz", "log.jsonl", "metrics.json", "run.json"]  # no checkpoints
    table, results = report.build_table("mini", archive)
    assert set(results) == {"CE", "CWT + FT"} and "## Hidden-state geometry" in table
    efficiency = call["flops"] / call["peak_flops"] / call["wall_s"]
    assert f"**Efficiency = (grid FLOPs / peak) / wall time = {efficiency:.2f}**:" in table
    drawn = grid_figures.make_figures("mini", archive, str(tmp_path / "results"))
    try:
        import matplotlib  # noqa: F401
        # a chained method's val curve is its fine-tune's: no val-loss difference figure is drawn for it
        names = [os.path.basename(path) for _, path in drawn]
        assert names == ["mini_forest.png", "mini_seeds.png", "mini_lr_val_per_seed.png", "mini_condensation.png",
                         "mini_embedding_similarity.png", "mini_embedding_pca.png"]
        assert all(os.path.getsize(tmp_path / "results" / path) > 0 for _, path in drawn)
    except ImportError:
        assert drawn == []
    mtime = os.path.getmtime(os.path.join(chained, "metrics.json"))
    runner.run_grid("mini", root, workers=2, overrides=overrides, archive=archive)  # nothing left to run
    assert os.path.getmtime(os.path.join(chained, "metrics.json")) == mtime
    with open(os.path.join(archive, "mini", "wall.json")) as f:
        assert len(json.load(f)["calls"]) == 1  # a call with nothing to do adds no wall time
    # another grid with the same run (same config, seed and overrides) copies it instead of training
    monkeypatch.setitem(grids.GRIDS, "mini2", {"CE again": ("config/lowres_baseline.py", 1)})
    monkeypatch.setattr(runner, "launch", lambda *a: pytest.fail("an identical run was trained again"))
    runner.run_grid("mini2", root, workers=1, overrides=overrides, archive=archive)
    with open(os.path.join(grids.run_dir(root, "mini2", "CE again", 1337), "run.json")) as f:
        assert json.load(f)["reused_from"] == grids.run_dir(root, "mini", "CE", 1337)
    assert os.path.exists(grids.run_dir(archive, "mini2", "CE again", 1337) + "/metrics.json")
    # ... but not when anything differs (here the config)
    with pytest.raises(pytest.fail.Exception, match="trained again"):
        monkeypatch.setitem(grids.GRIDS, "mini3", {"CE at margin 1": ("config/lowres_margin_1.py", 1)})
        runner.run_grid("mini3", root, workers=1, overrides=overrides, archive=archive)
    # a fresh checkout has only the archive: still nothing to run
    shutil.rmtree(root)
    runner.run_grid("mini", root, workers=2, overrides=overrides, archive=archive)
    # ... and a new grid with an identical run copies its archived files, no checkpoint needed
    monkeypatch.setitem(grids.GRIDS, "mini4", {"CE from the archive": ("config/lowres_baseline.py", 1)})
    runner.run_grid("mini4", root, workers=1, overrides=overrides, archive=archive)
    copied = grids.run_dir(archive, "mini4", "CE from the archive", 1337)
    with open(os.path.join(copied, "run.json")) as f:
        assert json.load(f)["reused_from"] in (grids.run_dir(archive, "mini", "CE", 1337),
                                                grids.run_dir(archive, "mini2", "CE again", 1337))
    assert sorted(os.listdir(copied)) == sorted(os.listdir(grids.run_dir(archive, "mini", "CE", 1337)))
    assert not os.path.exists(root + "/mini/CE")
    # ... unless its metrics.json predates today's evaluate.py (no geometry): then it is trained again
    for grid, method in (("mini", "CE"), ("mini2", "CE again"), ("mini4", "CE from the archive")):
        path = grids.run_dir(archive, grid, method, 1337) + "/metrics.json"
        with open(path) as f:
            metrics = json.load(f)
        metrics.pop("geometry")
        with open(path, "w") as f:
            json.dump(metrics, f)
    monkeypatch.setitem(grids.GRIDS, "mini5", {"CE from an old archive": ("config/lowres_baseline.py", 1)})
    with pytest.raises(pytest.fail.Exception, match="trained again"):
        runner.run_grid("mini5", root, workers=1, overrides=overrides, archive=archive)


@pytest.mark.slow
def test_a_stopped_call_records_its_wall_time_and_its_runs_resume(tmp_path, monkeypatch):
    """SIGTERM (as Ctrl-C) stops compare.py and every train.py it started, records the call in
    wall.json, and the next call continues a stopped run from its last checkpoint."""
    import subprocess
    import time
    tiny_dataset(tmp_path)
    root, archive = str(tmp_path / "runs"), str(tmp_path / "archive")
    tiny = [f"--data_dir={tmp_path / 'data'}", "--eval_interval=3", "--eval_iters=1", "--warmup_iters=1",
            "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16", "--log_interval=1"]
    grid = subprocess.Popen([sys.executable, "-m", "tools.compare", "lowres", f"--root={root}", f"--archive={archive}",
                             f"--results={tmp_path / 'results'}", *tiny, "--max_iters=1000000"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = grids.run_dir(root, "lowres", "CE", 1337)
    deadline = time.time() + 120
    while time.time() < deadline:  # until the first run has a checkpoint past step 0
        try:
            with open(os.path.join(out, "ckpt.json")) as f:
                if json.load(f)["iter_num"] >= 3:
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    else:
        grid.kill()
        pytest.fail("the first run wrote no checkpoint: " + grid.communicate()[1][-2000:])
    grid.terminate()
    _, stderr = grid.communicate(timeout=60)
    assert grid.returncode == 130 and "stopped: 0 run(s) finished in this call; 2 running one(s)" in stderr
    assert "Traceback" not in stderr, stderr[-2000:]  # a stop, not a crash
    with open(os.path.join(archive, "lowres", "wall.json")) as f:
        (call,) = json.load(f)["calls"]
    assert call["runs"] == 0 and call["flops"] == 0 and call["wall_s"] > 0
    assert processes_naming(root) == [], "train.py processes outlived compare.py"
    with open(os.path.join(out, "ckpt.json")) as f:
        stopped_at = json.load(f)["iter_num"]
    with open(os.path.join(out, "stopped_wall.json")) as f:  # the stopped call's time on this run
        stopped_wall = json.load(f)["wall_s"]
    assert 0 < stopped_wall <= call["wall_s"]
    monkeypatch.chdir(REPO)
    config, _ = grids.GRIDS["lowres"]["CE"]
    t0 = time.time()
    runner.launch(config, 1337, out, 1, [*tiny, f"--max_iters={stopped_at + 2}"])
    with open(os.path.join(out, "run.json")) as f:  # the run's wall time: both calls
        assert stopped_wall < json.load(f)["wall_s"] <= stopped_wall + time.time() - t0
    with open(os.path.join(out, "train.out")) as f:
        log = f.read()
    assert log.count("params:") == 2 and f"resumed from {out}/ckpt.pt at iter {stopped_at}" in log
    with open(os.path.join(out, "log.jsonl")) as f:
        steps = [json.loads(line)["iter"] for line in f if '"loss"' in line]
    assert steps == list(range(stopped_at + 2))  # no step lost or repeated in the log
    assert os.path.exists(os.path.join(out, "metrics.json"))


@pytest.mark.slow
def test_a_call_killed_without_warning_keeps_its_record_in_wall_json(tmp_path):
    """compare.py killed by SIGKILL (no chance to clean up) after its first of two runs finished:
    wall.json still holds the call, with that run and its FLOPs, since the record is written at the
    start and rewritten as runs finish; the next call adds its own record beside it."""
    import signal
    import subprocess
    import time
    tiny_dataset(tmp_path)
    root, archive = str(tmp_path / "runs"), str(tmp_path / "archive")
    command = [sys.executable, "-m", "tools.compare", "lowres", f"--root={root}", f"--archive={archive}",
               f"--results={tmp_path / 'results'}", "--methods", "CE", "--seeds", "1337", "1338", "--workers=1",
               f"--data_dir={tmp_path / 'data'}", "--eval_interval=3", "--eval_iters=1", "--warmup_iters=1",
               "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16", "--max_iters=6"]
    grid = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall_path = os.path.join(archive, "lowres", "wall.json")
    deadline, calls = time.time() + 120, []
    while time.time() < deadline and grid.poll() is None:
        calls = runner.grid_calls(wall_path) if os.path.exists(wall_path) else []
        if calls and calls[0]["runs"] == 1:
            break
        time.sleep(0.05)
    grid.send_signal(signal.SIGKILL)
    _, stderr = grid.communicate(timeout=60)
    assert calls and calls[0]["runs"] == 1, stderr[-2000:]
    for pid in processes_naming(root):  # the second run's train.py, orphaned
        with contextlib.suppress(ProcessLookupError):  # unless it has just finished
            os.kill(pid, signal.SIGKILL)
    (killed,) = runner.grid_calls(wall_path)
    first = grids.run_dir(archive, "lowres", "CE", 1337)
    with open(os.path.join(first, "metrics.json")) as f:
        run_flops = json.load(f)["flops"]["total"]
    assert killed["runs"] == 1 and killed["flops"] == run_flops > 0 and killed["wall_s"] > 0
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before, after = runner.grid_calls(wall_path)
    assert before == killed and after["runs"] == 1 and after["call"] != killed["call"]


def test_efficiency_sums_calls_and_says_when_runs_did_not_count(tiny_grid):
    """A grid run in several compare.py calls: its wall time is the sum of theirs, and its
    efficiency sum(FLOPs_i / peak_i) / sum(wall_i) over the calls whose runs counted FLOPs."""
    path = os.path.join(tiny_grid, "tiny", "wall.json")
    common = {"workers": 2, "threads_per_run": 1, "cpu": "Test CPU", "cores": 2, "torch": "x", "peak_dtype": "float32"}
    with open(path, "w") as f:  # a call made before train.py counted FLOPs: no FLOPs, no peak
        json.dump({"calls": [{"wall_s": 1800.0, "runs": 1, **{k: v for k, v in common.items() if k != "peak_dtype"}}]}, f)
    table, _ = report.build_table("tiny", tiny_grid)
    assert "1 runs in 0.50 h over 1 `tools.compare tiny` call(s)" in table and "Efficiency: not available" in table
    runner.record_call(path, {**common, "wall_s": 3600.0, "runs": 2, "flops": 2.0e14, "peak_flops": 1.0e11})
    runner.record_call(path, {**common, "wall_s": 1800.0, "runs": 1, "flops": 0.6e14, "peak_flops": 1.5e11})
    table, _ = report.build_table("tiny", tiny_grid)
    # (2000 s + 400 s at peak) / 5400 s = 0.444...
    assert "4 runs in 2.00 h over 3 `tools.compare tiny` call(s)" in table
    assert ("**Efficiency = (grid FLOPs / peak) / wall time = 0.44** (the 2 call(s) whose runs counted their "
            "FLOPs: 3 runs, 1.50 h): 0.260 PFLOP executed") in table
    assert "at the peaks measured at each call's start (float32, all cores: 100–150 GFLOP/s) would take 40.0 min" in table
    # a CPU with bf16 units measures its peak in bf16: the range says which peak is which dtype's
    runner.record_call(path, {**common, "peak_dtype": "bfloat16", "wall_s": 600.0, "runs": 1, "flops": 1.2e14,
                              "peak_flops": 4.0e11})
    table, _ = report.build_table("tiny", tiny_grid)
    assert "peaks measured at each call's start (all cores; float32: 100–150, bfloat16: 400 GFLOP/s)" in table


def test_time_breakdown_splits_step_time_from_the_rest(tiny_grid):
    """Training-step share = iterations x median ms/iter over single-stage runs' wall time; the
    fill = all runs' wall time / (runs at a time x grid wall time)."""
    for method, seed, *_, out in grids.runs_of("tiny", tiny_grid):
        chained = (method, seed) == ("SimReg", 1338)  # its log holds only its last stage: left out of the share
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump({"wall_s": 100.0 if chained else 20.0, "commands": [["a"], ["b"]] if chained else [["a"]]}, f)
        with open(os.path.join(out, "log.jsonl"), "a") as f:  # 1000 iterations at a median of 10 ms: 10 s
            f.write(json.dumps({"iter": 999, "loss": 1.0, "tokens_per_s": 1.0, "ms_per_iter": 10.0, "mfu": 0.5}) + "\n")
    runner.record_call(os.path.join(tiny_grid, "tiny", "wall.json"),
                        {"workers": 2, "threads_per_run": 1, "cpu": "Test CPU", "cores": 2, "torch": "x",
                         "peak_dtype": "float32", "wall_s": 100.0, "runs": 4, "flops": 1e12, "peak_flops": 1e11})
    table, _ = report.build_table("tiny", tiny_grid)
    # share: 3 x 10 s of 3 x 20 s; fill: (3 x 20 + 100) s / (2 x 100 s)
    assert "training steps (iterations × median ms/iter) are 50 % of the single-stage runs' wall time" in table
    assert "the runs' wall times fill 80 % of 2 × the grid's wall time" in table
    # the record of a call that trained 2 of the runs is missing: their 160 s would "fill" 160 % of 2 x 50 s
    with open(os.path.join(tiny_grid, "tiny", "wall.json"), "w") as f:
        json.dump({"calls": [{"workers": 2, "threads_per_run": 1, "cpu": "Test CPU", "cores": 2, "torch": "x",
                              "peak_dtype": "float32", "wall_s": 50.0, "runs": 2, "flops": 5e11,
                              "peak_flops": 1e11}]}, f)
    table, _ = report.build_table("tiny", tiny_grid)
    assert ("wall.json's call records account for 2 of the 4 runs this grid trained: the calls that trained "
            "the other 2 left no record") in table
    assert "of the single-stage runs' wall time, the rest being evaluation, checkpoints and process start.\n" in table
    assert "fill" not in table
    # every run counted, but the calls' time short of theirs (160 s against 2 x 50 s): no share over 100 %
    lines = report.time_breakdown({"steps": 30.0, "single_stage_runs": 60.0, "runs": 160.0}, 50.0, 2)
    assert "add up to more than 2 × the calls' recorded wall time" in lines[1] and "fill" not in lines[1]


def test_machine_peak_measures_fp32_and_bf16_only_with_bf16_units(monkeypatch):
    monkeypatch.setattr(runner, "bf16_matrix_units", lambda: False)
    peak = runner.machine_peak()
    # FLOP/s, not GFLOP/s: far above 1e7 even on 2 cores shared with a loaded machine (idle: ~1.5e11;
    # 2.6e8 measured under a load average of 25)
    assert set(peak["measured"]) == {"float32"} and peak["peak_dtype"] == "float32" and peak["peak_flops"] > 1e7
    monkeypatch.setattr(runner, "bf16_matrix_units", lambda: True)
    monkeypatch.setattr(runner, "measure_matmul_flops", lambda device, dtype, repeats: 3e11 if dtype == torch.bfloat16 else 1e11)
    assert runner.machine_peak() == {"peak_flops": 3e11, "peak_dtype": "bfloat16",
                                      "measured": {"float32": 1e11, "bfloat16": 3e11}}
    monkeypatch.setattr(runner, "measure_matmul_flops", lambda device, dtype, repeats: 1e9 if dtype == torch.bfloat16 else 1e11)
    assert runner.machine_peak()["peak_dtype"] == "float32"  # bf16 units, but slower: fp32 is the peak


def test_single_language_grid_table(tmp_path, monkeypatch):
    """The BPE grid's runs are scored on one val split: one table, paired differences over its
    metrics, no embedding-twin or marginalization sections."""
    monkeypatch.setitem(grids.POOLABLE, "onelang", "test runs that record no code or machine")
    monkeypatch.setitem(grids.GRIDS, "onelang", {"CE": ("config/bpe_baseline.py", 2),
                                                   "SimReg": ("config/bpe_simreg.py", 2)})
    values = {("CE", 1337): (0.20, 300.0), ("CE", 1338): (0.22, 280.0), ("SimReg", 1337): (0.21, 290.0),
              ("SimReg", 1338): (0.24, 260.0)}
    for (method, seed), (acc, ppl) in values.items():
        out = grids.run_dir(str(tmp_path), "onelang", method, seed)
        os.makedirs(out)
        val = {"ppl": ppl, "ppl_best": ppl - 10, "t_best": 1.1, "accuracy": acc, "recall_at_5": 0.4, "mrr": 0.3,
               "isotropy": 0.5}
        geometry = {"mu": [0.1, 0.5], "spearman_rho": None, "kendall_tau": None, "final_cosine": 0.9,
                    "simreg_final": 1e-2, "cosine_histograms": [[0.025] * 40] * 2}
        rare = {"tokens": 100, "fraction": 0.1, "accuracy": acc / 4, "mrr": acc / 2, "ppl": 10 * ppl}
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"val": val, "geometry": {"val": geometry}, "rare": rare}, f)
        with open(os.path.join(out, "log.jsonl"), "w") as f:
            f.writelines(json.dumps({"iter": 50 * k, "val": v}) + "\n" for k, v in enumerate([7.0, 6.0, 5.5]))
    table, results = report.build_table("onelang", str(tmp_path))
    assert "## Validation" in table and "HR validation" not in table and "Embedding geometry" not in table
    assert "| CE | 2 | 290.00 ± 14.14 |" in table  # ppl: 300, 280
    # paired: acc +0.01, +0.02 -> mean 0.015, se 0.005, half-width 12.7062 * 0.005 = 0.0635;
    # ppl -10, -20 -> -15, se 5, half-width 63.5 (no decimals at PPL ~300)
    assert "| SimReg | 2 | +0.015 [-0.049, +0.079], 2/2 up | +0.000 [+0.000, +0.000], 0/2 up | -15 [-79, +49], 2/2 down |" in table
    assert "## Rare targets" in table and f"| CE | 2 | 0.100 ± 0.000 | 2900 ± 141 | {report.fmt([0.05, 0.055])} | 0.105 ± 0.007 |" in table
    # paired rare columns: acc/4 -> +0.0025, +0.005 (se 0.00125); ppl x10 -> -100, -200 (se 50)
    assert "| +0.004 [-0.012, +0.020], 2/2 up | -150 [-785, +485], 2/2 down |" in table
    assert "## Hidden-state geometry (val)" in table and "paper" not in table
    # runs evaluated since evaluate.py measures the rare targets' PPL at the run's T_best: its column too
    for (method, seed), (acc, ppl) in values.items():
        path = os.path.join(grids.run_dir(str(tmp_path), "onelang", method, seed), "metrics.json")
        metrics = json.load(open(path))
        metrics["rare"]["ppl_at_t_best"] = 8 * ppl
        json.dump(metrics, open(path, "w"))
    table, _ = report.build_table("onelang", str(tmp_path))
    assert "| PPL at the run's T_best |" in table and "| CE | 2 | 0.100 ± 0.000 | 2900 ± 141 | 2320 ± 113 |" in table
    assert "-120 [-628, +388], 2/2 down |" in table  # x8: -80, -160


def test_rare_target_ppl_best_claim_is_the_relative_difference_at_each_runs_t_best():
    """bpe_rare's claim row: per seed 100 (method / CE - 1) of the rare targets' PPL at the run's own
    best temperature, not at T = 1 (its description row)."""
    from tools import claims
    ce = {1337: (1000.0, 900.0), 1338: (1200.0, 1000.0), 1339: (800.0, 700.0)}
    se = {1337: (300.0, 850.0), 1338: (400.0, 1050.0), 1339: (200.0, 630.0)}
    runs = {name: {seed: {"dir": "", "metrics": {"rare": {"ppl": t1, "ppl_at_t_best": best}}}
                   for seed, (t1, best) in per_seed.items()} for name, per_seed in (("CE", ce), ("margin 0.6 + SE", se))}
    rows = {c["quantity"]: (r, verdict) for c, r, _, verdict in claims.evaluate_claims("bpe_rare", runs, "CE")}
    best, verdict = rows["rare-target PPL_best (%)"]
    expected = [100 * (se[s][1] / ce[s][1] - 1) for s in sorted(ce)]
    assert abs(best["mean"] - sum(expected) / 3) < 1e-9 and best["n"] == 3 and verdict in ("not shown", "reproduces")
    at_one, described = rows["rare-target PPL at T = 1 (%)"]
    assert abs(at_one["mean"] - sum(100 * (se[s][0] / ce[s][0] - 1) for s in ce) / 3) < 1e-9
    assert described == claims.DESCRIPTION


@pytest.mark.slow
def test_every_grid_command_is_a_valid_config(monkeypatch):
    """Each run of every grid parses (config files, types): a typo would otherwise
    surface hours into a grid. One of them goes through train.py itself (--dry_run)."""
    import subprocess
    import configurator
    monkeypatch.chdir(REPO)
    defaults = train_defaults()
    assert defaults["n_layer"] == 4 and defaults["margin"] is None and len(defaults) > 60
    for grid in grids.GRIDS:  # every run, the extra runs with their own arguments included
        for method, seed, config, args, _ in grids.runs_of(grid, "r"):
            for cmd in runner.planned_commands(config, seed, list(args)):
                parsed = configurator.parse_config(cmd[2:], defaults)
                assert parsed["seed"] == seed and parsed["max_iters"] > 0, (grid, method)
    # issue 40's rows: the BPE toy 4x as long with its schedule scaled; l2_repel's norm term alone
    for method, (config, _) in grids.GRIDS["bpe_1600"].items():
        long, short = (configurator.parse_config(runner.planned_commands(c, 1337, [])[0][2:], defaults)
                       for c in (config, grids.GRIDS["bpe"][method][0]))
        assert {k: long[k] for k in ("max_iters", "lr_decay_iters", "warmup_iters")} == \
            {k: 4 * short[k] for k in ("max_iters", "lr_decay_iters", "warmup_iters")}
        assert {k: v for k, v in long.items() if k not in ("max_iters", "lr_decay_iters", "warmup_iters", "out_dir")} == \
            {k: v for k, v in short.items() if k not in ("max_iters", "lr_decay_iters", "warmup_iters", "out_dir")}
    norm, released = (configurator.parse_config(runner.planned_commands(c, 1337, [])[0][2:], defaults) for c in
                      ("config/lowres_dispersion_l2_norm_authors.py", "config/lowres_dispersion_l2_repel_authors.py"))
    assert (norm["dispersion_variant"], released["dispersion_variant"]) == ("l2_repel_norm", "l2_repel")
    assert {k: v for k, v in norm.items() if k not in ("dispersion_variant", "out_dir")} == \
        {k: v for k, v in released.items() if k not in ("dispersion_variant", "out_dir")}
    bpe = grids.GRIDS["bpe"]
    simreg = configurator.parse_config(runner.planned_commands(bpe["SimReg chunk 32"][0], 1338, [])[0][2:], defaults)
    assert (simreg["data_dir"], simreg["simreg_weight"], simreg["simreg_chunk_size"], simreg["low_resource"]) == \
        ("data/shakespeare_gpt2", 3.54, 32, False)
    cmd = runner.planned_commands(bpe["CE"][0], 1337, [])[0]
    result = subprocess.run(cmd + ["--dry_run=True", "--vocab_size=50304"], capture_output=True, text=True)
    assert result.returncode == 0 and "params: 7,242,880" in result.stdout, result.stderr[-500:]


def test_transition_rate_and_departure_step(tmp_path, monkeypatch):
    """The per-seed table: k of n seeds at or above the LR accuracy threshold, the exact interval,
    and for each such seed the first evaluation at which its LR val loss is 0.1 nats below every
    other seed's (here: seed 1339 is 0.05 below at step 250, 0.15 below at 500)."""
    monkeypatch.setitem(grids.POOLABLE, "jump", "test runs that record no code or machine")
    monkeypatch.setitem(grids.GRIDS, "jump", {"CE": ("config/lowres_ce.py", 3), "margin 0.6": ("config/lowres_margin_0.6.py", 3)})
    low_curves = {1337: [3.0, 2.5, 2.4], 1338: [3.0, 2.6, 2.5], 1339: [3.0, 2.45, 2.25]}
    for method in ("CE", "margin 0.6"):
        for seed, curve in low_curves.items():
            out = grids.run_dir(str(tmp_path), "jump", method, seed)
            os.makedirs(out)
            jumps = method == "margin 0.6" and seed == 1339
            with open(os.path.join(out, "metrics.json"), "w") as f:
                json.dump(fake_metrics(0.49 if jumps else 0.37, 5.0), f)
            with open(os.path.join(out, "log.jsonl"), "w") as f:
                f.writelines(json.dumps({"iter": 250 * k, "val": v, "val_low": v}) + "\n" for k, v in enumerate(curve))
    table, _ = report.build_table("jump", str(tmp_path))
    assert "| CE | 3 | 0 of 3 | 0.00 [0.00, 0.71] | — |" in table
    assert "- **CE** (3 seeds): LR accuracy 0.370 0.370 0.370; twin in top-3 " in table
    assert "| margin 0.6 | 3 | 1 of 3 | 0.33 [0.01, 0.91] | 1339 (step 500) |" in table
    assert "- **margin 0.6** (3 seeds): LR accuracy 0.370 0.370 0.490; twin in top-3 " in table


def test_results_readme_verdict_counts_are_the_tables():
    """results/README.md's verdict table repeats each grid table's last line: it must say the same,
    for every grid whose table judges claims (a grid without claims, or whose runs are not in yet,
    has no such line)."""
    import re
    readme = open(os.path.join(REPO, "results", "README.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| \[`(\w+)`\]\(\w+\.md\) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", readme, flags=re.M)
    judged = set()
    for grid in grids.GRIDS:
        path = os.path.join(REPO, "results", f"{grid}.md")
        if os.path.exists(path) and re.search(r"^\d+ reproduce, \d+ not shown, \d+ contradicted, of \d+ claims\.",
                                              open(path, encoding="utf-8").read(), flags=re.M):  # (checks may follow)
            judged.add(grid)
    assert {grid for grid, *_ in rows} == judged >= {"jostling", "lowres", "bpe"}
    for grid, claims, reproduce, not_shown, contradicted in rows:
        table = open(os.path.join(REPO, "results", f"{grid}.md"), encoding="utf-8").read()
        assert f"{reproduce} reproduce, {not_shown} not shown, {contradicted} contradicted, of {claims} claims." in table


def test_results_readme_per_seed_paragraph_is_the_tables():
    """The per-seed numbers results/README.md types in its Stop Jostling paragraphs are read here
    from the tables tools.compare --table_only writes (lowres.md's and jostling.md's per-seed
    tables, jostling.md's transition line and claims): a rebuilt table that moves them fails."""
    import re
    readme = open(os.path.join(REPO, "results", "README.md"), encoding="utf-8").read()
    readme = " ".join(readme.split())  # the paragraphs' line breaks
    results = {grid: open(os.path.join(REPO, "results", f"{grid}.md"), encoding="utf-8").read()
               for grid in ("lowres", "jostling")}

    def per_seed(grid, method, n):  # (LR accuracies, seeds that make it, twin shares) of the per-seed part
        (made,) = re.findall(rf"^\| {re.escape(method)} \| {n} \| \d+ of {n} \| [^|]+ \| ([^|]+) \|$",
                             results[grid], flags=re.M)
        ((acc, twins),) = re.findall(rf"^- \*\*{re.escape(method)}\*\* \({n} seeds\): LR accuracy ([\d. ]+); "
                                     r"twin in top-3 ([\d. ]+)$", results[grid], flags=re.M)
        return [float(v) for v in acc.split()], made.strip(), [float(v) for v in twins.split()]

    def dot(x):  # .498, as the paragraph writes an accuracy
        return f"{x:.3f}"[1:]

    ce, margin, se = (per_seed("lowres", m, 10) for m in ("CE", "margin 0.6", "margin 0.6 + SE"))
    assert "the transition happens on two seeds, 1342 and 1346" in readme
    assert margin[1].startswith("1342") and "1346" in margin[1] and se[1].startswith("1342") and "1346" in se[1]
    assert f"margin 0.6 reaches LR accuracy {dot(margin[0][-1])} and {dot(margin[0][-2])}" in readme
    assert f"margin 0.6 + SE {dot(se[0][-1])} and {dot(se[0][-2])}" in readme
    crossing_twins = margin[2][-2:] + se[2][-2:]
    assert f"with {100 * min(crossing_twins):.0f}–{100 * max(crossing_twins):.0f} % of the rows' twins" in readme
    others = margin[0][:-2] + se[0][:-2]
    assert f"stays at {dot(min(others))}–{dot(max(others))} with at most {100 * max(margin[2][:-2] + se[2][:-2]):.0f} % twins" \
        in readme
    assert f"CE stays at {dot(min(ce[0]))}–{dot(max(ce[0]))}" in readme
    steps = [int(step) for step in re.findall(r"step (\d+)", margin[1] + se[1])]
    assert f"from step {min(steps)}–{max(steps)} of 8000 on" in readme
    # the 30-seed rates, Fisher's p, and the spread without the crossing seeds
    rates = {m: re.search(rf"^\| {m} \| 30 \| (\d+) of 30: ([\d.]+) (\[[\d., ]+\])", results["jostling"], flags=re.M)
             for m in ("baseline", "margin 0.6")}
    k, rate, interval = rates["margin 0.6"].groups()
    assert f"{k} of 30 seeds with margin 0.6, {rate} {interval}" in readme
    assert f"{rates['baseline'].group(1)} of 30 for CE, {rates['baseline'].group(3)}" in readme
    p = float(re.search(r"Margin 0.6 against CE: [^,]+, Fisher's exact p = ([\d.]+)", results["jostling"]).group(1))
    assert f"Fisher's exact p = {p:.2f}" in readme
    margin30, _, _ = per_seed("jostling", "margin 0.6", 30)
    ce30, _, _ = per_seed("jostling", "baseline", 30)
    below = [v for v in margin30 if v < 0.43]
    assert f"the third, 1356, only partly: LR accuracy {dot(sorted(margin30)[-3])}" in readme
    assert f"every margin 0.6 seed ({dot(min(below))}–{dot(max(below))}, {len(below)} seeds)" in readme
    assert f"every CE seed ({dot(min(ce30))}–{dot(max(ce30))}, 30 seeds)" in readme
    (not_decayed,) = re.findall(r"LR accuracy, rows not decayed ↑ \| [^|]+ \| ([-+][\d.]+ \[[-+\d., ]+\]), \d/5",
                                results["jostling"])
    assert f"LR accuracy {not_decayed.replace('-', '−')} against margin 0.6 + SE" in readme


def archived_run(archive, grid, method, seed, config, metrics, extra=(), run_identity=None):
    """An archived run as tools.compare leaves it: metrics.json, a log and run.json with its command and
    its identity (by default one code on one CPU for every run)."""
    out = grids.run_dir(archive, grid, method, seed)
    os.makedirs(out)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f)
    with open(os.path.join(out, "log.jsonl"), "w") as f:
        f.write(json.dumps({"iter": 0, "val": 3.0, "val_low": 3.0}) + "\n")
    commands = [[sys.executable, "train.py", config, f"--seed={seed}", *extra, f"--out_dir=out/{seed}", "--num_threads=1"]]
    record = {"wall_s": 1.0, "threads": 1, "commands": commands}
    from tools import identity
    record["identity"] = run_identity or {"training": identity.training_keys(commands), "commit": "abc",
                                          "cpu": "CPU A"}
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(record, f)
    return out


def test_compare_refuses_to_pair_runs_trained_with_other_keys(tmp_path, monkeypatch):
    """`tools.compare <grid> --max_iters=40` on an archive of 8000-step runs: refused in one line
    naming the key, before anything is trained, and --table_only on an archive of 40-step runs
    without the override too; with the same override it pairs them."""
    from tools import compare
    monkeypatch.setitem(grids.GRIDS, "like", {"CE": ("config/lowres_ce.py", 2), "margin 0.6": ("config/lowres_margin_0.6.py", 2)})
    monkeypatch.setattr(runner, "launch", lambda *a: pytest.fail("a run was trained"))
    archive = str(tmp_path / "archive")
    for method, config in (("CE", "config/lowres_ce.py"), ("margin 0.6", "config/lowres_margin_0.6.py")):
        for seed in (1337, 1338):
            archived_run(archive, "like", method, seed, config, fake_metrics(0.37, 5.0))
    argv = ["like", f"--archive={archive}", f"--root={tmp_path / 'root'}", f"--results={tmp_path / 'results'}"]
    with pytest.raises(UsageError) as stop:
        compare.main(argv + ["--max_iters=40"])
    assert stop.value.status == 2 and len(str(stop.value).splitlines()) == 1
    assert "(CE, seed 1337) was trained with max_iters=8000, this comparison asks for max_iters=40" in str(stop.value)
    compare.main(argv + ["--table_only"])  # the runs as the grid plans them: paired
    assert "| margin 0.6 | 2 |" in (tmp_path / "results" / "like.md").read_text()
    # a run trained with a key the grid's config does not set (recorded in run.json's identity)
    short = str(tmp_path / "short")
    for seed in (1337, 1338):
        keys = runner.identity.training_keys(runner.planned_commands("config/lowres_ce.py", seed, ["--max_iters=40"]))
        archived_run(short, "like", "CE", seed, "config/lowres_ce.py", fake_metrics(0.37, 5.0), ["--max_iters=40"],
                     {"training": keys, "commit": "abc", "cpu": "CPU A"})
    with pytest.raises(UsageError, match="was trained with max_iters=40, this comparison asks for max_iters=8000"):
        compare.main(["like", f"--archive={short}", "--table_only"])
    compare.main(["like", f"--archive={short}", "--table_only", "--max_iters=40"])
    assert os.path.exists(os.path.join(short, "like.md"))  # the table goes with its own archive


def test_methods_and_seeds_choose_the_runs_a_call_trains(tmp_path, monkeypatch):
    from tools import compare
    monkeypatch.setitem(grids.GRIDS, "pick", {"CE": ("config/lowres_ce.py", 3), "margin 0.6": ("config/lowres_margin_0.6.py", 3),
                                                "margin 1": ("config/lowres_margin_1.py", 3)})
    only = compare.selection("pick", ["margin 1"], [1338])
    assert only == {("CE", 1338), ("margin 1", 1338)}  # the baseline comes with every method
    assert compare.selection("pick", None, None) is None
    for methods, seeds, message in ((["margin 3"], None, "'margin 3' not in grid 'pick'"),
                                    (None, [1400], "--seeds: 1400 not among the chosen methods' seeds")):
        with pytest.raises(UsageError, match=message):
            compare.selection("pick", methods, seeds)
    trained = []

    def launch(config, seed, out, threads, overrides):
        trained.append((config, seed))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(fake_metrics(0.37, 5.0), f)
        with open(os.path.join(out, "log.jsonl"), "w") as f:
            f.write(json.dumps({"iter": 0, "val": 3.0, "val_low": 3.0}) + "\n")
        return 0.0
    monkeypatch.setattr(runner, "launch", launch)
    monkeypatch.setattr(runner, "machine_peak", lambda: {"peak_flops": 1e9, "peak_dtype": "float32", "measured": {}})
    runner.run_grid("pick", str(tmp_path / "root"), 1, ["--max_iters=40"], str(tmp_path / "archive"), only)
    assert sorted(trained) == [("config/lowres_ce.py", 1338), ("config/lowres_margin_1.py", 1338)]


@pytest.mark.slow
def test_a_new_run_records_its_identity_and_the_report_counts_pairs_across_machines(tmp_path, monkeypatch):
    from tools import identity
    monkeypatch.setitem(grids.POOLABLE, "machines", "two CPUs on purpose: the test counts the pairs that mix them")
    monkeypatch.setitem(grids.GRIDS, "machines", {"CE": ("config/lowres_ce.py", 2), "margin 1": ("config/lowres_margin_1.py", 2)})
    archive = str(tmp_path)
    for method, config in (("CE", "config/lowres_ce.py"), ("margin 1", "config/lowres_margin_1.py")):
        for seed, cpu in ((1337, "CPU A"), (1338, "CPU A" if method == "CE" else "CPU B")):
            keys = identity.training_keys(runner.planned_commands(config, seed, []))
            archived_run(archive, "machines", method, seed, config, fake_metrics(0.37, 5.0),
                         run_identity={"training": keys, "commit": "abc", "cpu": cpu})
    table, _ = report.build_table("machines", archive)
    assert "of the 2 pairs (a method and its baseline on one seed) these tables compare, 1 pair runs made on " \
           "different CPUs and 0 include a run whose CPU is not recorded" in table
    record = identity.record(runner.planned_commands("config/lowres_margin_1.py", 1337, ["--max_iters=40"]))
    (keys,) = record["training"]
    assert keys["max_iters"] == 40 and keys["margin"] == 1.0 and keys["seed"] == 1337 and "out_dir" not in keys
    assert record["cpu"] == identity.cpu_name() and len(record["commit"].split("+")[0]) in (40, len(identity.UNKNOWN))


def test_the_machines_line_says_which_runs_trained_off_the_cpu():
    """A GPU run's recorded CPU is only its host's: the line says how many runs trained on which
    device, and says nothing of devices when every run trained on the CPU."""
    from tools import identity
    gpu = {"training": [{"device": "cuda", "seed": 1}], "commit": "abc", "cpu": "Host CPU"}
    cpu = {"training": [{"device": "cpu", "seed": 1}], "commit": "abc", "cpu": "Host CPU"}
    line = identity.machines_line([("a", "b")], {"a": gpu, "b": gpu, "c": cpu, "d": None})
    assert line.endswith("CPUs recorded: Host CPU. 2 of the 4 runs trained on device=cuda: for them the CPU "
                         "is the host's (the wall time below names the GPU where wall.json recorded it).")
    assert identity.machines_line([("c", "c")], {"c": cpu, "d": None}).endswith("CPUs recorded: Host CPU.")


def test_every_archived_run_is_the_run_its_grid_plans():
    """The rule for runs archived before run.json recorded its identity (their command resolved by
    today's config files) finds every archived run like its grid's plan: --table_only rebuilds."""
    for grid in grids.GRIDS:
        runner.check_like(grid, os.path.join(REPO, "results", "runs"), [])


def test_table_only_without_matplotlib_keeps_the_figures_section(tmp_path, monkeypatch):
    """A rebuild where matplotlib is missing keeps the links of the figures drawn before (and says
    they were not redrawn), call after call; with no figures before, it says why there are none."""
    from tools import compare, figures
    monkeypatch.setitem(grids.GRIDS, "nofig", {"CE": ("config/lowres_ce.py", 1), "margin 1": ("config/lowres_margin_1.py", 1)})
    monkeypatch.setattr(figures, "_pyplot", lambda: None)
    archive, results = str(tmp_path / "archive"), tmp_path / "results"
    for method, config in (("CE", "config/lowres_ce.py"), ("margin 1", "config/lowres_margin_1.py")):
        archived_run(archive, "nofig", method, 1337, config, fake_metrics(0.37, 5.0))
    argv = ["nofig", "--table_only", f"--archive={archive}", f"--results={results}"]
    compare.main(argv)
    assert "## Figures\n\nNone: matplotlib" in (results / "nofig.md").read_text()
    link = "Every seed's value per method:\n\n![Every seed's value per method](figures/nofig_seeds.png)\n"
    (results / "nofig.md").write_text("# Grid\n\nold table\n\n## Figures\n\n" + link)
    for _ in range(2):
        compare.main(argv)
        table = (results / "nofig.md").read_text()
        assert table.endswith("## Figures\n\n" + compare.NOT_REDRAWN + "\n\n" + link) and "old table" not in table


def test_the_findings_numbers_are_the_tables():
    """Every count ('3 of 30') and p ('p = 0.237') in README's Results section is in
    results/jostling.md, which tools.compare --table_only writes."""
    import re
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    results = " ".join(readme[readme.index("## Results"):readme.index("## Files")].split())  # one line
    table = open(os.path.join(REPO, "results", "jostling.md"), encoding="utf-8").read()
    numbers = re.findall(r"\d+ of \d+|p = [0-9.]+\d", results)
    assert len(numbers) >= 7
    assert [n for n in numbers if n not in table] == []


def test_a_run_stopped_part_way_is_not_resumed_with_other_keys(tmp_path, monkeypatch):
    """A stopped 8000-step run in --root would go on from its checkpoint under --max_iters=40 (a
    resume may change max_iters): the call is refused, naming the key, before anything runs."""
    from tools import compare
    monkeypatch.setitem(grids.GRIDS, "stopped", {"CE": ("config/lowres_ce.py", 1)})
    monkeypatch.setattr(runner, "launch", lambda *a: pytest.fail("a run was trained"))
    out = grids.run_dir(str(tmp_path / "root"), "stopped", "CE", 1337)
    os.makedirs(out)
    (keys,) = runner.identity.training_keys(runner.planned_commands("config/lowres_ce.py", 1337, []))
    with open(os.path.join(out, "ckpt.json"), "w") as f:
        json.dump({"config": {**keys, "out_dir": out}, "iter_num": 3000}, f)
    with pytest.raises(UsageError, match="was trained with max_iters=8000, this comparison asks for max_iters=40"):
        compare.main(["stopped", f"--root={tmp_path / 'root'}", f"--archive={tmp_path / 'archive'}", "--max_iters=40"])


def test_issue_40_grids_are_the_registered_runs():
    """The pre-registered runs (results/preregistration.md): CE and margin 0.6 on the 24 fresh seeds
    1367-1390, none of them a seed of an earlier grid, margin 0.6 again with the next seed's data
    order; the embedding swap's 8 runs, each pair's blocks with the other's embeddings, on both of
    the pair's data orders; the grids listed before them keep their runs."""
    prereg = list(grids.runs_of("jostling_prereg", "r"))
    assert len(prereg) == 72 and {seed for _, seed, *_ in prereg} == set(range(1367, 1391))
    assert not {seed for _, seed, *_ in prereg} & {seed for g in ("jostling", "lowres", "bpe")
                                                     for _, seed, *_ in grids.runs_of(g, "r")}
    for method, seed, config, args, _ in prereg:
        assert config == {"baseline": "config/lowres_ce.py"}.get(method, "config/lowres_margin_0.6.py")
        assert args == ((f"--data_seed={seed + 1}",) if "next seed" in method else ())
    swaps = [(seed, args) for method, seed, _, args, _ in grids.runs_of("jostling_swap", "r") if "swapped" in method]
    pairs = {(1342, 1337), (1337, 1342), (1346, 1338), (1338, 1346)}  # (blocks, embeddings)
    assert {(seed, int(args[0].split("=")[1])) for seed, args in swaps} == pairs and len(swaps) == 8
    assert {(seed, args[1] if len(args) > 1 else f"--data_seed={seed}") for seed, args in swaps} == \
        {(b, f"--data_seed={d}") for b, e in pairs for d in (b, e)}
    # the grids before issue 40: first n of SEEDS, seed-major, as before
    jostling = list(grids.runs_of("jostling", "r"))
    assert len(jostling) == 104 and [s for _, s, *_ in jostling] == sorted(s for _, s, *_ in jostling)


def test_the_norm_term_ablation_is_judged_in_its_own_family(tmp_path, monkeypatch):
    """Issue 40's l2_repel ablation (results/preregistration.md, T6): its two rows, against CE and
    against the released l2_repel on the same seeds, with paired differences of HR PPL, Holm over
    those two alone (so the papers' claims keep their verdicts)."""
    from tools import claims
    released = "dispersion l2_repel, authors' form"
    monkeypatch.setitem(grids.GRIDS, "lowres", {"CE": ("config/lowres_ce.py", 3),
                                                released: ("config/lowres_dispersion_l2_repel_authors.py", 3),
                                                claims.NORM_METHOD: ("config/lowres_dispersion_l2_norm_authors.py", 3)})
    hr_ppl = {"CE": (5.00, 5.10, 5.20), released: (4.90, 4.95, 5.12), claims.NORM_METHOD: (4.91, 4.97, 5.11)}
    for method, values in hr_ppl.items():
        for seed, ppl in zip((1337, 1338, 1339), values):
            out = grids.run_dir(str(tmp_path), "lowres", method, seed)
            os.makedirs(out)
            with open(os.path.join(out, "metrics.json"), "w") as f:
                json.dump(fake_metrics(0.37, ppl), f)
            with open(os.path.join(out, "log.jsonl"), "w") as f:
                f.write(json.dumps({"iter": 0, "val": 3.0, "val_low": 3.0}) + "\n")
    table, _ = report.build_table("lowres", str(tmp_path))
    section = table.split("## l2_repel's norm term alone (issue 40)")[1].split("\n## ")[0]
    # norm - CE per seed: -0.09, -0.13, -0.09 (mean -0.103); norm - released: +0.01, +0.02, -0.01 (mean +0.007)
    rows = [line for line in section.splitlines() if line.startswith("| Dispersion |")]
    assert len(rows) == 2
    assert f"| {claims.NORM_METHOD} | CE | HR PPL ↓ |" in rows[0] and "-0.10 [" in rows[0] and "3/3 down" in rows[0]
    assert f"| {released} | HR PPL, against the released l2_repel ↓ |" in rows[1] and "+0.01 [" in rows[1]
    assert "of 2 claims." in section


def test_a_grid_trained_on_a_gpu_names_it_and_computes_no_cpu_efficiency(tmp_path):
    """wall.json names the device a call's runs trained on (runner.runs_device: cpu here); a call
    whose runs used a GPU gets no efficiency against the CPU peak it measured. A call recorded
    before the field existed is named from the runs' device key."""
    assert runner.runs_device([]) == "cpu" and runner.runs_device(["--device=cpu"]) == "cpu"
    call = {"runs": 15, "workers": 8, "threads_per_run": 2, "cpu": "Xeon", "cores": 16, "torch": "2.11",
            "peak_flops": 4e12, "peak_dtype": "bfloat16", "wall_s": 240.0, "flops": 1.2e15}
    seconds = {"steps": 0.0, "single_stage_runs": 0.0, "runs": 0.0, "trained_runs": 0}
    for record, trained_on, named in (({**call, "device": "NVIDIA H200"}, {"cuda"}, "NVIDIA H200"),
                                      (call, {"cuda"}, "a CUDA GPU (device=cuda"),
                                      ({**call, "device": "cpu"}, {"auto"}, None)):
        os.makedirs(tmp_path / "g", exist_ok=True)
        (tmp_path / "g" / "wall.json").write_text(json.dumps({"calls": [record]}))
        text = "\n".join(report.speed_summary("g", str(tmp_path), seconds, trained_on))
        gpu_peak = "On a GPU that utils.GPU_PEAK_BF16_FLOPS lists, the peak is instead its datasheet's"
        if named:
            assert f"training on {named}" in text and "Efficiency: not computed" in text, text
            assert gpu_peak in text
        else:
            assert "training on" not in text and "**Efficiency = " in text and gpu_peak not in text, text
    # a grid with a CPU call and a GPU call: the efficiency's scope says it counts the CPU's calls
    (tmp_path / "g" / "wall.json").write_text(json.dumps({"calls": [{**call, "device": "cpu"},
                                                                     {**call, "device": "NVIDIA H200"}]}))
    text = "\n".join(report.speed_summary("g", str(tmp_path), seconds, {"cuda", "cpu"}))
    assert "(the 1 call(s) whose runs counted their FLOPs on the CPU: 15 runs, 0.07 h)" in text, text


def test_a_rerun_grid_says_how_far_each_number_moved_and_each_effect_in_both(tmp_path, monkeypatch):
    """RERUN_OF: per metric, the median and largest |relative difference| over the runs both grids
    hold; per method, the paired PPL_best change (%) against the baseline in each grid."""
    for name in ("first", "again"):
        monkeypatch.setitem(grids.GRIDS, name, {"CE": ("config/bpe_baseline.py", 2),
                                                "SimReg": ("config/bpe_simreg.py", 2)})
    monkeypatch.setitem(grids.RERUN_OF, "again", "first")
    ppl_best = {("first", "CE", 1337): 100.0, ("first", "CE", 1338): 200.0, ("first", "SimReg", 1337): 90.0,
                ("first", "SimReg", 1338): 160.0, ("again", "CE", 1337): 110.0, ("again", "CE", 1338): 200.0,
                ("again", "SimReg", 1337): 99.0, ("again", "SimReg", 1338): 150.0}
    for (grid, method, seed), value in ppl_best.items():
        out = grids.run_dir(str(tmp_path), grid, method, seed)
        os.makedirs(out)
        val = {"ppl": 1.0, "ppl_best": value, "t_best": 1.0, "accuracy": 0.2, "recall_at_5": 0.4, "mrr": 0.3,
               "isotropy": 0.5}
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"val": val}, f)
    lines = "\n".join(report.rerun_table(report.Grid("again", str(tmp_path))))
    # |relative differences| of PPL_best: 0.1, 0, 0.1, 0.0625 -> median 0.08125, largest 0.1
    assert "| PPL_best | 4 | 8.1 % | 10.0 % |" in lines and "| acc | 4 | 0.0 % | 0.0 % |" in lines
    # SimReg's change: first -10 %, -20 % (mean -15); again -10 %, -25 % (mean -17.5)
    first = report.claims.paired_cell(report.stats.paired([-10.0, -20.0]), 1)
    again = report.claims.paired_cell(report.stats.paired([-10.0, -25.0]), 1)
    assert f"| SimReg | {first} | {again} |" in lines and first.startswith("-15.0") and again.startswith("-17.5")
    assert report.rerun_table(report.Grid("first", str(tmp_path))) == []


def test_a_run_without_a_record_is_refused_unless_its_grid_declares_it(tmp_path, monkeypatch):
    """A finished run with metrics.json but no run.json cannot be paired: refused in one line
    naming it; declared in grids.UNRECORDED_RUNS it is compared, and the table names it."""
    from tools import compare
    monkeypatch.setitem(grids.GRIDS, "records", {"CE": ("config/lowres_ce.py", 2),
                                                 "margin 0.6": ("config/lowres_margin_0.6.py", 2)})
    archive = str(tmp_path / "archive")
    for method, config in (("CE", "config/lowres_ce.py"), ("margin 0.6", "config/lowres_margin_0.6.py")):
        for seed in (1337, 1338):
            archived_run(archive, "records", method, seed, config, fake_metrics(0.37, 5.0))
    os.remove(os.path.join(grids.run_dir(archive, "records", "margin 0.6", 1338), "run.json"))
    argv = ["records", f"--archive={archive}", "--table_only"]
    with pytest.raises(UsageError) as refused:
        compare.main(argv)
    assert len(str(refused.value).splitlines()) == 1
    assert "(margin 0.6, seed 1338) has a metrics.json but no run.json" in str(refused.value)
    monkeypatch.setitem(grids.UNRECORDED_RUNS, "records", {("margin 0.6", 1338)})
    with pytest.raises(report.UnpooledRuns) as refused:  # declared, its code and machine are still unknown
        compare.main(argv)
    assert "margin 0.6 and CE on seed 1338 ran code unknown on unknown and code abc on CPU A" in str(refused.value)
    monkeypatch.setitem(grids.POOLABLE, "records", "the unrecorded run's code and CPU are unknown")
    compare.main(argv)
    table = open(os.path.join(archive, "records.md")).read()
    assert "| margin 0.6 | 2 |" in table
    assert "Runs without a record of what trained them (no run.json; " in table and ": margin 0.6 (seed 1338)." in table


def test_a_pair_of_other_code_or_another_cpu_is_refused_unless_the_grid_pools_them(tmp_path, monkeypatch):
    """A method's run and its baseline's on one seed pair only when they ran one code (commit, and
    the hash of uncommitted changes) on one CPU model; a grid in grids.POOLABLE pairs them, and its
    table names every method's commits and CPUs and why the grid pools them."""
    from tools import identity
    monkeypatch.setitem(grids.GRIDS, "mixed", {"CE": ("config/lowres_ce.py", 2),
                                               "margin 1": ("config/lowres_margin_1.py", 2)})
    archive = str(tmp_path)
    for method, config in (("CE", "config/lowres_ce.py"), ("margin 1", "config/lowres_margin_1.py")):
        for seed in (1337, 1338):
            keys = identity.training_keys(runner.planned_commands(config, seed, []))
            commit = "b" * 40 if (method, seed) == ("margin 1", 1338) else "a" * 40
            archived_run(archive, "mixed", method, seed, config, fake_metrics(0.37, 5.0),
                         run_identity={"training": keys, "commit": commit, "cpu": "CPU A"})
    with pytest.raises(report.UnpooledRuns, match=f"grid mixed: margin 1 and CE on seed 1338 ran code {'b' * 12} "
                                                   f"on CPU A and code {'a' * 12} on CPU A"):
        report.build_table("mixed", archive)
    # before a call trains: a run it would train beside an archived run of other code is refused
    shutil.rmtree(grids.run_dir(archive, "mixed", "margin 1", 1338))
    monkeypatch.setattr(identity, "current_code", lambda: "e" * 40)  # this checkout's, without git
    runner.check_pooled_call("mixed", archive, only={("margin 1", 1337)})  # nothing to train: nothing paired
    with pytest.raises(runner.UnpooledRuns, match=f"grid mixed: margin 1 on seed 1338 would run code {'e' * 12} "
                                                   f"on {identity.cpu_name()}, and its table would pair it with "
                                                   f"CE's archived run, code {'a' * 12} on CPU A"):
        runner.check_pooled_call("mixed", archive)
    monkeypatch.setitem(grids.POOLABLE, "mixed", "one edit of a comment between the two commits")
    runner.check_pooled_call("mixed", archive)
    archived_run(archive, "mixed", "margin 1", 1338, "config/lowres_margin_1.py", fake_metrics(0.37, 5.0),
                 run_identity={"training": identity.training_keys(runner.planned_commands(
                     "config/lowres_margin_1.py", 1338, [])), "commit": "b" * 40, "cpu": "CPU A"})
    table, _ = report.build_table("mixed", archive)
    assert f"| CE | 2 | {'a' * 12} ×2 | CPU A ×2 |" in table
    assert f"| margin 1 | 2 | {'a' * 12}, {'b' * 12} | CPU A ×2 |" in table
    assert "by declaration (tools/grids.py, POOLABLE): one edit of a comment between the two commits." in table
    # a dirty tree's run is its commit and the hash of its changes: unknown where they were not hashed
    assert identity.code("c" * 40 + "+dirty", {"diff_sha256": "d" * 64}) == "c" * 40 + "+" + "d" * 12
    assert identity.code("c" * 40 + "+dirty", {}) == "c" * 40 + "+dirty"
    assert identity.code("c" * 40, {}) == "c" * 40 and identity.short_code("c" * 40 + "+dirty") == "c" * 12 + "+dirty"
    assert identity.known_code("c" * 40 + "+" + "d" * 12) and not identity.known_code("c" * 40 + "+dirty")
    # two runs pair only on one known code and one known CPU model
    known = ("c" * 40, "CPU A")
    assert identity.machine(None) == (identity.UNKNOWN, identity.UNKNOWN)
    assert identity.machine({"code": "c" * 40, "cpu": "CPU A"}) == known
    assert identity.pools(known, known) and not identity.pools(known, ("c" * 40, "CPU B"))
    assert not identity.pools(("c" * 40, identity.UNKNOWN), ("c" * 40, identity.UNKNOWN))
    assert not identity.pools(("c" * 40 + "+dirty", "CPU A"), ("c" * 40 + "+dirty", "CPU A"))
