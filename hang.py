"""
A hung or lost rank ends the run in minutes, not after the process
group's 30: the other ranks wait inside a collective, so a thread on
each of them watches how long the loop stays in one part, and ends the
rank with one line and exit status HUNG, which the Slurm script
requeues on. Design notes: docs/runs.md#a-hung-rank.
"""

import collections
import datetime
import os
import statistics
import sys
import threading
import time

import torch.distributed as dist

HUNG = 75  # sysexits' EX_TEMPFAIL: try again (requeue, resume)
MEASURED_STEPS = 5  # steps timed before a step gets its own limit
STORE_TIMEOUT_S = 10  # reading the other ranks' steps, at the end


def limit_s(part, step_seconds, timeout, factor):
    """How long the loop may stay in `part`: `factor` median steps for a
    training step once MEASURED_STEPS are timed, never under a tenth of
    `timeout` (a slow batch, a log write) nor over it; `timeout` seconds
    for anything else (the first steps and their compilation, an
    evaluation batch, the stop vote and a save)."""
    if part != "training" or not factor or len(step_seconds) < MEASURED_STEPS:
        return timeout
    typical = factor * statistics.median(step_seconds)
    return min(timeout, max(typical, timeout / 10))


class Watchdog:
    """The training loop calls enter(part, step) at each change of part;
    a daemon thread ends this rank when a part outlasts limit_s. Every
    rank records where it is in torchrun's store, so that the line can
    name the ranks that are behind."""

    PARTS = ("starting", "evaluating", "saving", "training")  # a step's order

    def __init__(self, timeout, factor, rank, world_size):
        self.timeout = timeout
        self.factor = factor
        self.rank = rank
        self.world_size = world_size
        self.step_seconds = collections.deque(maxlen=100)
        self.now = ("starting", 0, time.monotonic())  # part, step, since
        self.store = None  # one process: nobody to wait for, no thread
        if world_size > 1:
            self.store = connect_store()
            self.store.set(f"watchdog/{rank}", "0 starting")
            threading.Thread(target=self._watch, daemon=True).start()

    def enter(self, part, step):
        part_before, step_before, since = self.now
        now = time.monotonic()
        if part_before == "training":
            self.step_seconds.append(now - since)
        self.now = (part, step, now)  # one assignment: the thread reads it
        if self.store is not None and (part, step) != (part_before, step_before):
            self.store.set(f"watchdog/{self.rank}", f"{step} {part}")

    def stop(self):
        """The loop is over: what follows waits for no other rank."""
        self.now = ("done", 0, 0.0)

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.timeout / 100))
            part, step, since = self.now
            if part == "done":
                return
            waited = time.monotonic() - since
            limit = limit_s(part, list(self.step_seconds), self.timeout,
                            self.factor)
            if waited > limit:
                self._end(part, step, waited, limit)

    def _behind(self, part, step):
        """The ranks that are behind this one, in words. A new client:
        the main thread may hold the first inside a call that hangs."""
        try:
            store = connect_store()
            where = [store.get(f"watchdog/{r}").decode().split()
                     for r in range(self.world_size)]
        except (RuntimeError, ValueError) as e:
            return f"where the other ranks are is unknown ({e})"
        late = [f"rank {r} ({p} at step {s})"
                for r, (s, p) in enumerate(where)
                if (int(s), self.PARTS.index(p))
                < (step, self.PARTS.index(part))]
        if not late:
            return "no rank is behind (one is stuck inside this part)"
        return "behind: " + ", ".join(late)

    def _end(self, part, step, waited, limit):
        line = (f"rank {self.rank}: no progress for {waited:.1f} s while "
                f"{part} at step {step} (limit {limit:.1f} s); "
                f"{self._behind(part, step)}; exiting {HUNG}: resume "
                f"from the last checkpoint")
        print(line, file=sys.stderr, flush=True)
        # the launcher's file: torchrun's own exit status hides ours
        if path := os.environ.get("TRAIN_HANG_FILE"):
            with open(path, "a") as f:
                f.write(line + "\n")
        os._exit(HUNG)


def connect_store():
    """A client of the rendezvous store torchrun started."""
    return dist.TCPStore(os.environ["MASTER_ADDR"],
                         int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
