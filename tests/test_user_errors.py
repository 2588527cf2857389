"""One error path for every script (issue 32): a config file that exits or raises, a dataset file
that cannot be read, an output path that cannot be written (checked before any long work), a full
disk told apart from a missing permission, bad arguments of the tools and prepare_shakespeare.py,
and a step too long to wait for without a word. Each case runs the real script in a subprocess on
files the test makes and asserts the exit status, the one line (no traceback) and that no file
changed. Full disks and read-only file systems are real: a small tmpfs mounted in a user and mount
namespace (`unshare -rm`, skipped where the kernel does not allow it)."""

import importlib.util
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time

import pytest

from test_train import REPO, TINY

ENV = dict(os.environ, OMP_NUM_THREADS="1")
SHORT = ["--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--final_eval=False"]
ROOT = os.geteuid() == 0  # root reads files whatever their mode (AS_OTHER_USER below)


def run(cmd, **kwargs):
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300, **kwargs)


def train_command(out_dir, data_dir, *args):
    return [sys.executable, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={out_dir}",
            *TINY, *SHORT, *args]


def snapshot(*directories):
    """path -> bytes of every file under the directories (and the directories themselves)."""
    files = {}
    for directory in directories:
        for root, dirs, names in os.walk(directory):
            for name in dirs:
                files[os.path.join(root, name)] = "dir"
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    files[os.path.join(root, name)] = f.read()
    return files


def said_lines(stderr):
    """The lines a process wrote on stderr, besides a run's progress bar."""
    return [line for line in stderr.replace("\r", "\n").splitlines()
            if line.strip() and not re.search(r"\| *\d+/\d+ \[", line)]


def one_line(result, status, *parts):
    """The exit status, exactly one line on stderr (besides a run's progress bar), starting with
    'error: ' and holding each part."""
    lines = said_lines(result.stderr)
    assert result.returncode == status, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert all(part in lines[0] for part in parts), lines[0]
    return lines[0]


def namespaces_work():
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespaces = pytest.mark.skipif(not namespaces_work(), reason="no user+mount namespaces (unshare -rm) here")


def in_tmpfs(mount_point, options, cmd, after=""):
    """cmd inside a user+mount namespace where mount_point is a fresh tmpfs (options: 'ro', 'size=120k');
    `after` (sh) runs there once cmd has ended; the namespace's exit status is cmd's."""
    script = f'mount -t tmpfs -o {options} tmpfs "$0" || exit 99; "$@"; status=$?; {after or ":"}; exit $status'
    return ["unshare", "-rm", "sh", "-c", script, mount_point, *cmd]


# 0. the environment torchrun sets, set by hand ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("env,args,message", [
    ({"WORLD_SIZE": "abc"}, [], "environment variable WORLD_SIZE must be a whole number >= 0 (torchrun sets it), "
                                "got 'abc'"),
    ({"WORLD_SIZE": "2"}, ["--parallel=ddp"], "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT not: start "
                                              "the processes with torchrun")])
def test_a_hand_set_launch_environment_is_one_line(tmp_path, data_dir, env, args, message):
    """Once a ValueError traceback (WORLD_SIZE=abc), and the rendezvous's own (WORLD_SIZE=2 without
    torchrun): one line, the usage error's status, nothing written."""
    out = tmp_path / "out"
    result = subprocess.run(train_command(str(out), data_dir, *args), cwd=REPO, env={**ENV, **env},
                            capture_output=True, text=True, timeout=300)
    one_line(result, 2, message)
    assert not out.exists()


def test_launched_reads_what_torchrun_sets(monkeypatch):
    import errors
    import parallelism
    import utils
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert utils.launched("LOCAL_RANK", 0) == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert utils.launched("LOCAL_RANK", 0) == 3
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(errors.UsageError, match="LOCAL_RANK must be a whole number >= 0 .* got '-1'"):
        utils.launched("LOCAL_RANK", 0)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert not errors.several_processes()  # an error being reported is reported, not a second one raised
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert errors.several_processes()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(errors.UsageError, match="WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT not"):
        parallelism.init_distributed("cpu")
    # set by hand to nonsense: one line, not a connection retried until the timeout
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for port in ("abc", "0", "70000", " 29500"):
        monkeypatch.setenv("MASTER_PORT", port)
        with pytest.raises(errors.UsageError, match=f"MASTER_PORT must be a port number .*got '{port}'"):
            parallelism.init_distributed("cpu")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(errors.UsageError, match="MASTER_ADDR='no-such-host.invalid' is no address"):
        parallelism.init_distributed("cpu")


