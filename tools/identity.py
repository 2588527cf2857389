"""
What a grid's run is, so that a comparison pairs only like runs.

A run's identity, recorded in its run.json when it finishes: the
training keys of each stage (train.py's config less NOT_TRAINING), the
code's version (the git commit, "+dirty" with uncommitted changes) and
the CPU model (docs/runs.md#which-runs-a-table-may-pair).

Runs archived before the record existed are read by one rule (`of_run`):
their training keys are their run.json commands resolved against today's
config files and train.py defaults (a config file's later edit is not
seen), their commit is unknown, and their CPU is the grid's when every
call in its wall.json names the same CPU, unknown otherwise.
"""

import datetime
import functools
import hashlib
import json
import os
import platform
import subprocess
import time

from configurator import ConfigError, parse_config, train_defaults
from utils import save_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train.py's keys that do not change what a run computes: where it writes and reads, threads,
# logging, the hang watchdog's limits, and the chain's link to its previous stage
NOT_TRAINING = ("out_dir", "data_dir", "data_source", "init_from", "overwrite",
                "resume_changes", "num_threads", "dry_run", "check_memory", "log_interval",
                "wandb_log", "wandb_project", "wandb_run_name", "collective_timeout",
                "hang_factor")
UNKNOWN = "unknown"


def read_json(path):
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=1)
def _defaults():
    return json.dumps(train_defaults())


def training_keys(commands):
    """[{key: value}] of each stage's train.py command, NOT_TRAINING left
    out; None if a command no longer parses (a config file or key since
    removed)."""
    defaults = json.loads(_defaults())
    stages = []
    for cmd in commands:
        argv = [a if a.startswith("--") or os.path.isabs(a) else os.path.join(REPO, a)
                for a in cmd[2:]]
        try:
            config = parse_config(argv, defaults)
        except ConfigError:
            return None
        stages.append(training(json.loads(json.dumps(config))))
    return stages


def training(config):
    """A train.py config less its NOT_TRAINING keys."""
    return {k: v for k, v in config.items() if k not in NOT_TRAINING}


def cpuinfo():
    """/proc/cpuinfo's text ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_name():
    for line in cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git(*args):
    """What a git command in the repository printed (bytes), None outside git."""
    try:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def commit():
    """The repository's HEAD, '+dirty' when tracked files differ from it; 'unknown' outside git."""
    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if head is None or dirty is None:
        return UNKNOWN
    return head.decode().strip() + ("+dirty" if dirty.strip() else "")


def git_diff_sha256():
    """sha256 of `git diff HEAD` (tracked files): which uncommitted changes a dirty run ran with."""
    diff = git("diff", "HEAD")
    return UNKNOWN if diff is None else hashlib.sha256(diff).hexdigest()


def utc(seconds):
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="seconds")


def mark_start(out_dir):
    """Record when a run first started (started.json in out_dir; a resumed run keeps the first)."""
    path = os.path.join(out_dir, "started.json")
    if not os.path.exists(path):
        save_json({"utc_start": utc(time.time())}, path)


def started(out_dir):
    path = os.path.join(out_dir, "started.json")
    return read_json(path)["utc_start"] if os.path.exists(path) else UNKNOWN


