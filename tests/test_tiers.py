"""tiers.py, the quick tier's check: run on small test files by pytest itself (pytester)."""

import os

import pytest

import tiers

pytest_plugins = ["pytester"]

TESTS = '''
import subprocess
import time

import os

import pytest


def test_quick():
    assert 1 + 1 == 2


def test_starts_a_process():
    subprocess.run(["true"], check=True)


def test_starts_a_process_and_catches_everything():
    try:
        subprocess.run(["true"], check=True)
    except Exception:
        pass


@pytest.mark.slow
def test_marked_slow_starts_a_process():
    subprocess.run(["true"], check=True)


def test_computes():
    t0 = time.process_time()
    while time.process_time() - t0 < 0.5:
        pass


@pytest.mark.slow
def test_marked_slow_computes():
    t0 = time.process_time()
    while time.process_time() - t0 < 0.5:
        pass
'''


@pytest.mark.slow  # its inner tests start processes while it runs
def test_an_unmarked_test_that_starts_a_process_or_computes_long_fails_and_says_why(pytester, monkeypatch):
    monkeypatch.setattr(tiers, "QUICK_CPU_SECONDS", 0.2)
    pytester.makepyfile(test_inner=TESTS)
    result = pytester.runpytest("-p", "tiers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=3)
    out = result.stdout.str()
    for name in ("test_starts_a_process", "test_starts_a_process_and_catches_everything"):
        assert f"test_inner.py::{name} is in the quick tier but starts a process (true): mark it " \
               "@pytest.mark.slow" in out
    assert "test_inner.py::test_computes is in the quick tier but took 0." in out
    assert "CPU-seconds (at most 0.2): mark it @pytest.mark.slow" in out
    # the quick tier deselects what is marked, and runs the rest
    quick = pytester.runpytest("-p", "tiers", "-p", "no:cacheprovider", "-m", "not slow")
    quick.assert_outcomes(passed=1, failed=3, deselected=2)


def test_every_test_the_floor_skips_exists():
    """tests/floor_skip.txt (written by tests/torch_use.py) names tests by node id: one renamed or
    removed since would leave a stale line, and its new name would run on the floor unmeasured."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "tests", "floor_skip.txt")) as f:
        lines = f.read().splitlines()
    assert lines, "tests/floor_skip.txt is empty: run python tests/torch_use.py"
    for line in lines:
        path, name = line.split("::")
        with open(os.path.join(repo, path)) as f:
            source = f.read()
        assert f"def {name.split('[')[0]}(" in source, \
            f"tests/floor_skip.txt names {line}, which {path} no longer has: run python tests/torch_use.py"