# 1. a config file that exits or raises ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("body,what", [
    ("import sys\nsys.exit(0)\n", "called sys.exit(0); a config file only assigns keys"),
    ("raise SystemExit(0)\n", "called sys.exit(0)"),
    ("import sys\nsys.exit('done')\n", "called sys.exit('done')"),
    ("n_layer = 2\nraise KeyError('x')\n", "failed to run: KeyError: 'x'"),
    ("raise KeyboardInterrupt('x')\n", "failed to run: KeyboardInterrupt: x")])
def test_a_config_that_exits_or_raises_is_a_config_error(tmp_path, data_dir, body, what):  # noqa: F811
    """Once exit 0 having trained nothing (a grid runner counted it done): exit 2, one line naming the
    file, out_dir never made."""
    config = tmp_path / "bad.py"
    config.write_text(body)
    out = tmp_path / "out"
    result = run(train_command(str(out), data_dir, str(config)))
    one_line(result, 2, f"config file '{config}'", what)
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("tool", [["plan.py"], ["-m", "tools.memory_table", "--gpus", "1"]])
def test_plan_and_tools_treat_an_exiting_config_the_same(tmp_path, tool):
    config = tmp_path / "bad.py"
    config.write_text("import sys\nsys.exit(0)\n")
    result = run([sys.executable, *tool[:2], str(config), *tool[2:]])
    one_line(result, 2, f"config file '{config}' called sys.exit(0)")
    assert result.stdout == ""


# 2. dataset files that cannot be read -------------------------------------------------------------
def _directory_in_place(path):
    os.remove(path)
    os.mkdir(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["meta.json", "train.bin", "val.bin"])
def test_a_dataset_file_that_is_a_directory_is_one_line(tmp_path, data_dir, finished_run, name):  # noqa: F811
    """train.py (all three files) and evaluate.py (meta.json, val.bin: what it reads): exit 1, one line
    naming the file; once an IsADirectoryError traceback (meta.json) or 'missing' for a file that is there."""
    data = str(tmp_path / "data")
    shutil.copytree(data_dir, data)
    _directory_in_place(os.path.join(data, name))
    before = snapshot(data, finished_run)
    result = run(train_command(str(tmp_path / "out"), data))
    one_line(result, 1, f"{os.path.join(data, name)} is a directory, not a file")
    assert not (tmp_path / "out").exists()
    if name != "train.bin":
        out = tmp_path / "eval.json"
        result = run([sys.executable, "evaluate.py", os.path.join(finished_run, "best.pt"), f"--out={out}",
                      f"--data_dir={data}"])
        one_line(result, 1, f"{os.path.join(data, name)} is a directory, not a file")
        assert not out.exists()
    assert snapshot(data, finished_run) == before


