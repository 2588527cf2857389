"""Small shared pieces: device and precision choice, atomic writes,
path checks, the stop request, peak FLOP/s.

torch is imported inside the functions that use it: the data scripts
write their files with atomic_write without loading it."""

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
    """Tell glibc's malloc to keep freed blocks over 32 MB (a step's
    logits) for reuse (docs/performance.md); off glibc, a no-op."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt parameters from glibc's malloc.h
    M_TRIM_THRESHOLD = -1
    M_MMAP_MAX = -4
    kept = bool(libc.mallopt(M_MMAP_MAX, 0))
    return kept and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def choose_device(device="auto"):
    """'auto' picks cuda > mps > cpu; a device named that is not here
    is a ValueError naming what there is."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": mps is not None and mps.is_available()}
    if device == "auto":
        return next(k for k in ("cuda", "mps", "cpu") if available[k])
    kind, _, index = device.partition(":")
    if kind not in available:
        raise ValueError(f"device {device!r} is not one of auto, cpu, cuda, cuda:N, mps")
    if not available[kind]:
        have = ", ".join(k for k, ok in available.items() if ok)
        raise ValueError(f"device {device!r} was asked for, but this machine has no "
                         f"{kind.upper()} device (available: {have}; or device=auto)")
    count = torch.cuda.device_count() if kind == "cuda" else 0
    if index and kind == "cuda" and not (index.isdigit() and int(index) < count):
        raise ValueError(f"device {device!r}: there are {count} CUDA device(s)")
    return device


