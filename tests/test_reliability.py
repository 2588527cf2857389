"""A run never loses or misreports work. Real processes, real signals, real files:
kill -9 at random moments (inside checkpoint writes too) and resume bit-identically; SIGTERM,
SIGINT, SIGUSR2 and SIGHUP (a closed terminal too) save and resume bit-identically; a full disk leaves the previous checkpoint intact; an
unreadable latest checkpoint falls back to the previous one; every bad input is one line, a
conventional exit status, and no file changed."""

import contextlib
import hashlib
import json
import os
import pty
import random
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from test_train import REPO, TINY, read_log, train

sys.path.insert(0, REPO)
import utils  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1")
# long enough to interrupt: 200 steps, an evaluation every 50, a full checkpoint every step
LONG = ["--max_iters=200", "--lr_decay_iters=200", "--eval_interval=50", "--checkpoint_interval=1"]


def command(out_dir, data, *args):
    return [sys.executable, "train.py", "config/lowres_baseline.py", f"--data_dir={data}", f"--out_dir={out_dir}",
            *TINY, *args]


def snapshot(*directories):
    """Every file under the directories, path -> bytes; not run.lock, which names the last run that
    held out_dir (a run that refuses after taking the lock names itself there)."""
    files = {}
    for directory in directories:
        for root, _, names in os.walk(directory):
            for name in names:
                if name == "run.lock":
                    continue
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    files[path] = f.read()
    return files


def trajectory(out_dir):
    """What must not depend on interruptions: every logged training loss and every evaluation."""
    return [{k: v for k, v in r.items() if k in ("iter", "loss", "val", "val_high", "val_low")} for r in read_log(out_dir)]


def final_weights(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_dir):  # noqa: F811
    out = str(tmp_path_factory.mktemp("runs") / "whole")
    train(out, data_dir, *LONG, "--final_eval=False")
    return out


def assert_same_run(out, reference):
    assert trajectory(out) == trajectory(reference)
    weights, expected = final_weights(out), final_weights(reference)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


def wait_for(predicate, process, timeout=120):
    t0 = time.time()
    while not predicate():
        if process.poll() is not None or time.time() - t0 > timeout:
            return False
        time.sleep(0.001)
    return True


def log_stamp(out_dir):
    try:
        return os.stat(os.path.join(out_dir, "log.jsonl")).st_mtime_ns
    except FileNotFoundError:
        return None


def logged_step(out_dir):
    """The last training step log.jsonl records (-1 if none yet); a torn last line is skipped."""
    step = -1
    try:
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            for line in f:
                try:
                    step = max(step, json.loads(line)["iter"])
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return step


@pytest.mark.slow
def test_kill_9_at_random_moments_resumes_bit_identically(tmp_path, data_dir, uninterrupted):  # noqa: F811
    """12 kills -9, each a random number of steps (1-12) into the resumed run, every other one at
    the moment a checkpoint's temporary file appears (inside a write). Steps, not seconds, so the
    kills land the same way on a fast machine and a slow one. Each time the run goes on from what
    is on disk (ckpt.pt, or ckpt_prev.pt when the kill fell between the two renames), and the
    finished run equals the uninterrupted one: every loss, every evaluation, every weight."""
    out = str(tmp_path / "killed")
    rng = random.Random(0)
    kills = 0
    while kills < 12:
        started = os.path.exists(os.path.join(out, "ckpt.pt")) or os.path.exists(os.path.join(out, "ckpt_prev.pt"))
        args = LONG + ["--final_eval=False", "--init_from=resume" if started else "--overwrite=True"]
        stamp = log_stamp(out)
        process = subprocess.Popen(command(out, data_dir, *args), cwd=REPO, env=ENV,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # past this process's start (where it trims the log and removes a killed write's
        # leftovers), then some steps into training; every other kill then waits for a
        # checkpoint's temporary file, so that it lands inside a write
        hit = wait_for(lambda: log_stamp(out) not in (None, stamp), process)
        target = logged_step(out) + rng.randint(1, 12)
        hit = hit and wait_for(lambda: logged_step(out) >= target, process)
        if kills % 2 == 0:
            hit = hit and wait_for(lambda: any(n.endswith(".tmp") for n in os.listdir(out)), process)
        process.kill()
        stderr = process.communicate()[1].decode()
        if process.returncode == 0:
            break  # finished before the kill: nothing left to interrupt
        assert process.returncode == -signal.SIGKILL, stderr[-2000:]
        kills += hit
    assert kills == 12, f"only {kills} kills landed"
    result = train(out, data_dir, *LONG, "--final_eval=False", "--init_from=resume")
    assert "Traceback" not in result.stderr
    assert not any(n.endswith(".tmp") for n in os.listdir(out))
    assert_same_run(out, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP])
