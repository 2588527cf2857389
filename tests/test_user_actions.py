"""What a user does never loses a run, and every mistake is one line (issue 43): a tool never
removes a directory that holds a training run or a held lock; every output path is checked in full
before work starts; a dataset is its content (hashes of the token files), not its path or size; a
killed preparation leaves nothing a rerun keeps; every user error is one line, whichever check
meets it first. Real subprocesses, signals and files, as in test_user_errors.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from test_train import REPO, TINY, train
from test_user_errors import (ENV, SHORT, in_tmpfs, needs_namespaces, one_line, run, said_lines, snapshot,
                              train_command)
from tools import grids

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.py)



# 1. no tool deletes a training run ---------------------------------------------------------------
def _export(best, out_dir):
    return run([sys.executable, "-m", "tools.export_hf", best, out_dir, "--overwrite", "--no_check"])


def test_export_overwrite_never_deletes_a_training_run(tmp_path, finished_run):
    """export_hf run/best.pt run --overwrite (once: the whole run, checkpoints included, deleted and
    replaced by the export), and the folder above it: exit 1, one line, not a file changed."""
    pytest.importorskip("transformers", reason="transformers is optional")
    run_dir = tmp_path / "runs" / "X"
    shutil.copytree(finished_run, run_dir)
    best = str(run_dir / "best.pt")
    before = snapshot(str(tmp_path))
    for target in (run_dir, run_dir.parent):
        result = _export(best, str(target))
        one_line(result, 1, f"{target} holds a training run ({run_dir}/",
                 "--overwrite never deletes one; give another directory")
    assert snapshot(str(tmp_path)) == before


def test_export_overwrite_never_deletes_a_live_runs_lock(tmp_path, finished_run):
    """Against a live run (its run.lock held, nothing else written yet): once the lock and the log
    went while training went on; now exit 1, one line, and the lock is still held."""
    pytest.importorskip("transformers", reason="transformers is optional")
    import fcntl
    live = tmp_path / "live"
    live.mkdir()
    with open(live / "run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = _export(os.path.join(finished_run, "best.pt"), str(live))
        one_line(result, 1, f"{live} holds a training run ({live / 'run.lock'}")
        assert os.listdir(live) == ["run.lock"]


# 6. an output path is checked in full, its name's length included --------------------------------
def test_evaluate_checks_the_out_names_length_before_it_starts(tmp_path, finished_run):
    """A 250-character name is one the file system allows: written (once the whole evaluation ran,
    then 'File name too long' from the temporary name beside it, the figures only on the screen);
    a 300-character name is refused before anything is read: exit 1, one line naming --out."""
    best = os.path.join(finished_run, "best.pt")
    allowed = tmp_path / ("e" * 245 + ".json")
    result = run([sys.executable, "evaluate.py", best, f"--out={allowed}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(allowed.read_text())["checkpoint"]
    for out in (tmp_path / ("e" * 295 + ".json"), tmp_path / ("d" * 300) / "e.json"):
        result = run([sys.executable, "evaluate.py", best, f"--out={out}"])
        one_line(result, 1, f"--out {out}: a name in it is 300 bytes, longer than the 255 this file system allows")
        assert result.stdout == ""
    assert sorted(os.listdir(tmp_path)) == [allowed.name]


# 13. a key the model or the objective refuses is one line, whichever check meets it first ---------
@pytest.mark.parametrize("key,message", [
    ("--n_head=3", "n_embd (16) must be divisible by n_head (3)"),
    ("--simreg_layer=99", "simreg_layer must be -1 (final normed state) or 0..1, got 99"),
    ("--nitp_layer=99", "nitp_layer must be in 1..1 (0 = ~20 % depth), got 99")])
def test_a_key_the_model_refuses_is_one_line_before_the_memory_check(tmp_path, data_dir, key, message):
    """train.py, train.py --dry_run=True and plan.py: exit 2, one line naming the key (once a
    ValueError traceback from the memory check, which builds the model before the rule was checked)."""
    out = tmp_path / "out"
    for cmd in (train_command(str(out), data_dir, key), train_command(str(out), data_dir, key, "--dry_run=True"),
                [sys.executable, "plan.py", "config/lowres_baseline.py", *TINY, f"--data_dir={data_dir}", key]):
        result = run(cmd)
        one_line(result, 2, message)
        assert result.stdout == ""
    assert not out.exists()


# 11. a killed preparation leaves nothing that a rerun keeps --------------------------------------
def test_a_rerun_removes_what_a_killed_preparation_left(tmp_path):
    """prepare_shakespeare.py killed (SIGKILL, no time to clean up) while it writes train.bin: its
    temporary file stays (once for good: 56 MB with the real text, no rerun removed it); the rerun
    says so, removes it and writes the dataset."""
    text = tmp_path / "big.txt"
    text.write_text("To be, or not to be, that is the question:\n" * 1_000_000)  # 44 MB
    out = tmp_path / "data"
    cmd = [sys.executable, "prepare_shakespeare.py", "--input", str(text), "--out_dir", str(out)]
    process = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None:
            if out.exists() and any(name.endswith(".tmp") and os.path.getsize(out / name) for name in os.listdir(out)):
                break
            time.sleep(0.005)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    left = [name for name in os.listdir(out) if name.endswith(".tmp")]
    assert left and "meta.json" not in os.listdir(out), os.listdir(out)
    result = run(cmd)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"note: removed {left[0]}" in result.stdout
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]


# 7. a dataset is its content: token files changed in place are refused ---------------------------
def _overwrite_in_place(path):
    """The same size, other tokens (valid ids): what a size check cannot see."""
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(data[::-1][1::2] + data[::-1][0::2] if len(data) % 4 == 0 else data[2:] + data[:2])


def test_token_files_changed_in_place_are_refused(tmp_path, data_dir, finished_run):
    """train.bin / val.bin rewritten with the same size (once accepted by training and evaluation):
    train.py and evaluate.py exit 1 with one line naming the file; a dataset prepared before the
    hashes were recorded (no train_sha256 / val_sha256 in meta.json) still trains."""
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    assert len(meta["train_sha256"]) == len(meta["val_sha256"]) == 64
    for name in ("train.bin", "val.bin"):
        data = str(tmp_path / name / "data")
        shutil.copytree(data_dir, data)
        _overwrite_in_place(os.path.join(data, name))
        result = run(train_command(str(tmp_path / name / "out"), data))
        one_line(result, 1, f"{os.path.join(data, name)} is not the file its preparation wrote (sha256 ")
        assert not (tmp_path / name / "out").exists()
        if name == "val.bin":
            out = tmp_path / "eval.json"
            result = run([sys.executable, "evaluate.py", os.path.join(finished_run, "best.pt"), f"--out={out}",
                          f"--data_dir={data}"])
            one_line(result, 1, f"{os.path.join(data, name)} is not the file its preparation wrote")
            assert not out.exists()
    old = str(tmp_path / "old")
    shutil.copytree(data_dir, old)
    with open(os.path.join(old, "meta.json"), "w") as f:
        json.dump({k: v for k, v in meta.items() if k not in ("train_sha256", "val_sha256")}, f)
    train(str(tmp_path / "old_out"), old, *SHORT)


def test_c4_shard_files_changed_in_place_are_refused(tmp_path):
    """Per-shard token files (prepare_c4.py --from_text, offline), a train shard and the val shard
    each rewritten in place with the same size: refused at the start, one line naming the file (the
    val split, and a train split under data.HASH_TRAIN_UP_TO, are hashed at every load)."""
    pytest.importorskip("tiktoken")
    import prepare_c4
    text = tmp_path / "input.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: to be, or not to be." for i in range(200)) + "\n")
    data = tmp_path / "c4"
    prepare_c4.prepare(shards=2, out_dir=str(data), workers=1, from_text=str(text))
    c4 = [sys.executable, "train.py", "config/c4_tiny.py", "--max_iters=1", "--eval_interval=1", "--eval_iters=1",
          "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16", "--batch_size=2", "--warmup_iters=0",
          "--final_eval=False", "--num_threads=1"]
    for split in ("train", "val"):
        copy = tmp_path / split
        shutil.copytree(data, copy)
        shard = sorted((copy / split).iterdir())[-1]
        _overwrite_in_place(str(shard))
        result = run([*c4, f"--data_dir={copy}", f"--out_dir={tmp_path / 'out'}"])
        one_line(result, 1, f"{shard} is not the file its preparation wrote (sha256 ")
        assert not (tmp_path / "out").exists()


# 9. a disk that fills inside torch's writer says so ----------------------------------------------
@needs_namespaces
def test_a_disk_full_inside_torch_save_says_the_disk_is_full(tmp_path, data_dir):  # noqa: F811
    """A 3 MB tmpfs holds step 0's best.pt (1.7 MB), not ckpt.pt beside it: the write fails inside
    torch's zip writer, which once hid the OSError behind 'unexpected pos 1424576 vs 1424464'. Now:
    exit 1, one line saying the disk is full, no temporary file left."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    run_dir = mount_point / "run"
    cmd = [sys.executable, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={run_dir}",
           "--max_iters=4", "--eval_interval=2", "--eval_iters=1", "--warmup_iters=1", "--lr_decay_iters=4",
           "--final_eval=False", "--num_threads=1", "--n_layer=2", "--batch_size=4", "--block_size=64"]
    result = run(in_tmpfs(str(mount_point), "size=3m", cmd, after=f'ls -a "{run_dir}"'))
    line = one_line(result, 1, f"cannot write {run_dir / 'ckpt.pt'}: the disk is full (No space left on device; ")
    assert "unexpected pos" not in line
    assert ".tmp" not in result.stdout


