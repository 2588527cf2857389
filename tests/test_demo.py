"""tools/demo.py, the lecture's demo: both runs train, and their rare rows' Ratio of Average is
printed side by side from each run's marginalization.json; a failing run is one message."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo(tmp_path, data_dir, *args):
    return subprocess.run([sys.executable, "-m", "tools.demo", f"--out_dir={tmp_path / 'demo'}",
                           f"--data_dir={data_dir}", "--n_layer=1", "--n_embd=16", "--n_head=2",
                           "--block_size=16", "--batch_size=4", "--warmup_iters=2", *args],
                          cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_the_demo_prints_each_runs_ratio_of_average(tmp_path, data_dir):
    result = demo(tmp_path, data_dir, "--max_iters=6", "--rows=3")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    reports = {name: json.loads((tmp_path / "demo" / folder / "marginalization.json").read_text())
               for name, folder in (("CE", "CE"), ("margin 0.6", "margin_0.6"))}
    rarest = reports["CE"]["tokens_rarest_first"]
    rows = [line for line in lines if line.lstrip().startswith(repr(rarest[0]["char"]))]
    assert len(rows) == 1 and rows[0].split()[1] == str(rarest[0]["train_count"])
    means = next(line for line in lines if line.strip().startswith("all rows")).split()[2:4]
    assert means == [f"{reports[n]['mean_ratio_of_average']:.3f}" for n in reports]
    assert sum(line.strip().startswith("'") for line in lines) == 3


def test_a_failing_run_is_one_message(tmp_path, data_dir):
    result = demo(tmp_path, data_dir, "--max_iters=6", "--learning_rate=-1")
    assert result.returncode == 1 and "the CE run failed" in result.stderr and "learning_rate" in result.stderr
