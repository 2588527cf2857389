"""utils: stop signals become a request the training loop reads; an explicit device must exist."""

import os
import signal

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from utils import StopRequest  # noqa: E402


def test_a_stop_signal_is_noted_not_acted_on_and_a_second_one_ends_at_once(capsys):
    stop = StopRequest()
    try:
        assert stop.signum is None and stop.name is None
        os.kill(os.getpid(), signal.SIGUSR1)  # a scheduler's warning
        assert stop.signum == signal.SIGUSR1 and stop.name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGUSR1)  # a repeated warning is the same request
        assert stop.signum == signal.SIGUSR1
        with pytest.raises(SystemExit) as ended:  # then the scheduler's SIGTERM: now
            os.kill(os.getpid(), signal.SIGTERM)
        assert ended.value.code == 128 + signal.SIGTERM
        assert "SIGTERM while a stop was pending: ending now" in capsys.readouterr().err
        stop.signum = None
        os.kill(os.getpid(), signal.SIGINT)  # the default action would interrupt
        assert stop.name == "SIGINT"
        with pytest.raises(SystemExit) as ended:  # pressed again: the user means it
            os.kill(os.getpid(), signal.SIGINT)
        assert ended.value.code == 128 + signal.SIGINT
    finally:
        stop.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


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


def test_auto_dtype_is_bf16_on_a_gpu_with_it_float16_on_one_without_float32_elsewhere(monkeypatch):
    import torch

    from utils import choose_dtype
    assert choose_dtype("auto", "cpu") == "float32" and choose_dtype("auto", "mps") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_dtype("auto", "cuda:0") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # V100, T4
    assert choose_dtype("auto", "cuda") == "float16"
    assert choose_dtype("float32", "cuda") == "float32"  # an explicit dtype is kept