# 14. the last tracebacks: one line each ----------------------------------------------------------
def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, data_dir):
    """A Latin-1 byte in a comment (once a UnicodeDecodeError traceback): exit 2, one line naming
    the file and the byte's place; out_dir never made."""
    config = tmp_path / "latin1.py"
    config.write_bytes(b"n_layer = 1\n# caf\xe9\n")
    out = tmp_path / "out"
    result = run(train_command(str(out), data_dir, str(config)))
    one_line(result, 2, f"config file '{config}' is not UTF-8 text (byte 0xe9 at position 17")
    assert not out.exists()


def test_sample_at_a_temperature_near_zero_is_greedy(finished_run):
    """--temperature 1e-39 (once: logits / T overflowed to inf, softmax gave NaN, multinomial a
    RuntimeError traceback): the most likely token each time, as at --temperature 1e-6."""
    best = os.path.join(finished_run, "best.pt")
    outputs = []
    for temperature in ("1e-39", "1e-6"):
        result = run([sys.executable, "sample.py", best, "--temperature", temperature, "--max_new_tokens", "20"])
        assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]


def test_compare_checks_its_overrides_before_any_run(tmp_path):
    """tools.compare lowres --lerning_rate=1: exit 2, one line naming the key, nothing run or
    written (once: checked only when the first run failed, inside it, as a traceback)."""
    args = ["--root", str(tmp_path / "r"), "--archive", str(tmp_path / "a"), "--results", str(tmp_path / "res")]
    for override, message in (("--lerning_rate=1", "unknown config key 'lerning_rate'"),
                              ("--max_iters=-1", "key 'max_iters' must be")):
        result = run([sys.executable, "-m", "tools.compare", "lowres", *args, override])
        one_line(result, 2, message)
        assert result.stdout == ""
    assert not any(os.path.exists(tmp_path / name) for name in ("r", "a", "res"))