def available_memory(device):
    """(bytes this process may allocate on device, their source): a
    GPU's free memory, or its share of the RAM available under the
    cgroup's limit."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":  # before train.py picks LOCAL_RANK's GPU
        if device.index is None:
            device = torch.device("cuda", launched("LOCAL_RANK", 0))
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{torch.cuda.get_device_name(device)} free memory"
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        return torch.mps.recommended_max_memory(), "the recommended Metal working set"
    available = _meminfo_available()
    source = "available RAM"
    limit = _cgroup_memory_left()
    if limit is not None and limit < available:
        available = limit
        source = "RAM left under the cgroup's memory.max"
    local = launched("LOCAL_WORLD_SIZE", 1)
    if local > 1:
        available //= local
        source = f"{source} / {local} processes"
    return available, source


def _meminfo_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # macOS


def _cgroup_memory_left():
    """The cgroup's memory limit minus its usage (v2, v1), or None."""
    for limit_file, usage_file in (
            ("memory.max", "memory.current"),
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
    """Whether `device` has float64 (MPS: no; docs/devices.md)."""
    import torch

    return torch.device(device).type != "mps"


def widest_float(device):
    """float64 for statistics where `device` has it, else float32."""
    import torch

    return torch.float64 if has_float64(device) else torch.float32


def choose_dtype(dtype, device):
    """'auto': bf16 autocast on a GPU that has it, float16 with loss
    scaling on an older GPU, float32 on CPU and MPS (docs/model.md)."""
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


def _temporary_prefix(name):
    # cut: a temporary name fits wherever `name` fits (255 bytes)
    return "." + name[:200] + "."


def atomic_write(path, write_fn):
    """Write through a temp file beside `path`, renamed over it: a
    reader (or a crash) never sees a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = _temporary_prefix(os.path.basename(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        umask = os.umask(0)
        os.umask(umask)
        # mkstemp makes 0600; give the file the mode open() would
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def remove_leftovers(directory, names):
    """Remove (and name) a killed atomic_write's temporary files."""
    removed = []
    prefixes = tuple(_temporary_prefix(name) for name in names)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        path = os.path.join(directory, name)
        if name.startswith(prefixes) and name.endswith(".tmp") and os.path.isfile(path):
            os.remove(path)
            removed.append(name)
    return removed


def torch_save(obj, path):
    """torch.save, raising a failed write's OSError (a full disk), not
    torch's 'unexpected pos N vs M'."""
    import torch

    class Recording:  # a file that keeps the first error it met
        def __init__(self, f):
            self.f = f
            self.error = None

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


NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class PathError(UserError):
    """An output path that cannot be written: one line naming it and why."""


def write_failure(path, error):
    """One line for an OSError writing path: no permission, a full
    disk, or the error with the space left on that disk."""
    if error.errno in NO_PERMISSION:
        return f"cannot write {path}: permission denied ({error.strerror})"
    disk = shutil.disk_usage(_nearest_existing(os.path.abspath(path)))
    free = f"{disk.free / 2**20:,.0f} MiB free on that disk"
    if error.errno in NO_SPACE:
        return f"cannot write {path}: the disk is full ({error.strerror}; {free})"
    return f"cannot write {path}: {error.strerror or error} ({free})"


def _nearest_existing(path):
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_name_lengths(target, what, path):
    """PathError now, not 'File name too long' after the work."""
    existing = _nearest_existing(target)
    if not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        return
    for name in os.path.relpath(target, existing).split(os.sep):
        size = len(os.fsencode(name))
        if size > name_max:
            raise PathError(f"{what} {path}: a name in it is {size} bytes, longer than "
                            f"the {name_max} this file system allows; give a shorter one")
    size = len(os.fsencode(target))
    if size >= path_max:
        raise PathError(f"{what} {path}: the path is {size} bytes, longer than the "
                        f"{path_max - 1} this file system allows; give a shorter one")


def check_writable(path, what, directory=False):
    """PathError, before any long work, unless `path` (a file, or a
    folder if directory) can be written, tried with a temporary file.
    `what` names the argument (--out)."""
    target = os.path.abspath(path)
    check_name_lengths(target, what, path)
    if os.path.exists(target):
        if directory and not os.path.isdir(target):
            raise PathError(f"{what} {path} is a file, not a directory")
        if not directory and not os.path.isfile(target):
            kind = ("a directory, not a file" if os.path.isdir(target) else
                    "not a regular file (a device or a pipe); give a file's path")
            raise PathError(f"{what} {path} is {kind}")
    parent = _nearest_existing(target if directory else os.path.dirname(target))
    if not os.path.isdir(parent):
        raise PathError(f"{what} {path} is under {parent}, which is a file, not a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".write-check-", suffix=".tmp")
    except OSError as e:
        if e.errno in NO_PERMISSION + NO_SPACE:
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
    """UsageError for the first wrong one of (wrong, message) pairs."""
    for wrong, message in checks:
        if wrong:
            raise UsageError(message)


class StopRequest:
    """SIGNALS as a stop the training loop reads between steps, to
    save and exit 128 + the signal; a second SIGINT or SIGTERM ends
    the process at once (docs/runs.md#a-stop-is-agreed-every-step)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)

    def __init__(self, announce=True):
        self.signum = None
        self.since = None
        self.announce = announce  # rank 0
        for signum in self.SIGNALS:
            signal.signal(signum, self._note)

    # a SIGTERM this soon after the first is the same stop passed on
    # (by Slurm to every process, by torchrun to its workers)
    REPEAT_S = 2.0

    def _note(self, signum, frame):
        if (signum == signal.SIGTERM == self.signum
                and time.monotonic() - self.since < self.REPEAT_S):
            return
        name = signal.Signals(signum).name
        if self.signum is not None and signum in (signal.SIGINT, signal.SIGTERM):
            print(f"\n{name} while a stop was pending: ending now, without saving this "
                  f"step; the last checkpoint is as it was", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        if signum == signal.SIGHUP:
            # prints go nowhere, as under nohup, not fail with EIO
            detach_from_terminal()
        if self.signum is None:
            if self.announce:  # os.write: we may be inside a write to stderr
                os.write(2, f"\n{name}: stopping after this step (an evaluation stops at "
                            f"once), saving a checkpoint; a second Ctrl-C ends now without "
                            f"saving it\n".encode())
            self.signum = signum
            self.since = time.monotonic()

    @property
    def name(self):
        return signal.Signals(self.signum).name if self.signum else None

    def release(self):
        """Give the signals their default actions back."""
        for signum in self.SIGNALS:
            sigint = signum == signal.SIGINT
            signal.signal(signum, signal.default_int_handler if sigint else signal.SIG_DFL)


def detach_from_terminal():
    """Point stdout and stderr at /dev/null where they are a terminal
    (a character device: a hung-up one fails isatty)."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        if stat.S_ISCHR(os.fstat(fd).st_mode):
            os.dup2(null, fd)
    os.close(null)


def launched(name, default):
    """The count or index torchrun sets in `name`, or default."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise UsageError(f"environment variable {name} must be a whole number >= 0 "
                         f"(torchrun sets it), got {value!r}")
    return int(value)


def markdown_table(header, rows):
    """A Markdown table as lines: its header, the rule under it and a
    line per row (each cell through str)."""
    return (["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
            + ["| " + " | ".join(str(cell) for cell in row) + " |"
               for row in rows])


def save_json(obj, path):
    save_text(json.dumps(obj, indent=2) + "\n", path)


def save_text(text, path):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:  # whatever the locale
            f.write(text)
    atomic_write(path, write)


# Dense bf16 tensor-core peaks (no sparsity) of common GPUs, for MFU.
GPU_PEAK_BF16_FLOPS = {
    "H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12,
    "A800": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def seconds(work, device):
    """Wall-clock seconds of work(), CUDA synchronized at both ends."""
    import torch

    sync = torch.cuda.synchronize if str(device).startswith("cuda") else lambda: None
    sync()
    t0 = time.perf_counter()
    work()
    sync()
    return time.perf_counter() - t0


def measure_matmul_flops(device="cpu", dtype=None, n=2048, repeats=3):
    """FLOP/s of the best of `repeats` n x n matmuls in `dtype`. The
    size doubles from 256 while one takes under 50 ms: an emulated
    dtype is measured in a second, not minutes."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    generator = torch.Generator(device=device).manual_seed(0)  # not a run's
    size = min(256, n)
    while True:
        a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=generator)
                for _ in range(2))
        a @ b  # warm-up
        if size >= n or seconds(lambda: a @ b, device) > 0.05:
            break
        size = min(2 * size, n)
    best = min(seconds(lambda: a @ b, device) for _ in range(repeats))
    return 2 * size ** 3 / best