def provenance(commands, utc_start):
    """Where, when and from what code a finished run came (its run.json's
    `provenance`)."""
    import torch
    head = commit()
    dirty = head.endswith("+dirty")
    keys = json.dumps(training_keys(commands), sort_keys=True).encode()
    return {
        "utc_start": utc_start,
        "utc_end": utc(time.time()),
        "commit": head.split("+")[0],
        "dirty": dirty,
        "diff_sha256": git_diff_sha256() if dirty else None,
        "config_sha256": hashlib.sha256(keys).hexdigest(),
        "cpu": cpu_name(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "host": platform.node(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commands": commands,
    }


def record(commands):
    """The identity a run's run.json keeps."""
    return {"training": training_keys(commands), "commit": commit(), "cpu": cpu_name()}


def grid_cpu(archive, grid):
    """The CPU of every call in the grid's wall.json when they all name one, else unknown."""
    path = os.path.join(archive, grid, "wall.json")
    if not os.path.exists(path):
        return UNKNOWN
    cpus = {call["cpu"] for call in read_json(path)["calls"]}
    return cpus.pop() if len(cpus) == 1 else UNKNOWN


def of_run(directory, cpu_of_grid=UNKNOWN):
    """A run's identity: recorded, or inferred by the module's rule for
    older runs ("inferred": True); None without a run.json."""
    path = os.path.join(directory, "run.json")
    if not os.path.exists(path):
        return None
    run = read_json(path)
    if "identity" in run:
        recorded = run["identity"]
        return {**recorded, "code": code(recorded["commit"], run.get("provenance", {}))}
    return {"training": training_keys(run["commands"]), "commit": UNKNOWN, "code": UNKNOWN,
            "cpu": cpu_of_grid, "inferred": True}


def code(commit, provenance):
    """The code a run trained with: its commit, with the hash of its
    uncommitted changes where the tree was dirty ('<commit>+dirty' where
    they were not hashed: not known to equal any other)."""
    diff = provenance.get("diff_sha256")
    if commit.endswith("+dirty") and diff:
        return f"{commit[:-len('+dirty')]}+{diff[:12]}"
    return commit


def current_code():
    """code() of a run started now from this checkout."""
    return code(commit(), {"diff_sha256": git_diff_sha256()})


def known_code(run_code):
    """Whether a run's code (code()) is known well enough to be the same as another's."""
    return run_code != UNKNOWN and not run_code.endswith("+dirty")


def machine(found):
    """(code, CPU model) of of_run's identity (or None), UNKNOWN where not recorded."""
    found = found or {}
    return found.get("code", UNKNOWN), found.get("cpu", UNKNOWN)


def pools(a, b):
    """Whether a table may pair two runs of these machine()s: one known code on one known CPU."""
    return a == b and known_code(a[0]) and a[1] != UNKNOWN


def short_code(run_code):
    """A code as the tables print it: the commit's first 12 characters, and what follows its '+'."""
    commit, plus, rest = run_code.partition("+")
    return commit[:12] + plus + rest


def first_difference(trained, planned):
    """'max_iters=8000, this comparison asks for max_iters=40' for the
    first key where a run's training keys differ from the planned ones, or
    None. A key newer than the run counts as its default, as on a resume."""
    if len(trained) != len(planned):
        return f"{len(trained)} stage(s), this comparison asks for {len(planned)}"
    defaults = json.loads(_defaults())
    for stage, (mine, theirs) in enumerate(zip(trained, planned)):
        for key in sorted(set(mine) | set(theirs)):
            a = mine.get(key, defaults.get(key))
            b = theirs.get(key, defaults.get(key))
            if a != b:
                where = f" in stage {stage}" if len(planned) > 1 else ""
                return f"{key}={a!r}{where}, this comparison asks for {key}={b!r}"
    return None


def run_devices(identities):
    """The device each run trained on (its last stage's; cpu when not recorded)."""
    return [stages[-1].get("device", "cpu") for stages in
            ((i or {}).get("training") or [{}] for i in identities.values())]


def machines_line(pairs, identities):
    """A sentence for the report: how many of the compared pairs (of run
    directories) mix CPUs. identities: {directory: of_run's or None}."""
    mixed = unknown = 0
    for a, b in pairs:
        cpus = [machine(identities.get(d))[1] for d in (a, b)]
        unknown += UNKNOWN in cpus
        mixed += UNKNOWN not in cpus and cpus[0] != cpus[1]
    cpus = sorted({machine(i)[1] for i in identities.values()} - {UNKNOWN})
    line = (f"Machines: of the {len(pairs)} pairs (a method and its baseline on one seed) "
            f"these tables compare, {mixed} pair runs made on different CPUs and {unknown} "
            "include a run whose CPU is not recorded (archived before run.json recorded it; "
            f"tools/identity.py gives the rule). CPUs recorded: {', '.join(cpus) or 'none'}.")
    # device is a training key, so a pair never mixes devices; a GPU run's CPU is only its host
    devices = run_devices(identities)
    off_cpu = sorted({d for d in devices if d != "cpu"})
    if off_cpu:
        line += (f" {sum(d != 'cpu' for d in devices)} of the {len(devices)} runs trained "
                 f"on device={', '.join(off_cpu)}: for them the CPU is the host's (the wall "
                 "time below names the GPU where wall.json recorded it).")
    return line