def test_a_grid_run_that_fails_is_one_line_with_its_own_error(tmp_path):
    """A grid's train.py that fails (here: its data folder holds no dataset) once ended compare.py
    with a RuntimeError traceback that said only "see train.out"; now it is one line naming the run,
    with train.py's own error line and where its whole output is; exit status 1."""
    empty = tmp_path / "no_data"
    empty.mkdir()
    args = ["--root", str(tmp_path / "r"), "--archive", str(tmp_path / "a"), "--results", str(tmp_path / "res"),
            "--methods", "CE", "--seeds", "1337", "--workers", "1", f"--data_dir={empty}"]
    result = run([sys.executable, "-m", "tools.compare", "lowres", *args])
    train_out = os.path.join(grids.run_dir(str(tmp_path / "r"), "lowres", "CE", 1337), "train.out")
    with open(train_out) as f:
        own = [line for line in f.read().splitlines() if line.startswith("error: ")]
    assert len(own) == 1, own
    assert "Traceback" not in result.stderr and result.returncode == 1, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "failed (train.py exit status 1)" in line and own[0][len("error: "):] in line and train_out in line


def test_repulsion_tool_reads_a_run_and_names_a_missing_dataset(tmp_path, finished_run, data_dir):
    """tools.repulsion on a finished run's best.pt: a row per block; given a data folder without a
    dataset, one line naming the checkpoint and the folder."""
    best = os.path.join(finished_run, "best.pt")
    result = run([sys.executable, "-m", "tools.repulsion", best, f"--data_dir={data_dir}", "--blocks=4"])
    assert result.returncode == 0, result.stderr[-2000:]
    import torch
    n_layer = torch.load(best, map_location="cpu", weights_only=False)["model_config"]["n_layer"]
    assert len([line for line in result.stdout.splitlines() if line[:3] in {f"| {k}" for k in range(1, 10)}]) == n_layer
    one_line(run([sys.executable, "-m", "tools.repulsion", best, f"--data_dir={tmp_path}"]), 1, best, str(tmp_path))