def test_a_stop_signal_saves_the_step_and_resumes_bit_identically(tmp_path, data_dir, uninterrupted, signum):  # noqa: F811
    """SIGTERM / SIGINT / SIGUSR2 / SIGHUP (SIGUSR1: test_distributed.py): the step finishes, ckpt.pt holds it (not only the last evaluation), the
    command that resumes is printed, the exit status is 128 + the signal; resuming finishes the
    same run."""
    out = str(tmp_path / "stopped")
    args = [a for a in LONG if not a.startswith("--checkpoint_interval")] + ["--final_eval=False"]
    process = subprocess.Popen(command(out, data_dir, *args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: os.path.exists(os.path.join(out, "log.jsonl"))
                    and sum(1 for _ in open(os.path.join(out, "log.jsonl"))) > 60, process)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr[-2000:]
    assert "Traceback" not in stderr
    step = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"]
    assert 50 < step < 200  # past the evaluation at 50: saved by the stop itself
    assert f"stopped by {signal.Signals(signum).name} at step {step}" in stdout
    resume = stdout.strip().splitlines()[-1].split()
    assert resume[:2] == ["python", "train.py"] and resume[-1] == "--init_from=resume"
    result = subprocess.run([sys.executable, *resume[1:]], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_run(out, uninterrupted)


@pytest.mark.slow
def test_a_closed_terminal_saves_the_step(tmp_path, data_dir):  # noqa: F811
    """A run writing to a terminal that closes (its pty's other end gone, then SIGHUP, as a dropped
    ssh does): every write to it fails with EIO, yet the step is saved and the run exits 129. Once:
    exit 129 at once, nothing saved since the last evaluation."""
    out = str(tmp_path / "hung_up")
    args = [a for a in LONG if not a.startswith("--checkpoint_interval")] + ["--final_eval=False"]
    terminal, its_end = pty.openpty()
    process = subprocess.Popen(command(out, data_dir, *args), cwd=REPO, env=ENV, stdin=subprocess.DEVNULL,
                               stdout=its_end, stderr=its_end)
    os.close(its_end)
    reader = threading.Thread(target=drain, args=(terminal,), daemon=True)  # a full pty would block the run
    reader.start()
    assert wait_for(lambda: os.path.exists(os.path.join(out, "log.jsonl"))
                    and sum(1 for _ in open(os.path.join(out, "log.jsonl"))) > 60, process)
    os.close(terminal)  # the terminal is gone: the run's writes to it now fail
    process.send_signal(signal.SIGHUP)
    assert process.wait(timeout=120) == 128 + signal.SIGHUP
    step = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"]
    assert 50 < step < 200  # past the evaluation at 50: saved by the stop itself


def drain(fd):
    """Read a pty's output until its other end is gone."""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass


@pytest.mark.slow
def test_a_second_stop_signal_ends_a_long_step_at_once(tmp_path, data_dir):  # noqa: F811
    """The first SIGTERM says at once that the stop waits for the step (here 200,000 micro-steps, minutes
    on this machine); a repeat within a moment is the same stop passed on by a launcher (Slurm sends
    every process of the step one, torchrun forwards another) and changes nothing; a second one
    later ends the process at once, status 143, one line, nothing of the step saved: ckpt.pt is
    still the one of step 0."""
    out = str(tmp_path / "long")
    process = subprocess.Popen(command(out, data_dir, "--gradient_accumulation_steps=200000"), cwd=REPO, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: os.path.exists(os.path.join(out, "ckpt.pt")), process)
    time.sleep(2)  # in step 0
    process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)  # within StopRequest.REPEAT_S: the same stop passed on (Slurm + torchrun)
    time.sleep(2 * utils.StopRequest.REPEAT_S)
    assert process.poll() is None  # the first one only asks, its repeat changes nothing
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    lines = [line for line in stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 2 and lines[0].startswith("SIGTERM: stopping after this step"), stderr[-2000:]
    assert "SIGTERM while a stop was pending: ending now" in lines[1]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 0


@pytest.mark.slow
def test_one_ctrl_c_in_a_long_evaluation_says_so_at_once_and_saves_without_it(tmp_path, data_dir):  # noqa: F811
    """One SIGINT while the evaluation at step 2 runs (2,000 batches: seconds here, minutes at scale):
    once nothing was said, the evaluation ran to its end and a whole step after it before the save
    (users pressed again and lost it). Now one line at once says the stop is coming and what a second
    Ctrl-C does; the evaluation stops between two batches, ckpt.pt holds step 2 and the log no figure
    of the abandoned evaluation; exit 130. The printed command evaluates step 2 again and finishes
    the uninterrupted run bit for bit, its FLOPs too."""
    import threading
    args = ["--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--eval_iters=2000", "--final_eval=False"]
    whole, out = str(tmp_path / "whole"), str(tmp_path / "stopped")
    reference = subprocess.Popen(command(whole, data_dir, *args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    process = subprocess.Popen(command(out, data_dir, *args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    said = []  # (time, line) of every stderr line as it comes
    reader = threading.Thread(target=lambda: said.extend((time.time(), line) for line in process.stderr))
    reader.start()
    # 3 lines: the evaluation at 0, steps 0 and 1: the evaluation at step 2 is running
    assert wait_for(lambda: os.path.exists(os.path.join(out, "log.jsonl"))
                    and sum(1 for _ in open(os.path.join(out, "log.jsonl"))) >= 3, process)
    time.sleep(0.5)
    sent = time.time()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=120)
    reader.join()
    stdout = process.stdout.read()
    stderr = "".join(line for _, line in said)
    assert process.returncode == 128 + signal.SIGINT, stderr[-2000:]
    announced = [(t, line) for t, line in said if line.startswith("SIGINT: stopping after this step")]
    assert len(announced) == 1 and "a second Ctrl-C ends now without saving" in announced[0][1], stderr[-2000:]
    assert announced[0][0] - sent < 5 and "Traceback" not in stderr
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 2
    assert [r["iter"] for r in read_log(out) if "val" in r] == [0]  # nothing of the abandoned evaluation
    assert "stopped by SIGINT at step 2" in stdout
    finish_reference = reference.communicate(timeout=600)
    assert reference.returncode == 0, finish_reference[1][-2000:]
    resume = stdout.strip().splitlines()[-1].split()
    assert resume[:2] == ["python", "train.py"] and resume[-1] == "--init_from=resume"
    result = subprocess.run([sys.executable, *resume[1:]], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_run(out, whole)
    flops = [torch.load(os.path.join(run, "ckpt.pt"), weights_only=True)["flops_done"] for run in (out, whole)]
    assert flops[0] == flops[1]


@pytest.mark.slow
def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, data_dir):  # noqa: F811
    out = tmp_path / "fallback"
    train(str(out), data_dir, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--final_eval=False")
    (out / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes()[:1000])  # truncated
    result = train(str(out), data_dir, "--max_iters=6", "--eval_interval=2", "--lr_decay_iters=4",
                   "--init_from=resume", "--final_eval=False")
    assert f"cannot read checkpoint {out / 'ckpt.pt'}" in result.stdout
    assert f"resuming from the previous checkpoint {out / 'ckpt_prev.pt'} (step 2)" in result.stdout
    assert [r["iter"] for r in read_log(str(out)) if "val" in r] == [0, 2, 4, 6]
    # step 4 replaced the unreadable file (keeping step 2 as the previous), step 6 rotated as usual
    assert torch.load(out / "ckpt_prev.pt", weights_only=True)["iter_num"] == 4
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 6


@pytest.mark.slow
def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, data_dir):  # noqa: F811
    """A write that runs out of space (here: a file-size limit, as on a full disk the write fails
    part-way) ends the run with one line naming the file and the space left; the previous
    checkpoint is byte-identical and no temporary file is left."""
    out = tmp_path / "full"
    train(str(out), data_dir, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--final_eval=False")
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "ckpt_prev.pt", "best.pt")}
    limit = len(before["ckpt.pt"]) // 2

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(command(str(out), data_dir, "--max_iters=8", "--eval_interval=2", "--lr_decay_iters=4",
                                    "--init_from=resume", "--final_eval=False"),
                            cwd=REPO, env=ENV, capture_output=True, text=True, preexec_fn=limit_file_size)
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: cannot write {out / 'ckpt.pt'}") and "MiB free on that disk" in message
    assert f"{out / 'ckpt.pt'} and {out / 'ckpt_prev.pt'} are intact" in message
    assert "Traceback" not in result.stderr
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not any(n.endswith(".tmp") for n in os.listdir(out))


# bad inputs: (name, extra train.py args, how to break the files first, exit status, message part)
def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _both(out, data):
    """ckpt.pt and ckpt_prev.pt (else resume falls back to the readable one)."""
    for name in ("ckpt.pt", "ckpt_prev.pt"):
        _write(os.path.join(out, name), data if isinstance(data, bytes) else data(os.path.join(out, name)))


def _meta(data, change):
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    change(meta)
    _write(os.path.join(data, "meta.json"), json.dumps(meta).encode())


BAD_INPUTS = [
    ("margin not a number", ["--margin=abc"], None, 2, "key 'margin' must be None or a finite number > 0, got 'abc'"),
    ("margin negative", ["--margin=-1"], None, 2, "key 'margin' must be None or a finite number > 0, got -1"),
    ("eval_interval 0", ["--eval_interval=0"], None, 2, "key 'eval_interval' must be a positive integer, got 0"),
    ("max_iters negative", ["--max_iters=-1"], None, 2, "key 'max_iters' must be an integer >= 0, got -1"),
    ("batch_size 0", ["--batch_size=0"], None, 2, "key 'batch_size' must be a positive integer or 'auto', got 0"),
    ("block_size 0", ["--block_size=0"], None, 2, "key 'block_size' must be a positive integer, got 0"),
    ("learning rate inf", ["--learning_rate=1e999"], None, 2, "key 'learning_rate' must be a finite number > 0"),
    ("dropout 1", ["--dropout=1.0"], None, 2, "key 'dropout' must be a number in [0, 1), got 1.0"),
    ("unknown variant", ["--dispersion_variant=spread"], None, 2, "key 'dispersion_variant' must be one of angular"),
    ("unknown dtype", ["--dtype=float8"], None, 2, "key 'dtype' must be one of auto, float32"),
    ("unknown data order", ["--data_order=sequential"], None, 2,
     "key 'data_order' must be one of random, epoch, got 'sequential'"),
    ("misspelt key", ["--lerning_rate=1e-3"], None, 2, "unknown config key 'lerning_rate'; did you mean 'learning_rate'?"),
    ("wrong type", ["--n_layer=2.5"], None, 2, "key 'n_layer' expects int, got 2.5"),
    ("no such device", ["--device=cuda:99"], None, 2, "cuda:99"),
    ("decay before warm-up", ["--warmup_iters=30"], None, 2, "key 'lr_decay_iters' (4) must be above warmup_iters (30)"),
    ("garbage checkpoints", ["--init_from=resume"], lambda out, data: _both(out, b"not a checkpoint"),
     1, "cannot resume: cannot read checkpoint"),
    ("empty checkpoints", ["--init_from=resume"], lambda out, data: _both(out, b""), 1, "cannot read checkpoint"),
    ("truncated checkpoints", ["--init_from=resume"],
     lambda out, data: _both(out, lambda path: open(path, "rb").read()[:5000]), 1, "truncated"),
    ("foreign checkpoint", ["--init_from=resume"],
     lambda out, data: [torch.save({"weights": torch.ones(2)}, os.path.join(out, name))
                        for name in ("ckpt.pt", "ckpt_prev.pt")],
     1, "is not a checkpoint written by train.py"),
    ("damaged log", ["--init_from=resume", "--max_iters=6"],  # (a complete run's resume reads nothing: exit 0)
     lambda out, data: _write(out + "/log.jsonl", b"{oops\n{}\n"), 1,
     "line 1 of"),
    ("truncated meta.json", [], lambda out, data: _write(data + "/meta.json", b'{"vocab_si'), 1,
     "meta.json is not valid JSON"),
    ("meta.json without vocab_size", [], lambda out, data: _meta(data, lambda m: m.pop("vocab_size")),
     1, "has no positive integer 'vocab_size'"),
    ("vocabulary too small", [],
     lambda out, data: _meta(data, lambda m: m.update(vocab_size=5, itos=m["itos"][:5])), 1, "holds token id"),
    ("a bin from another preparation", [], lambda out, data: _write(data + "/train.bin", b"\x01\x00" * 5000), 1,
     "train.bin holds 5,000 tokens but meta.json says"),
    ("dataset shorter than a window", [],
     lambda out, data: _write(data + "/val.bin", b"\x01\x00" * 10), 1, "holds 10 tokens, fewer than one window"),
    ("fresh run on a run", [], None, 1, "already holds a run"),
    ("resume with another shape", ["--init_from=resume", "--n_layer=2"], None, 1, "cannot resume: key 'n_layer'"),
    ("resume with another vocabulary", ["--init_from=resume", "--vocab_size=200"], None, 1,
     "cannot resume: key 'vocab_size' is 200 but the checkpoint was trained with 0"),
    ("resume with other training keys", ["--init_from=resume", "--margin=0.6", "--learning_rate=0.5", "--seed=7"],
     None, 1, "(seed: 1337 there, 7 here; margin: None there, 0.6 here; learning_rate: 0.001 there, 0.5 here). "
              "Resume with the checkpoint's values, or name what you mean to change: "
              "--resume_changes=seed,margin,learning_rate"),
    ("resume in another data order", ["--init_from=resume", "--data_order=epoch"], None, 1,
     "(data_order: 'random' there, 'epoch' here). Resume with the checkpoint's values, or name what you mean to "
     "change: --resume_changes=data_order"),
    ("resume with another global batch", ["--init_from=resume", "--batch_size=2"], None, 1,
     "global batch (sequences per step): 4 there, 2 here"),
    ("resume_changes naming no key", ["--init_from=resume", "--resume_changes=learning_rat"], None, 2,
     "key 'resume_changes' must name keys of train.py"),
]


DATA_CASES = ("truncated meta.json", "meta.json without vocab_size", "vocabulary too small",
              "a bin from another preparation", "dataset shorter than a window")



@pytest.mark.slow
@pytest.mark.parametrize("name,args,damage,status,message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_changes_nothing(tmp_path, data_dir, finished_run, name, args, damage,  # noqa: F811
                                                  status, message):
    """Each case against a copy of a finished run (and of its dataset if the case damages it): the exit status, exactly one
    line on stderr (no traceback) that says what is wrong, and every file as it was."""
    import shutil
    out, data = str(tmp_path / "run"), data_dir
    shutil.copytree(finished_run, out)
    if name in DATA_CASES:  # a damaged copy of the dataset (a run checks its data before out_dir)
        data = str(tmp_path / "data")
        shutil.copytree(data_dir, data)
    if damage:
        damage(out, data)
    before = snapshot(out, data)
    result = subprocess.run(command(out, data, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4",
                                    "--final_eval=False", *args), cwd=REPO, env=ENV, capture_output=True, text=True)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == status, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr[-2000:]
    assert snapshot(out, data) == before


@pytest.mark.slow
def test_a_resume_changes_only_what_it_names_and_records_it(tmp_path, data_dir, finished_run):  # noqa: F811
    """--resume_changes=learning_rate: the run goes on with the new value, log.jsonl gets one event
    at the resumed step with both values, and every later checkpoint keeps it (the original value
    stays in the record); the same command again changes nothing more. The global batch split
    differently (2 x 2 micro-steps for 4 x 1) is no change at all."""
    import shutil
    out = str(tmp_path / "run")
    shutil.copytree(finished_run, out)
    more = ["--max_iters=8", "--eval_interval=2", "--lr_decay_iters=4", "--final_eval=False", "--init_from=resume"]
    changed = [*more, "--resume_changes=learning_rate", "--learning_rate=0.0005"]
    result = train(out, data_dir, *changed)
    assert "resumed from" in result.stdout and "learning_rate 0.001 -> 0.0005" in result.stdout
    events = [r for r in read_log(out) if r.get("event") == "resume_changes"]
    assert events == [{"iter": 4, "event": "resume_changes", "changes": {"learning_rate": [0.001, 0.0005]}}]
    with open(os.path.join(out, "ckpt.json")) as f:
        record = json.load(f)
    assert record["config"]["learning_rate"] == 0.0005
    assert record["config_changes"] == [{"iter": 4, "changes": {"learning_rate": [0.001, 0.0005]}}]
    train(out, data_dir, *changed[:-1], "--max_iters=10", "--learning_rate=0.0005", "--batch_size=2",
          "--gradient_accumulation_steps=2")
    assert [r for r in read_log(out) if r.get("event")] == events
    with open(os.path.join(out, "ckpt.json")) as f:
        assert json.load(f)["config_changes"] == record["config_changes"]
    assert max(r["iter"] for r in read_log(out)) == 10


@pytest.mark.slow
def test_starting_from_another_run_checks_shape_and_head(tmp_path, data_dir, finished_run):  # noqa: F811
    """--init_from=<checkpoint>: a model of another shape, or a head copied from the embedding while
    the head is tied to it, is one line (exit 2) before the new out_dir exists."""
    best = os.path.join(finished_run, "best.pt")
    for args, message in ((["--n_layer=2"], "model key 'n_layer' is 2 here but 1 there"),
                          (["--head_from_embedding=True"], "head_from_embedding=True needs tie_weights=False")):
        out = str(tmp_path / "new")
        result = subprocess.run(command(out, data_dir, f"--init_from={best}", *args), cwd=REPO, env=ENV,
                                capture_output=True, text=True)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr[-2000:]
        assert not os.path.exists(out)


def run_tool(script, *args, cwd=REPO):
    return subprocess.run([sys.executable, os.path.join(REPO, script), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--temperature", "0"], "--temperature must be a finite number > 0"),
    (["--temperature", "-1"], "--temperature must be a finite number > 0"),
    (["--top_k", "0"], "--top_k must be >= 1, got 0"),
    (["--start", ""], "--start must not be empty"),
    (["--max_new_tokens=-5"], "--max_new_tokens must be >= 1, got -5"),
    (["--num_samples", "0"], "--num_samples must be >= 1, got 0")])
def test_sample_refuses_bad_arguments_in_one_line(tmp_path, args, message):
    """Checked where they are parsed, before the checkpoint is read: exit 2, one line (once a
    traceback, the least likely tokens for a negative temperature, or nothing printed with exit 0)."""
    result = run_tool("sample.py", str(tmp_path / "missing.pt"), *args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr[-2000:]
    assert result.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("script", ["evaluate.py", "sample.py"])
def test_evaluate_and_sample_on_broken_paths(tmp_path, script):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00" * 100)
    old = tmp_path / "old_experts.pt"  # a mixture of experts saved before issue 31 stacked the experts
    torch.save({"model_config": {}, "config": {}, "iter_num": 0,
                "model": {"h.0.mlp.experts.0.gate.weight": torch.zeros(2, 2)}}, old)
    for path, expected in ((garbage, "cannot read checkpoint"), (tmp_path, "is a directory"),
                           (tmp_path / "missing.pt", "no checkpoint at"),
                           (old, "old per-expert layout (h.0.mlp.experts.0.gate.weight)")):
        result = run_tool(script, str(path))
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 1 and len(lines) == 1 and expected in lines[0], result.stderr[-2000:]


@pytest.mark.slow
def test_a_checkpoint_refuses_data_it_was_not_trained_on(tmp_path, data_dir):  # noqa: F811
    """The dataset's identity travels in the checkpoint (its meta): evaluate.py on another dataset,
    and a resume on a data_dir whose dataset was replaced, are one line (exit 1) naming both,
    with nothing written; starting a new run from the checkpoint needs only the same tokens."""
    import shutil
    data, other = str(tmp_path / "data"), str(tmp_path / "other")
    shutil.copytree(data_dir, data)
    out = str(tmp_path / "run")
    train(out, data, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--final_eval=False")
    shutil.copytree(data_dir, other)
    _meta(other, lambda m: m.update(n_val=m["n_val"] - 2, sha256="0" * 64))  # another text, the same characters
    with open(os.path.join(other, "val.bin"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 4)
    with open(os.path.join(other, "val.bin"), "rb") as f:  # as its own preparation records it
        val_sha256 = hashlib.sha256(f.read()).hexdigest()
    _meta(other, lambda m: m.update(val_sha256=val_sha256))
    before = snapshot(out)
    result = run_tool("evaluate.py", os.path.join(out, "best.pt"), f"--data_dir={other}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    assert f"the dataset in {other} is not the checkpoint's (n_val, sha256, val_sha256 differ)" in lines[0]
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    assert f"char tokens, vocab_size {meta['vocab_size']}, {meta['n_train']:,} train / {meta['n_val']:,} val" in lines[0]
    shutil.rmtree(data)
    shutil.copytree(other, data)  # the run's own data_dir, its dataset replaced
    result = subprocess.run(command(out, data, "--max_iters=6", "--eval_interval=2", "--lr_decay_iters=4",
                                    "--final_eval=False", "--init_from=resume"), cwd=REPO, env=ENV,
                            capture_output=True, text=True)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and "is not the checkpoint's" in lines[0], result.stderr[-2000:]
    assert snapshot(out) == before
    train(str(tmp_path / "next"), data, f"--init_from={os.path.join(out, 'best.pt')}", "--max_iters=2",
          "--final_eval=False")  # the same characters: a new run may start from it


@pytest.mark.slow
def test_checkpoints_work_from_any_directory_and_evaluate_keeps_what_a_run_wrote(tmp_path, data_dir):  # noqa: F811
    """data_dir given relative to the repository: evaluate.py finds the data from another working
    directory (the resolved path in the checkpoint) or with --data_dir; resume accepts the same data
    named absolutely. evaluate.py writes eval_best.json, never replaces a file unasked, and keeps a
    run's training FLOPs when it does replace metrics.json."""
    relative = os.path.relpath(data_dir, REPO)
    out = tmp_path / "run"
    result = subprocess.run(command(str(out), relative, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4"),
                            cwd=REPO, env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics_before = (out / "metrics.json").read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_tool("evaluate.py", str(out / "best.pt"), cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "metrics.json").read_bytes() == metrics_before and (out / "eval_best.json").exists()
    result = run_tool("evaluate.py", str(out / "best.pt"), cwd=elsewhere)
    assert result.returncode == 1 and "eval_best.json exists; pass --overwrite" in result.stderr
    result = run_tool("evaluate.py", str(out / "best.pt"), f"--data_dir={data_dir}", f"--out={out / 'metrics.json'}",
                      "--overwrite", cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
    old, new = json.loads(metrics_before), json.loads((out / "metrics.json").read_bytes())
    assert new["flops"] == old["flops"] and new["high"] == old["high"]
    result = subprocess.run(command(str(out), os.path.abspath(data_dir), "--max_iters=6", "--eval_interval=2",
                                    "--lr_decay_iters=4", "--init_from=resume", "--final_eval=False"),
                            cwd=REPO, env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_resume_refuses_every_training_key_by_name(data_dir):  # noqa: F811
    """check_resumable against a checkpoint of train.py's defaults: each key outside the stated list
    (run.RESUME_MAY_CHANGE) changed alone is refused in one line naming it with both values,
    and accepted, with the change returned for the record, when --resume_changes names it. The keys
    that may change, changed all at once (the global batch kept), pass."""
    import run
    from configurator import train_defaults
    defaults = {**train_defaults(), "data_dir": data_dir}
    saved = {"config": dict(defaults), "meta": {}, "processes": 1, "data_dir_resolved": os.path.realpath(data_dir)}

    def other(value):
        if isinstance(value, bool):
            return not value
        if isinstance(value, (int, float)):
            return value + 1
        return (value or "x") + "_other" if isinstance(value, str) else 7
    checked = [key for key in defaults if key not in run.RESUME_MAY_CHANGE]
    assert {"seed", "data_seed", "data_order", "learning_rate", "margin", "dispersion_weight", "low_resource_prob",
            "dropout", "grad_clip_mode", "eval_iters", "dtype"} <= set(checked)
    for key in checked:
        config = {**defaults, key: other(defaults[key])}
        with pytest.raises(run.CheckpointError, match=f"key '{key}'|{key}: ") as refused:
            run.check_resumable(saved, config, defaults["data_dir"])
        assert "\n" not in str(refused.value)
        if key not in run.RESUME_KEYS:  # the weights' shapes and the data's meaning never change
            changes = run.check_resumable(saved, {**config, "resume_changes": key}, defaults["data_dir"])
            assert changes == {key: [defaults[key], config[key]]}
    free = {"max_iters": 9, "eval_interval": 7, "log_interval": 3, "checkpoint_interval": 5, "device": "cpu",
            "num_threads": 2, "compile": "False", "parallel": "ddp", "activation_checkpointing": True,
            "wandb_log": True, "final_eval": False, "batch_size": defaults["batch_size"] // 2,
            "gradient_accumulation_steps": 2 * defaults["gradient_accumulation_steps"]}
    assert run.check_resumable(saved, {**defaults, **free}, defaults["data_dir"]) == {}
    # the same split on 2 processes is twice the global batch: refused by name
    with pytest.raises(run.CheckpointError, match=r"global batch \(sequences per step\): 12 there, 24 here"
                                                       r".*--resume_changes=batch_size "):
        run.check_resumable(saved, {**defaults, **free}, defaults["data_dir"], processes=2)
    assert run.check_resumable(saved, {**defaults, **free, "resume_changes": "batch_size"},
                                      defaults["data_dir"], processes=2) == {"global batch (sequences per step)": [12, 24]}
    # a checkpoint from before data_order drew its windows at random: going on in epochs is a change
    del saved["config"]["data_order"]
    assert run.check_resumable(saved, defaults, defaults["data_dir"]) == {}
    with pytest.raises(run.CheckpointError, match="data_order: 'random' there, 'epoch' here"):
        run.check_resumable(saved, {**defaults, "data_order": "epoch"}, defaults["data_dir"])
    # any key newer than the checkpoint counts as its default (the checkpoint trained that way)
    del saved["config"]["cwt_tau"], saved["config"]["dispersion_form"]
    assert run.check_resumable(saved, defaults, defaults["data_dir"]) == {}
    with pytest.raises(run.CheckpointError) as refused:
        run.check_resumable(saved, {**defaults, "cwt_tau": 0.5, "dispersion_form": "authors"}, defaults["data_dir"])
    assert "cwt_tau: 1.0 there, 0.5 here" in str(refused.value)
    assert "dispersion_form: 'paper' there, 'authors' here" in str(refused.value)
    # except the RoPE layout: a LLaMA checkpoint from before it was recorded rotated interleaved pairs
    llama = {**defaults, "arch": "llama"}
    saved["config"] = {k: v for k, v in llama.items() if k != "rope_layout"}
    with pytest.raises(run.CheckpointError, match="key 'rope_layout' is 'half' but the checkpoint was trained "
                                                  "with 'interleaved'"):
        run.check_resumable(saved, llama, defaults["data_dir"])
    assert run.check_resumable(saved, {**llama, "rope_layout": "interleaved"}, defaults["data_dir"]) == {}


# every file a run reads, damaged each way a disk or a hand damages one --------------------------------
DAMAGES = {
    "cut": lambda data: data[:len(data) // 2],
    "emptied": lambda data: b"",
    "random bytes": lambda data: random.Random(0).randbytes(max(64, min(len(data), 4096))),
    "bytes that are not text": lambda data: b"\xff\xfe\x00\x81" * 16,
    "JSON of the wrong shape": lambda data: b'[{"iter": "x"}, 2]\n',
}
READ_FILES = ("config.py", "data/meta.json", "data/train.bin", "data/val.bin", "run/ckpt.pt", "run/log.jsonl")
# what a crash leaves, resumed on purpose (test_kill_9_at_random_moments_resumes_bit_identically): a log cut
# mid-line loses its torn line, an emptied one its records; ckpt.json is written for readers, never read
RESUMED = {("run/log.jsonl", "cut"), ("run/log.jsonl", "emptied")}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("name", READ_FILES)
def test_every_file_a_resume_reads_damaged_is_one_line_naming_it(tmp_path, data_dir, finished_run, name,
                                                                  damage):  # noqa: F811
    """The config file, the dataset's three files, the checkpoint (both slots: else the resume falls back
    to the intact one) and the log, each damaged one way: one line that names the file, no traceback,
    every file as it was."""
    import shutil
    shutil.copytree(finished_run, tmp_path / "run")
    shutil.copytree(data_dir, tmp_path / "data")
    shutil.copy(os.path.join(REPO, "config/lowres_baseline.py"), tmp_path / "config.py")
    damaged = [tmp_path / name] + ([tmp_path / "run/ckpt_prev.pt"] if name == "run/ckpt.pt" else [])
    for path in damaged:
        path.write_bytes(DAMAGES[damage](path.read_bytes()))
    before = snapshot(tmp_path)
    result = subprocess.run([sys.executable, "train.py", str(tmp_path / "config.py"), f"--data_dir={tmp_path / 'data'}",
                             f"--out_dir={tmp_path / 'run'}", *TINY, "--max_iters=6", "--eval_interval=2",
                             "--lr_decay_iters=4", "--final_eval=False", "--init_from=resume"],
                            cwd=REPO, env=ENV, capture_output=True, text=True)
    if (name, damage) in RESUMED:
        assert result.returncode == 0, result.stderr[-2000:]
        return
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode in (1, 2) and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: ") and str(tmp_path / name) in lines[0], lines[0]
    assert snapshot(tmp_path) == before
