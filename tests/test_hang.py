"""hang.py's watchdog: the limit each part of the loop gets, and a rank that outlasts it ends with
one line naming the ranks behind it, exit status 75, and the line in the launcher's file."""

import re
import subprocess
import sys
import textwrap

import pytest

from hang import HUNG, MEASURED_STEPS, limit_s
from test_distributed import ENV, REPO
from test_requeue import free_port


def test_a_step_gets_factor_median_steps_within_a_tenth_of_the_timeout_and_the_timeout():
    timeout = 600.0
    steps = [0.5, 0.6, 0.4, 9.0, 0.5]  # median 0.5: one slow step does not move it
    assert limit_s("training", steps, timeout, 20) == 60.0  # a tenth of the timeout, not 20 x 0.5
    assert limit_s("training", steps, timeout, 200) == 100.0  # 200 x 0.5
    assert limit_s("training", steps, timeout, 2000) == timeout  # never over the timeout
    assert limit_s("training", steps[:MEASURED_STEPS - 1], timeout, 20) == timeout  # not yet timed
    assert limit_s("training", steps, timeout, 0) == timeout  # hang_factor 0: the timeout alone
    for part in ("starting", "evaluating", "saving"):
        assert limit_s(part, steps, timeout, 200) == timeout


RANK_0 = """
import os, statistics, sys, time
import torch.distributed as dist
from hang import Watchdog
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True)
store.set("watchdog/1", "3 training")  # rank 1 began step 3 and was not heard of again
watchdog = Watchdog(timeout=5.0, factor=20, rank=0, world_size=2)
for step in range(8):  # 0.05 s each: the limit is then 20 x 0.05 = 1 s
    watchdog.enter("training", step)
    time.sleep(0.05)
watchdog.enter("saving", 8)
watchdog.enter("training", 8)
print(statistics.median(watchdog.step_seconds), flush=True)  # of the 8 steps timed
time.sleep(30)
"""


@pytest.mark.slow
def test_a_rank_past_its_limit_ends_with_one_line_naming_the_ranks_behind(tmp_path):
    hang_file = tmp_path / "hangs"
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TRAIN_HANG_FILE=str(hang_file),
               PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(RANK_0)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == HUNG == 75, result.stderr
    median = float(result.stdout)
    line, = result.stderr.splitlines()
    waited, limit = map(float, re.match(r"rank 0: no progress for (\S+) s while training at step 8 "
                                        r"\(limit (\S+) s\); ", line).groups())
    # 20 median steps (a tenth of the timeout is 0.5 s, the timeout 5 s); the thread looks every 0.05 s
    assert limit == pytest.approx(min(max(20 * median, 0.5), 5.0), abs=0.05) and limit >= 1.0
    assert limit <= waited < limit + 1
    assert line.endswith("; behind: rank 1 (training at step 3); exiting 75: resume from the last checkpoint")
    assert hang_file.read_text() == line + "\n"