def test_a_damaged_best_pt_at_the_final_evaluation_of_a_resume_is_one_line(tmp_path, data_dir, finished_run):
    """best.pt truncated, then the run resumed to its end (once: a CheckpointError traceback from
    the final evaluation; later: a resume of the complete run changed nothing and printed how to
    score it, so a grid's resume never scored it). Now the resume runs the final evaluation, which,
    met with the damaged best.pt, is one line naming best.pt that says training is complete and how
    to score ckpt.pt instead; ckpt.pt untouched, no metrics.json."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    best = run_dir / "best.pt"
    best.write_bytes(best.read_bytes()[:1000])
    ckpt = (run_dir / "ckpt.pt").read_bytes()
    result = run(train_command(str(run_dir), data_dir, "--init_from=resume", "--final_eval=True"))
    one_line(result, 1, f"{best}", "training is complete", f"python evaluate.py {run_dir / 'ckpt.pt'}")
    assert (run_dir / "ckpt.pt").read_bytes() == ckpt and not (run_dir / "metrics.json").exists()


# 10. metrics.json written later by evaluate.py keeps the run's FLOPs ------------------------------
def test_evaluate_into_a_runs_metrics_json_keeps_its_training_flops(tmp_path, finished_run):
    """The command train.py prints when the final evaluation is cut short (or skipped):
    evaluate.py run/best.pt --out=run/metrics.json. Once its metrics.json lacked the FLOPs the run
    executed; now they come from the run's ckpt.pt, as the final evaluation would have written them."""
    import torch
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    assert not (run_dir / "metrics.json").exists()
    result = run([sys.executable, "evaluate.py", str(run_dir / "best.pt"), f"--out={run_dir / 'metrics.json'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    flops = json.loads((run_dir / "metrics.json").read_text())["flops"]
    done = torch.load(run_dir / "ckpt.pt", weights_only=True)["flops_done"]
    assert flops["train"] == done["train"] > 0 and flops["eval"] == done["eval"]
    assert flops["total"] == flops["train"] + flops["eval"] + flops["final_eval"]


def test_ctrl_c_in_the_final_evaluation_is_one_line_whose_command_writes_metrics(tmp_path, data_dir):  # noqa: F811
    """SIGINT during the final evaluation of a complete run (train.py has given the signals their
    default actions back: it interrupts at once), on a validation split large enough for it to take
    seconds: exit 130 and one line on stderr holding the evaluate.py command; every file of the trained
    run kept. That command writes metrics.json with the FLOPs the run executed (from ckpt.pt, as the
    final evaluation would have; once: without them), and changes nothing else."""
    import torch
    import prepare_shakespeare
    (tmp_path / "big.txt").write_text(open(os.path.join(os.path.dirname(data_dir), "input.txt")).read() * 80)
    big, out = tmp_path / "big", tmp_path / "run"
    prepare_shakespeare.prepare(input_path=str(tmp_path / "big.txt"), out_dir=str(big))
    process = subprocess.Popen(train_command(str(out), str(big), "--final_eval=True"), cwd=REPO, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def in_final_evaluation():  # a checkpoint written, and SIGTERM no longer caught: past stop.release()
        try:
            with open(f"/proc/{process.pid}/status") as f:
                caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        except (OSError, StopIteration):
            return False
        return (out / "ckpt.json").exists() and not caught & (1 << (signal.SIGTERM - 1))
    t0 = time.time()
    while not in_final_evaluation() and process.poll() is None and time.time() - t0 < 300:
        time.sleep(0.001)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    lines = said_lines(stderr)
    assert process.returncode == 128 + signal.SIGINT and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("interrupted during the final evaluation; training is complete"), lines[0]
    assert json.loads((out / "ckpt.json").read_text())["iter_num"] == 4 and not (out / "metrics.json").exists()
    assert {"ckpt.pt", "ckpt_prev.pt", "best.pt", "log.jsonl"} <= set(os.listdir(out))
    assert not any(name.endswith(".tmp") for name in os.listdir(out))
    command = lines[0].split("): ", 1)[1].removesuffix(" writes metrics.json").split()
    assert command[:2] == ["python", "evaluate.py"], lines[0]
    resumed = tmp_path / "resumed"  # the same stopped run, resumed (a grid's resume, a requeued job)
    shutil.copytree(out, resumed)
    before = snapshot(str(out))
    result = run([sys.executable, *command[1:]])
    assert result.returncode == 0, result.stderr[-2000:]
    after = snapshot(str(out))
    changed = {path for path in after if path not in before or after[path] != before[path]}
    assert changed == {str(out / "metrics.json")}
    flops = json.loads((out / "metrics.json").read_text())["flops"]
    done = torch.load(out / "ckpt.pt", weights_only=True)["flops_done"]
    assert flops["train"] == done["train"] > 0 and flops["eval"] == done["eval"] > 0
    assert flops["total"] == flops["train"] + flops["eval"] + flops["final_eval"]
    # the resume runs that final evaluation: the same metrics.json, and nothing else changed
    before = snapshot(str(resumed))
    for init_from in ("resume", "auto"):  # the second finds the run scored: nothing to do
        result = run(train_command(str(resumed), str(big), "--final_eval=True", f"--init_from={init_from}"))
        assert result.returncode == 0, result.stderr[-2000:]
    after = snapshot(str(resumed))
    assert {path for path in after if not path.endswith("run.lock") and after[path] != before.get(path)} == \
        {str(resumed / "metrics.json")}
    scored = json.loads((resumed / "metrics.json").read_text())
    assert scored.pop("checkpoint")["path"] == str(resumed / "best.pt")
    expected = json.loads((out / "metrics.json").read_text())
    expected.pop("checkpoint")
    assert scored == expected


def test_a_stop_in_the_last_step_skips_the_final_evaluation_in_one_line(tmp_path, data_dir):  # noqa: F811
    """SIGTERM during the run's last step (2,000 micro-steps): the step, its evaluation and its
    checkpoint complete the run; the final evaluation is not started (it would not stop for a pending
    stop) and one line says how to write metrics.json later; exit 143."""
    out = tmp_path / "run"
    args = ["--max_iters=1", "--gradient_accumulation_steps=2000", "--final_eval=True"]
    process = subprocess.Popen(train_command(str(out), data_dir, *args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not (out / "ckpt.json").exists() and process.poll() is None and time.time() - t0 < 300:
        time.sleep(0.01)
    time.sleep(1)  # in step 0, the last
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    lines = said_lines(stderr)
    assert process.returncode == 128 + signal.SIGTERM and len(lines) == 2, stderr[-3000:]
    assert lines[0].startswith("SIGTERM: stopping after this step"), lines[0]
    assert lines[1].startswith("SIGTERM at the end of training: no final evaluation; training is complete"), lines[1]
    assert f"python evaluate.py {out / 'best.pt'} --out={out / 'metrics.json'}" in lines[1]
    assert json.loads((out / "ckpt.json").read_text())["iter_num"] == 1 and not (out / "metrics.json").exists()


# 5. a finished run asked to go on says so and changes nothing ------------------------------------
def test_a_finished_run_asked_to_go_on_changes_nothing(tmp_path, finished_run, data_dir):  # noqa: F811
    """--init_from=auto (a requeued job) or resume on a run that reached max_iters: once the evaluations
    ran again, their FLOPs were added to the record and ckpt_prev.pt became a copy of ckpt.pt; now exit 0
    with one line saying the run is complete, every file as it was (twice). A larger --max_iters goes on."""
    out = tmp_path / "done"
    shutil.copytree(finished_run, out)
    before = {k: v for k, v in snapshot(str(out)).items() if not k.endswith("run.lock")}
    for init_from in ("auto", "resume"):
        result = run(train_command(str(out), data_dir, f"--init_from={init_from}"))
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"{out} holds a complete run (step 4, max_iters 4): nothing to do, nothing changed" in result.stdout
        assert {k: v for k, v in snapshot(str(out)).items() if not k.endswith("run.lock")} == before
    result = run(train_command(str(out), data_dir, "--init_from=auto", "--max_iters=6"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((out / "ckpt.json").read_text())["iter_num"] == 6


# 3. a run follows its data, not its path ---------------------------------------------------------
def test_a_resume_follows_its_data_to_another_path(tmp_path, data_dir):  # noqa: F811
    """The dataset copied unchanged to another path (a node's local scratch), then --init_from=resume
    --data_dir=<the copy>: once refused (resolved paths compared), even with --resume_changes=data_dir
    and through a symlink; now it resumes. Another dataset at that path is still refused in one line."""
    out = str(tmp_path / "run")
    result = run(train_command(out, data_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    copy = tmp_path / "scratch" / "data"
    shutil.copytree(data_dir, copy)
    result = run(train_command(out, str(copy), "--init_from=resume", "--max_iters=6"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "ckpt.json").read_text())["iter_num"] == 6
    other = tmp_path / "other"
    (tmp_path / "other.txt").write_text("A different text, with other characters: 0123456789.\n" * 300)
    prepared = run([sys.executable, "prepare_shakespeare.py", "--input", str(tmp_path / "other.txt"), "--out_dir",
                    str(other)])
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    result = run(train_command(out, str(other), "--init_from=resume", "--max_iters=8"))
    one_line(result, 1, f"the dataset in {other} is not the checkpoint's")
