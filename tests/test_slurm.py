"""The Slurm scripts in slurm/, run as sbatch would run them, on one machine: `srun` and `scontrol`
are stand-ins on PATH. The stand-in srun records its flags and the environment its tasks get, then
starts the step's command once per node (two "nodes", one gloo worker each) and, as slurmstepd does
under proctrack/cgroup, passes a signal to every process of the step. The stand-in scontrol names
the nodes (127.0.0.1) and records a requeue. Slurm's warning signal goes to the batch script alone
(`--signal=B:USR1`); the script must pass it on, requeue the job, and the requeued job, the same
command, must go on from the saved step to the uninterrupted run's losses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_distributed import ENV, REPO, TINY, finish
from test_requeue import free_port, launch_nodes
from test_train import train_losses

LONG = ["--parallel=ddp", "--max_iters=200", "--lr_decay_iters=200", "--eval_interval=100",
        "--log_interval=1"]

SRUN = """#!{python}
# stand-in srun: record the flags and the tasks' environment, run the step once per node;
# a signal to srun reaches every process of the step (slurmstepd under proctrack/cgroup);
# with --kill-on-bad-exit=1 a task that fails ends the others (SIGCONT, SIGTERM, SIGKILL)
import os, signal, subprocess, sys, time
args = sys.argv[1:]
with open(os.environ["STANDIN_LOG"], "a") as log:
    print(" ".join(args), file=log)
    print("env PYTORCH_CUDA_ALLOC_CONF=" + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), file=log)
flags = []
while args[0].startswith("--"):
    flags.append(args.pop(0))
tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_NODEID=str(n), SLURM_PROCID=str(n)))
         for n in range(int(os.environ["SLURM_NNODES"]))]


def tree(pid):
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [p for c in children.stdout.split() for p in (int(c), *tree(int(c)))]


def signal_step(signum, frame=None):
    for pid in [p for t in tasks for p in (t.pid, *tree(t.pid))]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


signal.signal(signal.SIGUSR1, signal_step)
failed_at = None
while any(t.poll() is None for t in tasks):
    if failed_at is None and "--kill-on-bad-exit=1" in flags and any(t.returncode for t in tasks):
        failed_at = time.time()
        signal_step(signal.SIGCONT)
        signal_step(signal.SIGTERM)
    if failed_at is not None and time.time() - failed_at > 2:
        signal_step(signal.SIGKILL)
    time.sleep(0.05)
sys.exit(max(t.returncode if t.returncode >= 0 else 128 - t.returncode for t in tasks))
""".replace("{python}", sys.executable)

SCONTROL = r"""#!/bin/bash
# stand-in scontrol: one host name per node; a requeue is recorded
case "$1 $2" in
    "show hostnames") for ((n = 0; n < SLURM_NNODES; n++)); do echo 127.0.0.1; done ;;
    requeue*) echo "requeue $2" >> "$STANDIN_LOG" ;;
esac
"""


def standins(tmp_path):
    """A directory with the stand-in srun and scontrol, and the environment a job would get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # python and torchrun from this interpreter's environment, as a job's module load would give
    path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), ENV["PATH"]])
    return dict(ENV, PATH=path, STANDIN_LOG=str(tmp_path / "standin.log"), SLURM_JOB_ID="4242",
                SLURM_SUBMIT_DIR=str(tmp_path),
                SLURM_NNODES="2", SLURM_JOB_NODELIST="node[01-02]", SLURM_GPUS_ON_NODE="1",
                SLURM_CPUS_PER_TASK="1", RDZV_PORT=str(free_port()))


