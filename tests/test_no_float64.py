"""No float64 tensor on a device that has none (Apple MPS): a real train.py run with separated
embeddings (its SE optimizer steps, evaluations during training and final evaluation) and the
one-language evaluation, in memory and streamed.

There is no MPS device here, so the test simulates one: utils.has_float64 is patched to say that
the CPU has no float64, and a TorchDispatchMode records every op whose outputs include a float64
tensor on the CPU. In this simulation the CPU is both the model's device and the host, so a float64
tensor made after moving data "to the CPU" cannot be told from one made on the device: the test
forbids float64 tensors altogether. That is why the code never assumes that the CPU has float64
either: every statistic takes its dtype from utils.widest_float of the device it is computed on.
On a real Mac the statistics computed on the CPU stay float64 and those computed on MPS are float32
(tests/test_float32_stats.py bounds the difference)."""

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

import scoring
import utils
from checkpoint import load_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the driver: the CPU counts as a device without float64, then train.py runs under the recorder
DRIVER = """
import json, runpy, sys
import torch
sys.path[:0] = [{repo!r}, {tests!r}]
import utils
utils.has_float64 = lambda device: torch.device(device).type != "cpu"
from test_no_float64 import Float64Recorder
report, sys.argv = sys.argv[1], ["train.py", *sys.argv[2:]]
recorder = Float64Recorder()
try:
    with recorder:
        runpy.run_path("train.py", run_name="__main__")
finally:
    with open(report, "w") as f:
        json.dump({{"float64": recorder.float64, "ops": sorted(recorder.ops)}}, f)
"""

RUN = ["config/lowres_margin_0.6_se.py", "--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=16",
       "--block_size=16", "--batch_size=4", "--eval_interval=2", "--eval_iters=1", "--warmup_iters=1",
       "--lr_decay_iters=4", "--max_iters=4", "--log_interval=1", "--num_threads=1", "--log_marginalization=True"]


class Float64Recorder(TorchDispatchMode):
    """Records each op whose outputs include a float64 tensor on `device`, with the repository's
    frames that called it, and the names of all the ops it saw (to check what ran under it)."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.device, self.float64, self.ops = torch.device(device), [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.device == self.device
               for t in _pytree.tree_leaves(out)):
            frames = [f"{os.path.relpath(f.filename, REPO)}:{f.lineno}" for f in traceback.extract_stack()
                      if f.filename.startswith(REPO) and not f.filename.startswith(os.path.join(REPO, "tests"))]
            self.float64.append(f"{func} at {' < '.join(reversed(frames[-3:]))}")
        return out


@pytest.fixture(scope="module")
def se_run(tmp_path_factory, data_dir):
    """train.py with SE, per-step gradient parts and its final evaluation, the CPU lacking float64."""
    root = tmp_path_factory.mktemp("no_float64")
    driver, report, out = root / "driver.py", root / "report.json", root / "run"
    driver.write_text(DRIVER.format(repo=REPO, tests=os.path.join(REPO, "tests")))
    result = subprocess.run([sys.executable, str(driver), str(report), *RUN, f"--data_dir={data_dir}",
                             f"--out_dir={out}"], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(report) as f:
        return str(out), json.load(f)


def test_has_float64():
    assert not utils.has_float64("mps") and not utils.has_float64(torch.device("mps"))
    assert utils.has_float64("cpu") and utils.has_float64("cuda:1")
    assert utils.widest_float("mps") == torch.float32 and utils.widest_float("cpu") == torch.float64


def test_training_run_with_separated_embeddings_makes_no_float64(se_run):
    out, report = se_run
    assert report["float64"] == [], "float64 on the device:\n" + "\n".join(report["float64"][:20])
    # what ran under the recorder: the SE optimizer (its bias corrections), the final evaluation
    # (isotropy's eigh, the hidden states' cosine histograms)
    assert {"aten.expm1.default", "aten._linalg_eigh.default", "aten.histc.default"} <= set(report["ops"])
    assert {"metrics.json", "marginalization.json"} <= set(os.listdir(out))


@pytest.mark.parametrize("streamed", [False, True])
def test_one_language_evaluation_makes_no_float64(se_run, data_dir, monkeypatch, streamed):
    """The path of a one-language (e.g. GPT-2 BPE) run: rare-target metrics, and the streamed
    evaluation that recomputes the logits chunk by chunk when they are too many to hold."""
    out, _ = se_run
    model, checkpoint = load_model(os.path.join(out, "best.pt"))
    monkeypatch.setattr(utils, "has_float64", lambda device: torch.device(device).type != "cpu")
    monkeypatch.setattr(scoring, "RARE_MAX_COUNT", 10 ** 9)  # every target rare: the small text has no rare one
    if streamed:
        monkeypatch.setattr(scoring, "STREAM_ABOVE", 0)
    with Float64Recorder() as recorder:
        result = scoring.evaluate_model(model, data_dir, False, checkpoint["meta"]["itos"])
    assert recorder.float64 == [], "float64 on the device:\n" + "\n".join(recorder.float64[:20])
    assert result["val"]["ppl_best"] <= result["val"]["ppl"] and result["rare"]["tokens"] > 0