# Root reads a file whatever its mode. As root, the script runs in a user namespace of its own,
# entered once its modules are imported: there it keeps its user id but loses the capabilities that
# override a file's mode, so chmod 000 stops reads as it does for any user.
AS_OTHER_USER = """import ctypes, os, runpy, sys
sys.path.insert(0, os.getcwd())
for name in ("torch", "numpy", "tqdm", "checkpoint", "evaluate", "plan", "prepare_shakespeare", "tracking", "data",
             "losses", "model", "optim", "utils", "torch.distributed"):
    __import__(name)
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000):  # CLONE_NEWUSER
    sys.exit("cannot enter a user namespace: " + os.strerror(ctypes.get_errno()))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["meta.json", "train.bin", "val.bin"])
def test_an_unreadable_dataset_file_is_one_line(tmp_path, data_dir, finished_run, name):  # noqa: F811
    """chmod 000 on one file: train.py and evaluate.py (not train.bin, which it does not read) end with
    'cannot read <file>: Permission denied', exit 1 (once a PermissionError traceback)."""
    data = str(tmp_path / "data")
    shutil.copytree(data_dir, data)
    os.chmod(os.path.join(data, name), 0)
    out, evaluated = tmp_path / "out", tmp_path / "eval.json"
    try:
        for cmd in [train_command(str(out), data)] + ([] if name == "train.bin" else [
                [sys.executable, "evaluate.py", os.path.join(finished_run, "best.pt"), f"--out={evaluated}",
                 f"--data_dir={data}"]]):
            if ROOT:
                cmd = [sys.executable, "-c", AS_OTHER_USER, *cmd[1:]]
            result = run(cmd)
            if result.stderr.startswith("cannot enter a user namespace"):
                pytest.skip("root reads a file whatever its mode, and no user namespace is allowed here")
            one_line(result, 1, f"cannot read {os.path.join(data, name)}: Permission denied")
    finally:
        os.chmod(os.path.join(data, name), 0o644)
    assert not out.exists() and not evaluated.exists()


# 3. permission and a full disk, told apart --------------------------------------------------------
def test_a_log_append_tells_a_full_disk_from_a_missing_permission():
    """tracking.append_record on real OS conditions: /dev/full answers every write with ENOSPC, a
    sysfs file opened for appending refuses even root (EACCES, or EROFS where /sys is mounted read-only)."""
    import tracking
    message = tracking.append_record("/dev/full", {"iter": 0})
    assert message.startswith("cannot write /dev/full: the disk is full (No space left on device; "), message
    if not os.path.exists("/sys/kernel/notes"):
        pytest.skip("no /sys/kernel/notes here")
    message = tracking.append_record("/sys/kernel/notes", {"iter": 0})
    assert message.startswith("cannot write /sys/kernel/notes: permission denied ("), message


@pytest.mark.slow
@needs_namespaces
def test_train_on_a_read_only_file_system_says_permission(tmp_path, data_dir):  # noqa: F811
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = run(in_tmpfs(str(mount_point), "ro", train_command(str(mount_point / "run"), data_dir)))
    one_line(result, 1, f"cannot write {mount_point / 'run'}: permission denied (Read-only file system); "
                        "give an --out_dir you can write to")


@pytest.mark.slow
@needs_namespaces
def test_train_on_a_full_disk_says_so_and_keeps_the_checkpoint(tmp_path, data_dir):  # noqa: F811
    """A 120 KiB tmpfs holds the lock, the log and step 0's checkpoint, not step 2's: exit 1, one line
    that says the disk is full (once torch's 'unexpected pos 33920 vs 33808'), step 0's ckpt.pt intact
    and no temporary file left."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    run_dir = mount_point / "run"
    check = (f'{sys.executable} -c "import torch, os; print(\'saved\', torch.load(\'{run_dir}/ckpt.pt\')[\'iter_num\'], '
             f'sorted(os.listdir(\'{run_dir}\')))"')
    result = run(in_tmpfs(str(mount_point), "size=120k", train_command(str(run_dir), data_dir), after=check))
    one_line(result, 1, f"cannot write {run_dir / 'ckpt.pt'}: the disk is full (No space left on device; ",
             f"{run_dir / 'ckpt.pt'} is intact")
    saved = result.stdout.splitlines()[-1]
    assert saved.startswith("saved 0 [") and ".tmp" not in saved, saved


# 4. output paths checked before any long work -----------------------------------------------------
@pytest.mark.slow
def test_evaluate_refuses_an_unwritable_out_before_it_reads_anything(tmp_path, data_dir, finished_run):  # noqa: F811
    """--out under a file and under /proc: exit 1 at once, one line naming --out. The dataset given is
    broken too (meta.json a directory): the message is still --out's, so the check came before any
    reading, let alone the evaluation (once a traceback after the whole evaluation)."""
    data = str(tmp_path / "data")
    shutil.copytree(data_dir, data)
    _directory_in_place(os.path.join(data, "meta.json"))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    before = snapshot(str(tmp_path), finished_run)
    for out, message in ((a_file / "eval.json", f"is under {a_file}, which is a file, not a directory"),
                         ("/proc/no_such_dir/eval.json", "cannot create files in /proc")):
        result = run([sys.executable, "evaluate.py", os.path.join(finished_run, "best.pt"), f"--out={out}",
                      f"--data_dir={data}"])
        one_line(result, 1, f"--out {out}", message)
        assert result.stdout == ""
    assert snapshot(str(tmp_path), finished_run) == before


@pytest.mark.slow
@needs_namespaces
def test_evaluate_tells_a_read_only_out_from_a_full_one(tmp_path, finished_run):
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    evaluate = [sys.executable, "evaluate.py", os.path.join(finished_run, "best.pt"), f"--out={mount_point / 'e.json'}"]
    result = run(in_tmpfs(str(mount_point), "ro", evaluate))
    one_line(result, 1, f"--out {mount_point / 'e.json'}: cannot write {mount_point}: permission denied "
                        "(Read-only file system)")
    fill = in_tmpfs(str(mount_point), "size=4k", ["sh", "-c", f'head -c 4096 /dev/zero > "{mount_point}/fill" && '
                                                              'exec "$@"', "sh", *evaluate])
    result = run(fill)
    one_line(result, 1, f"--out {mount_point / 'e.json'}: cannot write {mount_point}: the disk is full")


# 5. the tools' and prepare_shakespeare.py's arguments ---------------------------------------------
def tool_cases(tmp, data, best, run_dir):
    a_file = os.path.join(tmp, "a_file")
    py = sys.executable
    return [  # (command, status, part of the message)
        ([py, "prepare_shakespeare.py", "--sha256", "xyz", "--out_dir", f"{tmp}/p"], 2, "--sha256: invalid sha256 'xyz'"),
        ([py, "prepare_shakespeare.py", "--input", f"{tmp}/missing.txt", "--out_dir", f"{tmp}/p"], 1,
         f"input file {tmp}/missing.txt not found"),
        ([py, "prepare_shakespeare.py", "--input", f"{data}/meta.json", "--out_dir", f"{a_file}/p"], 1,
         f"--out_dir {a_file}/p is under {a_file}, which is a file"),
        ([py, "prepare_shakespeare.py", "--input", f"{data}/meta.json", "--out_dir", "/proc/no_such_dir"], 1,
         "--out_dir /proc/no_such_dir: cannot create files in /proc"),
        ([py, "-m", "tools.compare", "lowres", "--workers", "0", "--root", f"{tmp}/r", "--archive", f"{tmp}/a",
          "--results", f"{tmp}/res"], 2, "--workers must be >= 1 (runs at a time), got 0"),
        ([py, "-m", "tools.compare", "lowres", "--root", f"{tmp}/r", "--archive", f"{tmp}/a",
          "--results", f"{a_file}/res"], 1, f"--results {a_file}/res is under {a_file}"),
        ([py, "-m", "tools.bench", "--section", "cwt", "--steps", "0"], 2, "--steps must be >= 1, got 0"),
        ([py, "-m", "tools.bench", "--section", "cwt", "--out", "/proc/no_such_dir/b.md"], 1,
         "--out /proc/no_such_dir/b.md: cannot create files in /proc"),
        ([py, "-m", "tools.memory_table", "config/lowres_baseline.py", "--gpus", "0"], 2,
         "processes must be a positive integer, got 0"),
        *([([py, "-m", "tools.plot_run", run_dir, "--out", f"{a_file}/log.png"], 1, f"--out {a_file}/log.png is under")]
          if importlib.util.find_spec("matplotlib") else []),  # an optional extra (the floor's venv has none)
        ([py, "-m", "tools.lm_eval_task", "--data_dir", data, "--out", f"{tmp}/lm", "--limit", "0"], 2,
         "--limit must be >= 1, got 0"),
        ([py, "-m", "tools.lm_eval_task", "--data_dir", data, "--out", f"{a_file}/lm"], 1, f"--out {a_file}/lm is under"),
        ([py, "-m", "tools.export_hf", best, "/proc/no_such_dir/hf", "--no_check"], 1,
         "out_dir /proc/no_such_dir/hf: cannot create files in /proc"),
        ([py, "evaluate.py", best, "--out", f"{data}", "--overwrite"], 1, f"--out {data} is a directory, not a file"),
        # (once, as root, /dev/null itself replaced by the metrics: the write renames a file over --out)
        ([py, "evaluate.py", best, "--out", "/dev/null", "--overwrite"], 1, "--out /dev/null is not a regular file"),
    ]


def in_process(cmd, capfd, monkeypatch):
    """cmd ([python, a script or -m module, arguments...]) run as `python` would run it, but in this
    process (the process boundary is not what the sweep tests): its exit status and its stderr."""
    monkeypatch.chdir(REPO)
    module = cmd[1] == "-m"
    target, argv = (cmd[2], cmd[3:]) if module else (cmd[1], cmd[2:])
    monkeypatch.setattr(sys, "argv", [target, *argv])
    monkeypatch.delitem(sys.modules, target, raising=False)  # run afresh as __main__, as python -m does
    capfd.readouterr()
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    return status, capfd.readouterr().err


@pytest.mark.slow  # the shared finished_run is a train.py process
def test_tools_refuse_bad_arguments_and_unusable_paths(tmp_path, data_dir, finished_run, capfd, monkeypatch):
    """Each script: a bad argument is exit 2, an unusable path exit 1, one line, nothing written
    (once: ZeroDivisionError for --workers 0, StatisticsError for --steps 0, FileNotFoundError or
    NotADirectoryError tracebacks for outputs under /proc or a file, after the work for bench).
    In this process: the scripts' one catch of a UserError is what ends them (errors.end_with), the
    same with or without a process around it; test_a_config_that_exits_or_raises_is_a_config_error
    and the tests above run them as processes."""
    tmp = str(tmp_path / "work")
    os.mkdir(tmp)
    with open(os.path.join(tmp, "a_file"), "w") as f:
        f.write("x")
    before = snapshot(tmp, data_dir, finished_run)
    failures = []
    for cmd, status, message in tool_cases(tmp, data_dir, os.path.join(finished_run, "best.pt"), finished_run):
        returncode, stderr = in_process(cmd, capfd, monkeypatch)
        lines = [line for line in stderr.splitlines() if line.strip()]
        if not (returncode == status and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]):
            failures.append((cmd[1:4], returncode, stderr[-500:]))
    assert not failures, failures
    assert snapshot(tmp, data_dir, finished_run) == before


