"""The paper-scale configs build at the sizes the SimReg paper's Table 4 (App. A.1) gives: the
model of `train.py --dry_run=True` (plan.py, on the meta device) against a closed-form count."""

import contextlib
import io
import os
import runpy
import subprocess
import sys

import pytest

from errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 50304

# SimReg paper, Table 4: layers, d, FFN, experts (top-2 when > 1, as in Mixtral)
SIZES = {"350m": (24, 1024, 2371, 1), "1b3": (24, 2048, 5461, 1), "3b": (26, 3072, 8640, 1),
         "7b": (32, 4096, 11008, 1), "moe_8x1b": (24, 2048, 5632, 8)}


def expected(L, C, F, E):
    """Attention 4 C^2, each expert 3 C F (SwiGLU), router C E, two RMSNorms per block; untied
    input and output tables V C each, and the final norm."""
    per_block = lambda experts: 4 * C * C + experts * 3 * C * F + (C * E if E > 1 else 0) + 2 * C  # noqa: E731
    return L * per_block(E) + 2 * V * C + C, L * per_block(min(E, 2)) + 2 * V * C + C


def dry_run(config, *extra):
    """train.py in this process (runpy), as `python train.py config --dry_run=True ...` would run it."""
    argv, cwd, out, err = sys.argv, os.getcwd(), io.StringIO(), io.StringIO()
    code = 0
    try:
        os.chdir(REPO)
        sys.argv = ["train.py", config, "--dry_run=True", *extra]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path("train.py", run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int) and e.code is not None:
            err.write(str(e.code))
    except UserError as e:  # what train.py's exception hook (utils.end_on_user_error) prints, and its status
        code = e.status
        err.write(f"error: {e}\n")
    finally:
        sys.argv = argv
        os.chdir(cwd)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.mark.slow
@pytest.mark.parametrize("size", sorted(SIZES))
def test_paper_configs_build_at_their_size(size):
    """The sizes of plan.py's meta-device model (what train.py --dry_run prints first); the
    activation measurement is left out here, test_plan.py covers it."""
    import plan
    from configurator import parse_config, train_defaults
    total, active = expected(*SIZES[size])
    configs = [f"config/baseline_{size}.py", f"config/simreg_{size}.py"] + (["config/simreg_chunk_7b.py"] if size == "7b" else [])
    for config in configs:
        p = plan.make_plan(parse_config([os.path.join(REPO, config)], train_defaults()), measure=False)
        assert (p["params"], p["active_params"]) == (total, active), config
        assert plan.format_plan(p).splitlines()[0].startswith(f"params: {total:,}")
    if size == "7b":  # LLaMA-7B has 6.74B parameters with its 32000-token vocabulary; ours has 50304
        assert total - 2 * (V - 32000) * 4096 == pytest.approx(6.74e9, rel=0.001)


def test_dry_run_needs_a_vocabulary_and_global_batch_must_divide():
    out = dry_run("config/lowres_baseline.py", "--data_dir=/nonexistent")
    assert out.returncode == 2 and "vocab_size" in out.stderr and "/nonexistent" in out.stderr
    out = dry_run("config/baseline_350m.py", "--batch_size=3")
    assert out.returncode == 2 and "global_batch_size" in out.stderr and "multiple" in out.stderr
    out = dry_run("config/baseline_350m.py", "--arch=mamba")
    assert out.returncode == 2 and "arch" in out.stderr