def peak_flops(device, dtype):
    """Peak FLOP/s for MFU: a known GPU's datasheet, else measured."""
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
    """log.jsonl's records, a torn last line left out with a note;
    LogError if missing, damaged or (unless allow_empty) empty."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        out_dir = os.path.dirname(path) or "."
        raise LogError(f"cannot read {path}: {e.strerror} "
                       f"(is {out_dir} a train.py out_dir?)") from None
    except UnicodeDecodeError as e:  # train.py writes ASCII JSON
        byte = f"byte 0x{e.object[e.start]:02x} at position {e.start}"
        raise LogError(f"{path} is not text ({byte}): the log is damaged") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                print(f"note: {path} ended in a torn line (a run killed mid-write, "
                      f"or one writing now); it is left out")
                break
            raise LogError(f"line {number} of {path} is not JSON: the log is damaged") from None
        if not isinstance(record, dict) or not isinstance(record.get("iter"), int):
            raise LogError(f"line {number} of {path} is not a train.py record "
                           f"(an object with an integer 'iter')")
        records.append(record)
    if not records and not allow_empty:
        raise LogError(f"{path} holds no records yet "
                       f"(a run logs its first evaluation at step 0)")
    return records


def duration(seconds):
    """A time in s, min or h, whichever shows it."""
    if seconds < 60:
        return f"{seconds:.2g} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.1f} h"
