"""Small shared pieces: device and precision choice, float64 support, atomic file writes, peak
FLOP/s for MFU.

torch is imported inside the functions that use it, so the data-preparation scripts (and every
tokenizer process of prepare_c4.py) write their files with atomic_write without loading torch."""

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time

from errors import UsageError, UserError


def keep_freed_memory():
    """Tell glibc's malloc to keep freed memory for reuse instead of handing it back to the OS.
    By default every block above 32 MB is mmap-ed on allocation and munmap-ed on free, so the next
    block of that size faults all its pages in again, each one zeroed by the kernel. With a
    50304-token vocabulary every step's logits are such blocks (1024 tokens: 206 MB), and the page
    faults can cost more than the matmuls (measured in docs/performance.md). A no-op off
    Linux/glibc. Memory stays at the process's peak instead of shrinking between steps."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters from glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def choose_device(device="auto"):
    """'auto' picks cuda > mps > cpu. A device named explicitly must exist here: ValueError with
    what was asked and what there is, instead of a failure deep inside the first tensor op."""
    import torch

    if device != "auto":
        kind, _, index = device.partition(":")
        mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
        available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": mps}
        if kind not in available:
            raise ValueError(f"device {device!r} is not one of auto, cpu, cuda, cuda:N, mps")
        if not available[kind]:
            raise ValueError(f"device {device!r} was asked for, but this machine has no {kind.upper()} "
                             f"device (available: {', '.join(k for k, ok in available.items() if ok)}; "
                             f"or device=auto)")
        if kind == "cuda" and index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
            raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA device(s)")
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def available_memory(device):
    """(bytes this process may allocate on device, where that figure comes from): a CUDA GPU's free
    memory; on the CPU the RAM the kernel reports available (MemAvailable), capped by the cgroup's
    memory limit (a container or a scheduler's job), shared by the processes torchrun started on
    this machine; on MPS the Metal working set the system recommends."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":  # (before train.py picks its GPU under torchrun: LOCAL_RANK's)
        device = torch.device("cuda", device.index if device.index is not None
                              else launched("LOCAL_RANK", 0))
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{torch.cuda.get_device_name(device)} free memory"
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        return torch.mps.recommended_max_memory(), "the recommended Metal working set"
    available, source = _meminfo_available(), "available RAM"
    limit = _cgroup_memory_left()
    if limit is not None and limit < available:
        available, source = limit, "RAM left under the cgroup's memory.max"
    local = launched("LOCAL_WORLD_SIZE", 1)
    if local > 1:
        available, source = available // local, f"{source} / {local} processes"
    return available, source


def _meminfo_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # macOS: physical RAM


def _cgroup_memory_left():
    """The cgroup's memory limit minus its usage (v2: memory.max, v1: memory.limit_in_bytes, as a
    container or a scheduler's job sees them), None when unlimited or unknown."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join("/sys/fs/cgroup", limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join("/sys/fs/cgroup", usage_file)) as f:
                usage = int(f.read())
            return None if limit == "max" else int(limit) - usage
        except (OSError, ValueError):
            continue
    return None


def has_float64(device):
    """Whether tensors on `device` can be float64. Apple's MPS has none: a statistic that is float64
    elsewhere is computed there in float32 (widest_float) or on the CPU (docs/devices.md)."""
    import torch

    return torch.device(device).type != "mps"


def widest_float(device):
    """The dtype statistics are computed and summed in on `device`: float64 where it has it (CPU and
    CUDA results stay as they were), float32 where it has not (their error is bounded in
    tests/test_float32_stats.py)."""
    import torch

    return torch.float64 if has_float64(device) else torch.float32


def choose_dtype(dtype, device):
    """'auto': bf16 autocast on a GPU that supports it (Ampere and later); float16 autocast with
    loss scaling on an older GPU (V100, T4: fp16 tensor cores, no bf16), which would otherwise
    train in plain fp32 at a fraction of its speed; float32 on CPU and MPS. On CPU bf16 is only
    faster where the CPU has bf16 matrix units (torch.backends.cpu.get_cpu_capability()); on an
    AVX2-only CPU a bf16 matmul runs ~100x slower than fp32, so we never pick it by default."""
    import torch

    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def autocast_context(device, dtype):
    import torch

    if dtype == "float32":
        return contextlib.nullcontext()
    device_type = "cuda" if device.startswith("cuda") else device
    return torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def atomic_write(path, write_fn):
    """Write to a temp file in the same directory, then rename over `path`: a reader (or a crash)
    never sees a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # the temporary name is cut so that it fits wherever the file's own name fits (255 bytes)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path)[:200] + ".", suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def remove_leftovers(directory, names):
    """Remove the temporary files that atomic_write left in directory for any of `names` when its
    process was killed (SIGKILL, or SIGTERM's default action: no time to clean up); return their
    names. For a script that owns those names there, at its start (prepare_shakespeare.py)."""
    removed = []
    prefixes = tuple("." + name[:200] + "." for name in names)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if (name.startswith(prefixes) and name.endswith(".tmp")
                and os.path.isfile(os.path.join(directory, name))):
            os.remove(os.path.join(directory, name))
            removed.append(name)
    return removed


def torch_save(obj, path):
    """torch.save to path, with the OSError of a failed write (a full disk, no permission) raised as
    it is: torch's zip writer would report it as 'unexpected pos N vs M', a RuntimeError that says
    neither. The writes go through a Python file that keeps the first error it met."""
    import torch

    class Recording:
        def __init__(self, f):
            self.f, self.error = f, None

        def write(self, data):
            try:
                return self.f.write(data)
            except OSError as e:
                self.error = self.error or e
                raise

        def flush(self):
            self.f.flush()

    with open(path, "wb") as f:
        recording = Recording(f)
        try:
            torch.save(obj, recording)
        except RuntimeError:
            if recording.error is not None:
                raise recording.error from None
            raise


class PathError(UserError):
    """An output path that cannot be written: one line naming it and why."""


def write_failure(path, error):
    """One line for an OSError met writing path, the two usual causes told apart: no permission
    (EACCES, EPERM, a read-only file system) is not a full disk (ENOSPC, a quota), and each needs
    another fix. Anything else is named with the space left on that disk."""
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {path}: permission denied ({error.strerror})"
    directory = os.path.abspath(path)
    while not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    free = f"{shutil.disk_usage(directory).free / 2**20:,.0f} MiB free on that disk"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write {path}: the disk is full ({error.strerror}; {free})"
    return f"cannot write {path}: {error.strerror or error} ({free})"


def check_name_lengths(target, what, path):
    """PathError when a name in the part of target still to be made (or target's own name) is longer
    than the file system allows, or the whole path is: one line now, not 'File name too long' after
    the work."""
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    existing = existing if os.path.isdir(existing) else os.path.dirname(existing)
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        return
    for name in os.path.relpath(target, existing).split(os.sep):
        if len(os.fsencode(name)) > name_max:
            raise PathError(f"{what} {path}: a name in it is {len(os.fsencode(name))} bytes, longer than the "
                            f"{name_max} this file system allows; give a shorter one")
    if len(os.fsencode(target)) >= path_max:
        raise PathError(f"{what} {path}: the path is {len(os.fsencode(target))} bytes, longer than the "
                        f"{path_max - 1} this file system allows; give a shorter one")


def check_writable(path, what, directory=False):
    """Raise PathError unless `path` (a file, or with directory=True a folder to write files in)
    can be written, before any long work: a script that would fail at its end loses the work.
    Nothing is left behind: a byte is written to a temporary file in the nearest folder that
    exists (where the missing folders would be made, or the file renamed into place), then removed.
    `what` names the argument in the message (--out)."""
    target = os.path.abspath(path)
    check_name_lengths(target, what, path)
    if os.path.exists(target):
        if directory and not os.path.isdir(target):
            raise PathError(f"{what} {path} is a file, not a directory")
        if not directory and not os.path.isfile(target):
            raise PathError(f"{what} {path} is "
                            + ("a directory, not a file" if os.path.isdir(target) else
                               "not a regular file (a device or a pipe); give a file's path"))
    parent = target if directory else os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PathError(f"{what} {path} is under {parent}, which is a file, not a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".write-check-", suffix=".tmp")
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise PathError(f"{what} {path}: {write_failure(parent, e)}") from None
        raise PathError(f"{what} {path}: cannot create files in {parent} ({e.strerror})") from None
    try:
        os.write(fd, b"\0")
        os.fsync(fd)
    except OSError as e:
        raise PathError(f"{what} {path}: {write_failure(parent, e)}") from None
    finally:
        os.close(fd)
        os.remove(tmp)


def check_arguments(*checks):
    """checks: (wrong, message) pairs, made where a script parses its arguments, before it reads
    or writes anything: the first wrong one raises UsageError (one line, status 2)."""
    for wrong, message in checks:
        if wrong:
            raise UsageError(message)


class StopRequest:
    """Turn SIGINT (Ctrl-C), SIGTERM (`kill`, torchrun passing on a stop), SIGUSR1 or SIGUSR2 (what a
    cluster scheduler such as SLURM's --signal sends before preempting a job) and SIGHUP (the
    terminal closed, an ssh dropped) into a request the training loop reads between steps: it says so at once (one line on stderr; announce=False: ranks
    other than 0), finishes the step (an evaluation stops between its batches), writes a checkpoint
    and exits with 128 + the signal's number, the shell's convention for "ended by a signal". A
    second SIGINT or SIGTERM while a stop is pending (a step or an evaluation that takes long, a
    user who means it) ends the process at once with that status, saying so: a checkpoint being
    written is left as it was (writes are atomic), so the run resumes from its last one. A SIGTERM
    within REPEAT_S of the first is not a second one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)

    def __init__(self, announce=True):
        self.signum, self.since, self.announce = None, None, announce  # announce: say so at once (rank 0)
        for signum in self.SIGNALS:
            signal.signal(signum, self._note)

    # a SIGTERM this soon after the first is the same stop passed on, not a user's second: under
    # Slurm every process of a job step gets one and torchrun forwards its own to its workers
    REPEAT_S = 2.0

    def _note(self, signum, frame):
        if signum == signal.SIGTERM == self.signum and time.monotonic() - self.since < self.REPEAT_S:
            return
        if self.signum is not None and signum in (signal.SIGINT, signal.SIGTERM):
            print(f"\n{signal.Signals(signum).name} while a stop was pending: ending now, without saving "
                  f"this step; the last checkpoint is as it was", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        if signum == signal.SIGHUP:  # a closed terminal: what the run still prints goes nowhere, as
            detach_from_terminal()   # nohup would send it, instead of failing the save with EIO
        # os.write: the handler may run inside a write to stderr (tqdm)
        if self.signum is None and self.announce:
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step (an evaluation stops at "
                        f"once), saving a checkpoint; a second Ctrl-C ends now without saving it\n".encode())
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()

    @property
    def name(self):
        return signal.Signals(self.signum).name if self.signum else None

    def release(self):
        """Give the signals their default actions back (Ctrl-C raises KeyboardInterrupt again)."""
        for signum in self.SIGNALS:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def detach_from_terminal():
    """Point stdout and stderr at /dev/null where they are a terminal (a character device: one that
    has hung up no longer answers isatty); a file or a pipe they write to is kept."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        if stat.S_ISCHR(os.fstat(fd).st_mode):
            os.dup2(null, fd)
    os.close(null)


def launched(name, default):
    """A count or an index that torchrun sets (WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE), or
    default where it is not set; set by hand to anything but a whole number, a UsageError."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise UsageError(f"environment variable {name} must be a whole number >= 0 (torchrun sets it), "
                         f"got {value!r}")
    return int(value)


def save_json(obj, path):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    atomic_write(path, write)


def save_text(text, path):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:  # the same bytes whatever the locale
            f.write(text)
    atomic_write(path, write)


# Dense bf16 tensor-core peaks (no sparsity) of common GPUs, for MFU on CUDA.
GPU_PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12,
                       "A800": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def seconds(work, device):
    """Wall-clock seconds of work(). On CUDA, kernels run asynchronously: the device is
    synchronized before the clock starts and before it stops, so the time is the work's own."""
    import torch

    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    work()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure_matmul_flops(device="cpu", dtype=None, n=2048, repeats=3):
    """The machine's practical peak: FLOP/s of the best of `repeats` n x n matmuls in `dtype`
    (a torch dtype; float32 if None). The size starts at 256 and doubles up to n while one
    matmul takes under 50 ms: a dtype the device only emulates (float16 on most CPUs, ~1
    GFLOP/s) is measured in a second, not the minutes a 2048 x 2048 product would take."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    generator = torch.Generator(device=device).manual_seed(0)  # never touch the global RNG of a run
    size = min(256, n)
    while True:
        a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
        b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
        a @ b  # warm-up
        if size >= n or seconds(lambda: a @ b, device) > 0.05:
            break
        size = min(2 * size, n)
    best = min(seconds(lambda: a @ b, device) for _ in range(repeats))
    return 2 * size ** 3 / best


def peak_flops(device, dtype):
    """Peak FLOP/s used as the MFU denominator: the datasheet value for known GPUs, otherwise a
    measured matmul (CPUs differ too much from machine to machine for a table)."""
    import torch

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for key, value in GPU_PEAK_BF16_FLOPS.items():
            if key in name:
                return value
    return measure_matmul_flops(device, getattr(torch, dtype))


class LogError(UserError):
    """A log.jsonl that cannot be read as train.py's records."""


def read_log(path, allow_empty=False):
    """log.jsonl's records. A torn last line (a run killed mid-write, or one writing right now) is
    left out with a note; a missing log, a damaged line elsewhere or (unless allow_empty) a log
    without records is a LogError. train.py's resume (run.trim_log), the plot and the grid
    tools all read logs here."""
    try:
        with open(path) as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror} "
                       f"(is {os.path.dirname(path) or '.'} a train.py out_dir?)") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                print(f"note: {path} ended in a torn line (a run killed mid-write, or one writing now); "
                      f"it is left out")
                break
            raise LogError(f"line {number} of {path} is not JSON: the log is damaged") from None
        if not isinstance(record, dict) or not isinstance(record.get("iter"), int):
            raise LogError(f"line {number} of {path} is not a train.py record "
                           f"(an object with an integer 'iter')")
        records.append(record)
    if not records and not allow_empty:
        raise LogError(f"{path} holds no records yet (a run logs its first evaluation at step 0)")
    return records


def duration(seconds):
    """A time in the unit that shows it: seconds under a minute, minutes under an hour, then hours
    (a toy's run would read 0.0 in hours)."""
    if seconds < 60:
        return f"{seconds:.2g} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.1f} h"
