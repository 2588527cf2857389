"""Which tests reach a version-sensitive torch API: measured, so that the torch floor's run in
.ci/run is chosen by what a test does, not by its file's name.

    python tests/torch_use.py          # about 20 minutes on 2 cores: writes tests/floor_skip.txt

It runs the slow tier with every API below wrapped by a recorder, in every Python process: pytest's
own and each one a test starts (train.py, torchrun and its ranks, a tool), through
tests/torch_use_site/sitecustomize.py on PYTHONPATH. A recorded call names the test that
was running in the nearest pytest process above it. The slow tests that reached
none of these APIs are written to tests/floor_skip.txt, which the floor deselects. The quick tier
runs on the floor whole (it is cheap), and so does a new slow test until the list is made again.
"""

import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP_FILE = os.path.join(HERE, "floor_skip.txt")

# What changes between torch releases under our code, by what it is for. "module.*" is every public
# function of torch's in that module's namespace; a class is recorded when it is made.
VERSION_SENSITIVE = {
    "distributed": ["torch.distributed.*", "torch.distributed.device_mesh.*",
                    "torch.nn.parallel.DistributedDataParallel", "torch.distributed.run.main"],
    "FSDP and DTensor": ["torch.distributed.fsdp.*", "torch.distributed.tensor.*",
                         "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper"],
    "distributed checkpoint": ["torch.distributed.checkpoint.*", "torch.distributed.checkpoint.state_dict.*",
                               "torch.distributed.checkpoint.format_utils.dcp_to_torch_save"],
    "compile": ["torch.compile", "torch._dynamo.reset"],
    "autocast": ["torch.autocast", "torch.amp.GradScaler"],
    "export": ["torch.export.*", "torch.onnx.export"],
    "activation checkpointing": ["torch.utils.checkpoint.checkpoint"],
    # weights_only=True unpickles only what this torch allows, and the allowed list grows by release
    "loading": ["torch.load"],
    # private: no promise between releases
    "dispatch and profiler": ["torch.utils._python_dispatch.TorchDispatchMode",
                              "torch.overrides.TorchFunctionMode", "torch.profiler.profile"],
}
# Questions every version answers the same way, asked on every single-process run: not recorded.
STABLE = {"is_available", "is_initialized", "get_rank", "get_world_size", "is_torchelastic_launched",
          "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
          "is_xccl_available", "is_backend_available"}


def pytest_runtest_logstart(nodeid, location):
    """In pytest's processes (loaded with -p torch_use): the test about to run, in
    record_dir/running/<pid>, where the processes it starts look for it."""
    running = os.path.join(os.environ["TORCH_USE_DIR"], "running")
    os.makedirs(running, exist_ok=True)
    with open(os.path.join(running, f"{os.getpid()}.tmp"), "w") as f:
        f.write(nodeid)
    os.replace(os.path.join(running, f"{os.getpid()}.tmp"), os.path.join(running, str(os.getpid())))


def pytest_runtest_logreport(report):
    """A test that failed may have stopped before the API it tests: it is recorded as reaching one
    ("failed"), so that it stays on the floor."""
    if report.failed:
        with open(os.path.join(os.environ["TORCH_USE_DIR"], "failed.jsonl"), "a") as f:
            f.write(json.dumps({"test": report.nodeid, "api": "failed"}) + "\n")


def current_test(record_dir):
    """The node id of the test this process runs in: the one its nearest pytest ancestor (or itself)
    wrote down. Not PYTEST_CURRENT_TEST: a test may start its processes with an environment it
    copied before that was set."""
    pid = os.getpid()
    while pid > 1:
        try:
            with open(os.path.join(record_dir, "running", str(pid))) as f:
                return f.read()
        except FileNotFoundError:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
    return None


def targets(name):
    """(owner, attribute) pairs for one entry of VERSION_SENSITIVE."""
    path, attribute = name.rsplit(".", 1)
    if attribute == "*":
        module = importlib.import_module(path)
        return [(module, n) for n, f in vars(module).items() if not n.startswith("_") and n not in STABLE
                and type(f) is types.FunctionType and f.__module__.startswith("torch")]
    return [(importlib.import_module(path), attribute)]


