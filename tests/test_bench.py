"""bench.py runs every objective it times (a smoke test: timings themselves are not asserted)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tools import bench_losses, bench_systems  # noqa: E402
from model import GPTConfig  # noqa: E402
import speed  # noqa: E402


def test_step_time_runs_each_objective():
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16)
    objectives = dict(bench_losses.LOSSES, cwt={"ce_weight": 0.0, "cwt_weight": 1.0})
    for name, kwargs in objectives.items():
        kwargs = {**kwargs, "simreg_chunk_size": 8} if "chunk" in name else kwargs
        assert speed.step_time(config, kwargs, 2, steps=1, warmup=0, device="cpu", dtype="float32") > 0


@pytest.mark.slow
def test_memory_child_reports_growth():
    out = subprocess.run([sys.executable, "-m", "tools.bench", "--memory_child", "1024"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert '"peak_delta_mib"' in out


def test_loss_time_runs_each_term_alone():
    for name, kwargs in bench_losses.LOSSES.items():
        if name == "CE":
            continue
        kwargs = {**kwargs, "simreg_chunk_size": 8} if "chunk" in name else kwargs
        kwargs = {**kwargs, "dispersion_positions": 4} if "positions" in name else kwargs
        assert bench_losses.loss_time(kwargs, n_layer=3, C=16, T=16, V=50, reps=1, device="cpu", dtype="float32") > 0


@pytest.mark.slow
def test_efficiency_child_reports_a_step_and_its_flops():
    out = subprocess.run([sys.executable, "-m", "tools.bench", "--efficiency_child", "lowres", "--steps", "1", "--warmup", "0"],
                         cwd=REPO, capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    result = __import__("json").loads(out.stdout)
    # the lowres CE step: 12 x 64 tokens, 6N + 12 L C T per token with N = 812,416 - 64 x 128 positions
    assert result["seconds"] > 0 and result["flops"] == 12 * 64 * (6 * (812_416 - 64 * 128) + 12 * 4 * 128 * 64)


@pytest.mark.slow
def test_out_writes_the_report_with_how_it_was_made_and_the_goals(tmp_path):
    """--out: the tables of the sections run, under a header naming the command, and each goal
    judged on the number measured in the same call."""
    path = tmp_path / "bench.md"
    args = ["--section", "cwt", "--steps", "1", "--warmup", "0", "--out", str(path)]
    out = subprocess.run([sys.executable, "-m", "tools.bench", *args], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    text = path.read_text()
    assert text.startswith("# What each loss costs") and f"`python -m tools.bench {' '.join(args)}`" in text
    assert "### CWT vs CE at V = 50304" in text
    speed_up = float(next(line for line in text.splitlines() if line.startswith("| CWT (headless)")).split("|")[3][:-2])
    (goal,) = [line for line in text.splitlines() if line.startswith("- CWT step, speed-up over CE")]
    assert goal.endswith(f": {speed_up:.2f}x, {'met' if speed_up >= 2 else 'NOT met'}")
    assert f"wrote {path}" in out


def test_moe_section_times_the_loop_and_the_static_forward_on_the_same_function():
    times = bench_systems.moe_times(C=16, H=32, N=40, steps=1, warmup=0, device="cpu", factors=(1.0, 0.0))
    assert len(times) == 4 and all(t > 0 and 0 <= d < 1 for t, d in times.values())
    assert times["static, capacity_factor 0.0"][1] == times["dropless (sorted by expert)"][1] == 0.0
    # what it times as "before" is the model's function where nothing is dropped
    import torch
    from model import MixtureOfExperts
    torch.manual_seed(0)
    moe = MixtureOfExperts(GPTConfig(arch="llama", n_embd=16, n_head=1, ffn_hidden=32, n_expert=8, top_k=2))
    x = torch.randn(40, 16)
    torch.testing.assert_close(bench_systems.expert_loop(moe, x), moe(x))