# 6. a long step is announced before it starts -----------------------------------------------------
def test_the_notice_of_a_long_step():
    import speed
    assert speed.long_work_notice(1e12, 1e9, 1e11) is None  # 25 s at 40 %
    notice = speed.long_work_notice(6e13, 1e9, 1e11)  # 1500 s
    assert notice.startswith("note: one step will take about 25 min on this device (plan: 60.0 TFLOP per step")
    assert notice.endswith("at MFU 40% of 100 GFLOP/s); the first log line comes after it")
    assert "one evaluation will take about 17 min" in speed.long_work_notice(1e9, 4e13, 1e11)


@pytest.mark.slow
def test_a_step_that_takes_minutes_is_announced_before_it_starts(tmp_path, data_dir):  # noqa: F811
    """20,000 micro-steps of the default model (15M tokens, ~80 TFLOP) make one step of most of an
    hour on a CPU: the notice comes before the first step (no training record in the log yet), and
    the test ends the run with SIGKILL (a SIGTERM would wait for the step)."""
    out = tmp_path / "big"
    cmd = [sys.executable, "-u", "train.py", f"--data_dir={data_dir}", f"--out_dir={out}", "--num_threads=1",
           "--eval_iters=1", "--gradient_accumulation_steps=20000"]
    process = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline, lines = time.time() + 240, []
        while time.time() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("note: "):
                break
        log = (out / "log.jsonl").read_text() if (out / "log.jsonl").exists() else ""
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert lines and lines[-1].startswith("note: one step will take about "), lines
    assert "the first log line comes after it" in lines[-1]
    assert '"loss"' not in log