def install(record_dir):
    """Wrap every VERSION_SENSITIVE API so that its first call in each test appends {"test", "api"}
    to record_dir/<pid>.jsonl. Inside torch.compile's tracing it records nothing (a write there
    would break the graph)."""
    import torch
    seen = set()
    path = os.path.join(record_dir, f"{os.getpid()}.jsonl")

    def note(api):
        test = current_test(record_dir)
        if test is None or (test, api) in seen or torch.compiler.is_compiling():
            return
        seen.add((test, api))
        try:
            with open(path, "a") as f:
                f.write(json.dumps({"test": test, "api": api}) + "\n")
        except OSError:  # a test that limits the file size or fills the disk: the test, not the record, counts
            pass

    def wrapped(f, api):
        @functools.wraps(f)
        def call(*args, **kwargs):
            note(api)
            return f(*args, **kwargs)
        return call

    for entries in VERSION_SENSITIVE.values():
        for entry in entries:
            for owner, attribute in targets(entry):
                target = getattr(owner, attribute)
                api = f"{getattr(owner, '__name__', owner)}.{attribute}"
                if inspect.isclass(target):
                    target.__init__ = wrapped(target.__init__, api)
                else:
                    setattr(owner, attribute, wrapped(target, api))


def category(api):
    for name, entries in VERSION_SENSITIVE.items():
        for entry in entries:
            prefix = entry[:-1] if entry.endswith("*") else entry
            if api == entry or (entry.endswith("*") and api.startswith(prefix) and "." not in api[len(prefix):]):
                return name
    return "?"


def read_records(record_dir):
    """{test: the APIs it reached} from a recording's files."""
    used = {}
    for name in os.listdir(record_dir):
        if name.endswith(".jsonl"):
            with open(os.path.join(record_dir, name)) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:  # torn: its process was killed, or its file size limited
                        continue
                    used.setdefault(row["test"], set()).add(row["api"])
    return used


def measure(args=()):
    """Run the slow tier with the recorder; return ({test: set of APIs}, [every slow test])."""
    repo = os.path.dirname(HERE)
    listing = subprocess.run([sys.executable, "-m", "pytest", "-m", "slow", "--collect-only", "-q", *args],
                             cwd=repo, capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as record_dir:
        env = dict(os.environ, TORCH_USE_DIR=record_dir,
                   PYTHONPATH=os.pathsep.join([os.path.join(HERE, "torch_use_site"), HERE, repo]))
        result = subprocess.run([sys.executable, "-m", "pytest", "-m", "slow", "-p", "torch_use", *args],
                                cwd=repo, env=env)
        if result.returncode not in (0, 1):  # 1: some tests failed (kept on the floor, listed below)
            sys.exit(f"the slow tier did not run (pytest's exit {result.returncode}): nothing was written")
        used = read_records(record_dir)
    return used, [line for line in listing.splitlines() if "::" in line]


def write_skip_list(used, tests):
    """tests/floor_skip.txt: the slow tests that reached none of the APIs; and what was found."""
    skip = [test for test in tests if test not in used]
    with open(SKIP_FILE + ".tmp", "w") as f:
        f.write("".join(test + "\n" for test in skip))
    os.replace(SKIP_FILE + ".tmp", SKIP_FILE)
    print(f"{len(tests)} slow tests: {len(tests) - len(skip)} reach a version-sensitive torch API and run "
          f"on the floor, {len(skip)} reach none ({os.path.relpath(SKIP_FILE)})")
    failed = sorted(test for test, apis in used.items() if "failed" in apis)
    if failed:
        print(f"{len(failed)} failed here and stay on the floor: {', '.join(failed)}")
    counts = {}
    for test in tests:
        for name in {category(api) for api in used.get(test, ()) if api != "failed"}:
            counts[name] = counts.get(name, 0) + 1
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"  {name}: {count} tests")


if __name__ == "__main__":
    write_skip_list(*measure(sys.argv[1:]))