def submit(script, env, *args):
    """The batch script as sbatch starts it: bash, in the submission directory."""
    return subprocess.Popen(["bash", os.path.join(REPO, "slurm", script), *args], cwd=REPO, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def wait_for_steps(out_dir, steps, limit=300):
    log, t0 = out_dir / "log.jsonl", time.time()
    while not (log.exists() and len(log.read_text().splitlines()) > steps) and time.time() - t0 < limit:
        time.sleep(0.01)


@pytest.mark.slow
def test_the_node_script_binds_cpus_passes_the_warning_on_and_requeues(tmp_path, data_dir):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    reference = launch_nodes(whole, data_dir, *LONG, "--init_from=auto")
    env = standins(tmp_path)
    args = ["config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={stopped}", *TINY, *LONG]
    job = submit("train_nodes.sbatch", env, *args)
    wait_for_steps(stopped, 40)
    signalled = time.time()
    os.kill(job.pid, signal.SIGUSR1)  # --signal=B:USR1: the batch shell alone
    result = finish(job, check=False)
    seconds = time.time() - signalled
    finish(*reference)
    # torchrun's exit after a clean stop; or SIGTERM's, where srun --kill-on-bad-exit ended the other
    # node's torchrun first (its worker had saved: every rank leaves the barrier after the save)
    assert result.returncode in (1, 143), result.stderr[-3000:]
    step = json.loads((stopped / "ckpt.json").read_text())["iter_num"]
    assert 40 <= step < 200 and f"stopped by SIGUSR1 at step {step};" in result.stdout
    assert max(train_losses(stopped)) == step - 1  # every step trained before the stop is in ckpt.pt
    assert "(on each of the 2 nodes) torchrun --nnodes=2 --nproc_per_node=1" in result.stdout
    assert result.stdout.rstrip().endswith("--init_from=resume")
    assert seconds < 30, seconds  # torchrun's default grace; a real run adds one step and its save
    standin = (tmp_path / "standin.log").read_text().splitlines()
    # srun got the CPUs (a step does not inherit them), the one task per node and the order to end
    # every node's task when one fails; the tasks the allocator setting; the job was requeued once
    assert standin[0].startswith("--ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1 ")
    assert f"--rdzv_endpoint=127.0.0.1:{env['RDZV_PORT']} --rdzv_id=4242" in standin[0]
    assert standin[1] == "env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert standin[2:] == ["requeue 4242"]
    # the requeued job: the same command, resumed at the saved step, the uninterrupted run's losses
    env["RDZV_PORT"] = str(free_port())
    result = finish(submit("train_nodes.sbatch", env, *args))
    assert f"resumed from {stopped / 'ckpt.pt'} at iter {step}" in result.stdout
    assert train_losses(stopped) == train_losses(whole)
    assert (tmp_path / "standin.log").read_text().count("requeue") == 1  # a job that ends is not requeued


@pytest.mark.slow
def test_the_one_gpu_script_requeues_a_saved_run_and_not_a_failed_one(tmp_path, data_dir):
    env = standins(tmp_path)
    out = tmp_path / "run"
    args = ["config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={out}", *TINY,
            *LONG[1:]]
    job = submit("train_one_gpu.sbatch", env, *args)
    wait_for_steps(out, 20)
    os.kill(job.pid, signal.SIGUSR1)
    result = finish(job, check=False)
    assert result.returncode == 138, result.stderr[-3000:]
    assert (tmp_path / "standin.log").read_text().splitlines() == ["requeue 4242"]
    step = json.loads((out / "ckpt.json").read_text())["iter_num"]
    result = finish(submit("train_one_gpu.sbatch", env, *args))
    assert f"resumed from {out / 'ckpt.pt'} at iter {step}" in result.stdout
    # a run that fails on its own (a bad key) ends the job without a requeue
    result = finish(submit("train_one_gpu.sbatch", env, *args, "--max_iters=-1"), check=False)
    assert result.returncode == 2 and "max_iters" in result.stderr  # a usage error
    assert (tmp_path / "standin.log").read_text().count("requeue") == 1


def test_every_sbatch_option_a_site_needs_is_in_both_scripts():
    """Slurm reads these lines: memory and CPUs asked for, the warning sent to the script, requeue;
    and the node script names the interface variables where a site sets them."""
    for script in ("train_one_gpu.sbatch", "train_nodes.sbatch"):
        text = open(os.path.join(REPO, "slurm", script)).read()
        options = " ".join(line for line in text.splitlines() if line.startswith("#SBATCH"))
        for option in ("--mem=", "--cpus-per-task=", "--requeue", "--signal=B:USR1@", "--time="):
            assert option in options, (script, option)
    nodes = open(os.path.join(REPO, "slurm", "train_nodes.sbatch")).read()
    assert "NCCL_SOCKET_IFNAME" in nodes and "GLOO_SOCKET_IFNAME" in nodes


def worker(out_dir, rank):
    """The pid of train.py's worker of `rank` writing out_dir (torchrun set RANK in its environment)."""
    for pid in subprocess.run(["pgrep", "-f", str(out_dir)], capture_output=True, text=True).stdout.split():
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} writes {out_dir}")


def hang_rank_1(job, out_dir, after_step):
    """SIGSTOP rank 1 once out_dir's log is past after_step; the job's result and its seconds."""
    wait_for_steps(out_dir, after_step)
    os.kill(worker(out_dir, 1), signal.SIGSTOP)
    stopped = time.time()
    result = finish(job, check=False)
    return result, time.time() - stopped


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_in_seconds_and_it_is_requeued_until_the_budget(tmp_path, data_dir):
    """A rank stopped mid-run (SIGSTOP, as a hung GPU or a lost node looks to the others): the other
    ends within its watchdog's limit with one line, the script requeues the job, and the requeued
    job resumes from the last checkpoint. A job that hangs MAX_HUNG times in a row is not requeued."""
    env = standins(tmp_path)
    out = tmp_path / "run"
    args = ["config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={out}", *TINY, *LONG,
            "--collective_timeout=30", "--checkpoint_interval=10"]
    result, seconds = hang_rank_1(submit("train_nodes.sbatch", env, *args), out, 40)
    assert result.returncode != 0, result.stderr[-3000:]  # torchrun's 1, or a killed task's
    # torchrun puts "[rank0]:" before its workers' lines
    line = next(x for x in result.stderr.splitlines() if "rank 0: no progress for" in x)
    line = line[line.index("rank 0: "):]
    assert "; exiting 75: resume from the last checkpoint" in line
    assert "behind: rank 1" in line or "no rank is behind" in line
    hangs = tmp_path / "slurm-4242.hangs"
    assert line in hangs.read_text().splitlines()
    # within collective_timeout (a step: 20 median steps, at least a tenth of it), then the stand-in's 2 s
    assert seconds < 45, (seconds, line)
    assert (tmp_path / "standin.log").read_text().count("requeue 4242") == 1
    # the requeued job: the same command, from the last checkpoint; it hangs again, and with a budget
    # of two hangs in a row it is not requeued
    step = json.loads((out / "ckpt.json").read_text())["iter_num"]
    env.update(RDZV_PORT=str(free_port()), MAX_HUNG="2")
    result, seconds = hang_rank_1(submit("train_nodes.sbatch", env, *args), out, step + 30)
    assert f"resumed from {out / 'ckpt.pt'} at iter {step}" in result.stdout
    assert "hung 2 times in a row" in result.stderr and result.returncode != 0
    assert (tmp_path / "standin.log").read_text().count("requeue 4242") == 1
    # resubmitted by hand: it goes on to the end
    env["RDZV_PORT"] = str(free_port())
    result = finish(submit("train_nodes.sbatch", env, *args))
    assert json.loads((out / "ckpt.json").read_text())["iter_num"] == 200
