"""Run train.py through its set-up and stop there: right after parallelism.parallelize returns (the
model built, initialised and sharded), each process prints the peak of its resident memory so far
(VmHWM) and every process exits 0. Under torchrun, from the repository root:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/setup_peak.py train.py ARGS

With --then_train first (tests/setup_peak.py --then_train train.py ARGS) train.py goes on after the
print, as it would have: one run both measures its set-up and writes its checkpoints.
"""

import os
import runpy
import sys

sys.path.insert(0, os.getcwd())  # train.py's modules (the script's own folder is tests/)
import parallelism  # noqa: E402

parallelize = parallelism.parallelize


def parallelize_then_stop(*args, **kwargs):
    model_and_objective = parallelize(*args, **kwargs)
    with open("/proc/self/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    # one write of the whole line: print() writes the text and its newline apart, and under
    # PYTHONUNBUFFERED the two processes' lines could run together on the shared pipe
    sys.stdout.write(f"setup peak rss rank {os.environ.get('RANK', 0)}: {peak_kib * 1024} bytes\n")
    sys.stdout.flush()
    if then_train:
        return model_and_objective
    parallelism.shutdown()
    sys.exit(0)


then_train = sys.argv[1] == "--then_train"
parallelism.parallelize = parallelize_then_stop
sys.argv = sys.argv[2:] if then_train else sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
