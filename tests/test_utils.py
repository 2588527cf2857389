"""utils: a stop signal during a checkpoint write waits until both files are written."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from utils import stop_signals_deferred  # noqa: E402


def test_ctrl_c_inside_the_block_is_raised_after_it():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with stop_signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("first file")
            steps.append("second file")
        steps.append("after the block")  # never reached: the deferred Ctrl-C is raised first
    assert steps == ["first file", "second file"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the usual handler is back


def test_kill_inside_the_block_ends_the_process_after_it(tmp_path):
    """SIGTERM keeps its default action (the process ends, status -15), only later: both files
    are written, nothing after the block runs."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {REPO!r})
        from utils import save_json, stop_signals_deferred
        with stop_signals_deferred():
            save_json({{"iter_num": 22}}, {str(tmp_path / "ckpt.pt")!r})
            os.kill(os.getpid(), signal.SIGTERM)
            save_json({{"iter_num": 22}}, {str(tmp_path / "ckpt.json")!r})
        save_json({{}}, {str(tmp_path / "after.json")!r})
    """)
    result = subprocess.run([sys.executable, "-c", script])
    assert result.returncode == -signal.SIGTERM
    assert sorted(os.listdir(tmp_path)) == ["ckpt.json", "ckpt.pt"]


def test_an_explicit_device_must_exist():
    import torch
    from utils import choose_device
    assert choose_device("cpu") == "cpu" and choose_device("auto") in ("cpu", "cuda", "mps")
    with pytest.raises(ValueError, match="not one of auto, cpu, cuda"):
        choose_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' was asked for, but this machine has no CUDA device"):
            choose_device("cuda")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            choose_device(f"cuda:{torch.cuda.device_count()}")
