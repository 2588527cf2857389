"""Several torchrun "nodes" on one machine: two agents of one gloo process each, joined by a
rendezvous on 127.0.0.1, run with the same command every time (--init_from=auto). Rank 0 alone
decides whether a job resumes or starts, and from which checkpoint: ranks whose view of out_dir
differs (here: two working directories and a relative out_dir) follow it or stop together. The
preempted and requeued job, through slurm/'s scripts: tests/test_slurm.py."""

import functools
import os
import shutil
import socket
import subprocess
import sys

import pytest

from test_distributed import ENV, REPO, TINY, finish, launch
from test_train import train_losses

LONG = ["--parallel=ddp", "--max_iters=200", "--lr_decay_iters=200", "--eval_interval=100",
        "--log_interval=1", "--init_from=auto"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(out_dir, data_dir, *args, rendezvous="c10d", cwds=(REPO, REPO)):
    """Two torchrun agents, one worker each, as srun starts one per node: a c10d rendezvous as the
    Slurm script has it, or a static one (node 0 is rank 0: to give rank 0 a chosen view)."""
    port = free_port()
    join = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=job42"] \
        if rendezvous == "c10d" else ["--master_addr=127.0.0.1", f"--master_port={port}"]
    train = [os.path.join(REPO, "train.py"), os.path.join(REPO, "config/lowres_baseline.py"),
             f"--data_dir={data_dir}", f"--out_dir={out_dir}", *TINY, *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", *join]
    if torchrun_handles_signals():
        torchrun += ["--signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown_timeout=240"]
    else:  # docs/runs.md's wrapper for a torchrun without the option: SIGUSR1 ignored by torchrun, whose
        torchrun = ["bash", "-c", 'trap "" USR1; exec "$@"', "bash", *torchrun]  # workers install their own
    return [subprocess.Popen([*torchrun, f"--node_rank={node}", *train], cwd=cwd, env=ENV, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node, cwd in enumerate(cwds)]


@functools.cache
def torchrun_handles_signals():
    """Whether this torch's torchrun has --signals_to_handle (2.13 has it; 2.6, the floor, does not)."""
    usage = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                           text=True).stdout
    return "--signals_to_handle" in usage


@pytest.mark.slow
def test_every_rank_takes_rank_0s_decision_to_start_or_resume(tmp_path, data_dir):
    """out_dir is relative and the nodes run in two directories: rank 1's out_dir holds a complete
    run, rank 0's none. Rank 0 starts fresh and rank 1 with it (alone it would resume, find the run
    complete and leave): the run is the one it would be anywhere. The other way round, rank 0
    resumes and rank 1, which sees no checkpoint, stops every rank with one line; nothing changes."""
    empty, holding = tmp_path / "empty", tmp_path / "holding"
    empty.mkdir()
    first = holding / "out" / "run"
    finish(launch(first, data_dir, "--parallel=ddp", processes=2))  # complete: step 6 of 6
    results = finish(*launch_nodes("out/run", data_dir, "--parallel=ddp", "--init_from=auto",
                                   rendezvous="static", cwds=(empty, holding)))
    assert "resumed" not in results[0].stdout and "complete run" not in results[1].stdout
    assert train_losses(empty / "out" / "run") == train_losses(first)
    # rank 0 resumes (a longer run), rank 1 finds nothing to resume from
    shutil.rmtree(empty / "out")
    before = (first / "log.jsonl").read_bytes()
    results = finish(*launch_nodes("out/run", data_dir, "--parallel=ddp", "--init_from=auto", "--max_iters=8",
                                   rendezvous="static", cwds=(holding, empty)), check=False)
    assert [r.returncode for r in results] == [1, 1]
    assert ("error: cannot resume: rank 0 resumes from step 6 of out/run/ckpt.pt, but rank 1 finds: no "
            "checkpoint at out/run/ckpt.pt. Every rank must see out_dir as rank 0 does") in results[0].stderr
    assert (first / "log.jsonl").read_bytes() == before and not (empty / "out" / "run" / "log.jsonl").exists()


def test_the_resume_command_reads_the_launch_from_the_environment_without_torchrun_as_parent(monkeypatch):
    """Where torchrun's command line cannot be read (this process's parent is not torchrun), the
    resume command gives the shape torchrun put in the environment: nodes and processes per node."""
    import run
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert run.resume_command(["train.py", "config/simreg_7b.py", "--init_from=auto"], 16) == \
        ("(on each of the 2 nodes) torchrun --nnodes=2 --nproc_per_node=8 train.py config/simreg_7b.py "
         "--init_from=resume")
    for name in ("TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert run.resume_command(["train.py", "--overwrite=True"], 1) == "python train.py --init_from=resume"
