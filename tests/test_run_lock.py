"""One writer per out_dir, and the one command a requeued job runs (issue 27). Real processes on
real files: two runs started together on one out_dir (one runs, the other refuses in one line
naming the holder); a run killed with -9 goes on with --init_from=auto as if never stopped; a file
as out_dir is one line; under torchrun a save that fails on rank 0 ends every rank."""

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from test_reliability import (ENV, LONG, assert_same_run, command, logged_step, snapshot, trajectory,
                              uninterrupted, wait_for)  # noqa: F401
from test_train import REPO, TINY, read_log, train

import parallelism  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.py)

FSDP_REFUSED = parallelism.fsdp_unavailable("cpu")  # None, or why this torch cannot run FSDP on the CPU (< 2.7)

SHORT = ["--max_iters=30", "--lr_decay_iters=30", "--eval_interval=10", "--final_eval=False"]


def one_error_line(stderr):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    return lines[0]


def test_two_runs_on_one_out_dir_one_runs_the_other_refuses(tmp_path, data_dir):  # noqa: F811
    alone = str(tmp_path / "alone")
    train(alone, data_dir, *SHORT)
    out = str(tmp_path / "shared")
    processes = [subprocess.Popen(command(out, data_dir, *SHORT), cwd=REPO, env=ENV, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [(p, *p.communicate(timeout=300)) for p in processes]
    assert sorted(p.returncode for p, _, _ in results) == [0, 1], [e[-2000:] for _, _, e in results]
    winner, loser = sorted(results, key=lambda r: r[0].returncode)
    message = one_error_line(loser[2])
    assert f"{out} is in use by a run that is still going (pid {winner[0].pid} on " in message
    assert "Traceback" not in winner[2]
    assert trajectory(out) == trajectory(alone)  # every step once, each as when the run was alone
    assert [r["iter"] for r in read_log(out)] == [r["iter"] for r in read_log(alone)]


def test_a_live_run_is_not_overwritten_and_its_files_stay(tmp_path, data_dir):  # noqa: F811
    """--overwrite=True does not break a live lock; the refused run changes nothing in out_dir."""
    out = str(tmp_path / "live")
    holder = subprocess.Popen(command(out, data_dir, *LONG, "--final_eval=False"), cwd=REPO, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: logged_step(out) >= 5, holder)
        holder.send_signal(signal.SIGSTOP)  # nothing changes while the second run looks
        before = snapshot(out)
        with open(os.path.join(out, "run.lock")) as f:
            lock = f.read()
        result = subprocess.run(command(out, data_dir, *SHORT, "--overwrite=True"), cwd=REPO, env=ENV,
                                capture_output=True, text=True)
        assert result.returncode == 1
        assert f"(pid {holder.pid} on " in one_error_line(result.stderr)
        assert snapshot(out) == before
        with open(os.path.join(out, "run.lock")) as f:
            assert f.read() == lock
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait()


def test_auto_resumes_after_kill_9_and_starts_an_empty_out_dir(tmp_path, data_dir, uninterrupted):  # noqa: F811
    """The same command every time: on an empty out_dir it starts the run, after a kill -9 (the
    dead run's lock is no obstacle) it resumes, and the result equals the uninterrupted run."""
    out = str(tmp_path / "auto")
    same_command = command(out, data_dir, *LONG, "--final_eval=False", "--init_from=auto")
    process = subprocess.Popen(same_command, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert wait_for(lambda: logged_step(out) >= 70, process)
    process.kill()
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    result = subprocess.run(same_command, cwd=REPO, env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout
    assert_same_run(out, uninterrupted)


def test_auto_starts_a_run_stopped_before_its_first_checkpoint_again_and_keeps_its_log(tmp_path, data_dir):  # noqa: F811
    """A run stopped after its step-0 log line but before its first ckpt.pt (a kill, a preemption during the
    step-0 evaluation): --init_from=auto once refused every time until --overwrite=True, and a requeue loop
    ended there. Now it starts the run again, keeping what the stopped one wrote in restarted_1/ (twice:
    restarted_2/); an explicit --init_from=resume says that auto does this."""
    out = tmp_path / "no_ckpt"
    out.mkdir()
    (out / "log.jsonl").write_text('{"iter": 0, "loss": 1.0}\n')
    result = subprocess.run(command(str(out), data_dir, *SHORT, "--init_from=resume"), cwd=REPO, env=ENV,
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "--init_from=auto starts a run stopped before its first checkpoint again" in one_error_line(result.stderr)
    result = subprocess.run(command(str(out), data_dir, *SHORT, "--init_from=auto"), cwd=REPO, env=ENV,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"what it wrote is in {out / 'restarted_1'}" in result.stdout
    assert (out / "restarted_1" / "log.jsonl").read_text() == '{"iter": 0, "loss": 1.0}\n'
    assert (out / "ckpt.pt").exists() and json.loads((out / "log.jsonl").read_text().splitlines()[0])["iter"] == 0
    for name in ("ckpt.pt", "ckpt.json", "ckpt_prev.pt", "ckpt_prev.json"):
        (out / name).unlink(missing_ok=True)
    result = subprocess.run(command(str(out), data_dir, *SHORT, "--init_from=auto"), cwd=REPO, env=ENV,
                            capture_output=True, text=True)
    assert result.returncode == 0 and (out / "restarted_2" / "log.jsonl").exists() and (out / "ckpt.pt").exists()


def test_a_file_as_out_dir_is_one_line(tmp_path, data_dir):  # noqa: F811
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    result = subprocess.run(command(str(path), data_dir, *SHORT), cwd=REPO, env=ENV, capture_output=True, text=True)
    assert result.returncode == 1
    assert f"out_dir {path} is a file" in one_error_line(result.stderr)
    assert path.read_text() == "not a directory\n"
    # a directory that cannot be made (under a file; the same branch as one the user may not write)
    result = subprocess.run(command(str(path / "run"), data_dir, *SHORT), cwd=REPO, env=ENV, capture_output=True,
                            text=True)
    assert result.returncode == 1
    assert f"cannot use {path / 'run'} as a run's directory (Not a directory)" in one_error_line(result.stderr)
    assert path.read_text() == "not a directory\n"


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(
    FSDP_REFUSED is not None, reason=FSDP_REFUSED or ""))])
def test_a_failed_save_ends_every_rank(tmp_path, data_dir, parallel):  # noqa: F811
    """torchrun, 2 gloo processes: a checkpoint write fails (a file-size limit, as on a full disk:
    rank 0's ckpt.pt under DDP, every rank's shards under FSDP); both ranks exit 1 at once with
    one message, and every file of the previous checkpoints is intact."""
    out = tmp_path / parallel
    args = ["--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--final_eval=False", f"--parallel={parallel}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                "config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={out}", *TINY]
    first = subprocess.run([*torchrun, *args], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file() and path.suffix != ".jsonl"
              and path.name != "run.lock"}
    assert {"ckpt.pt", "ckpt_prev.pt", "best.pt"} <= {path.name for path in before}
    limit = min(len(data) for path, data in before.items() if path.suffix in (".pt", ".distcp")) // 2

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    t0 = time.time()
    result = subprocess.run([*torchrun, *args, "--max_iters=8", "--init_from=auto"], cwd=REPO, env=ENV,
                            capture_output=True, text=True, preexec_fn=limit_file_size, timeout=300)
    assert result.returncode != 0
    failed = f"{out / 'ckpt.pt'}" if parallel == "ddp" else f"the shards in {out / 'ckpt_dcp'}"
    assert result.stderr.count(f"error: cannot write {failed}") == 1, result.stderr[-3000:]
    assert "exitcode  : 1" in result.stderr and "exitcode  : -" not in result.stderr, result.stderr[-3000:]
    assert 'train.py", line' not in result.stderr and "checkpoint.py" not in result.stderr  # (torchrun's own)
    assert {path: path.read_bytes() for path in before} == before
    assert time.time() - t0 < 120
