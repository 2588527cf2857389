"""The test tiers, a pytest plugin loaded by conftest.py.

The quick tier, `python -m pytest -m "not slow"`, is what a contributor runs while working. A test
is marked slow by what it does: it starts a process (train.py, torchrun, a tool's command line, git)
or computes for more than QUICK_CPU_SECONDS. An unmarked test that does either fails with a line
that says so, so the tiers cannot drift apart. CPU time (all of this process's threads), not wall
time: a busy machine slows a test without making it fail.
"""

import os
import resource
import subprocess
import traceback

import pytest

QUICK_CPU_SECONDS = 10


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a process or computes for more than "
                                       f"{QUICK_CPU_SECONDS} CPU-seconds (deselect with -m 'not slow')")


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test not marked slow: failed as soon as it starts a process, and after it when it took more
    than QUICK_CPU_SECONDS of CPU time (pytest_runtest_makereport)."""
    if item.get_closest_marker("slow"):
        yield
        return
    original = subprocess.Popen.__init__

    def refused(self, args, *rest, **kwargs):
        if any(os.sep + "torch" + os.sep in frame.filename for frame in traceback.extract_stack()):
            return original(self, args, *rest, **kwargs)  # torch's own workers (compilation), not the test's
        command = args if isinstance(args, str) else " ".join(map(str, args))
        pytest.fail(f"{item.nodeid} is in the quick tier but starts a process ({command[:120]}): "
                    "mark it @pytest.mark.slow", pytrace=False)
    subprocess.Popen.__init__ = refused
    t0 = cpu_seconds()
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original
        item.quick_cpu_seconds = cpu_seconds() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    used = getattr(item, "quick_cpu_seconds", None)
    if call.when == "call" and report.passed and used is not None and used > QUICK_CPU_SECONDS:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is in the quick tier but took {used:.1f} CPU-seconds (at most "
                           f"{QUICK_CPU_SECONDS}): mark it @pytest.mark.slow")


def pytest_terminal_summary(terminalreporter):
    """Each tier's test time (summed over its tests' setup, call and teardown; with pytest-xdist the
    workers share it), so a test that makes the quick tier slow is seen where it happens."""
    tiers = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) is None:
                continue
            tier = "slow" if "slow" in report.keywords else "quick"
            tests, seconds = tiers.get(tier, (0, 0.0))
            tiers[tier] = (tests + (report.when == "call"), seconds + report.duration)
    for tier, (tests, seconds) in sorted(tiers.items()):
        terminalreporter.write_line(f"{tier} tier: {tests} tests, {seconds:.0f} s of test time")
