"""Shared by every test: the repository on sys.path (the tests import its modules by name), the
small character dataset that the end-to-end tests train on and one short run trained on it. The
shared ones are read-only: a test that writes copies them first, and the session fails at its end
if one was changed."""

import hashlib
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import prepare_shakespeare  # noqa: E402

# Under pytest-xdist each worker's torch takes the cores it can share, not all of them: N workers
# with all cores' threads each would wait on each other's threads, spinning (CPU time that the quick
# tier's check would count against a test).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch
    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

FINISHED_RUN = ["--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--final_eval=False"]
pytest_plugins = ["tiers"]  # the quick tier and its check (tiers.py)


# The files whose tests start several processes or train for a minute run first: with pytest-xdist
# (.ci/run) the suite then ends on short tests that every worker shares, not on one worker's long test.
LONG_FILES = ("test_distributed.py", "test_reliability.py", "test_requeue.py", "test_compare.py",
              "test_train.py", "test_user_actions.py", "test_run_lock.py", "test_plan.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: os.path.basename(item.fspath) not in LONG_FILES)  # stable: file order kept


def fingerprint(directory):
    """relative path -> sha256 of every file under directory."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha256(f.read()).hexdigest()
    return files


def unchanged(directory, what):
    """Yield directory; then fail if any file under it was added, removed or rewritten."""
    before = fingerprint(directory)
    yield directory
    after = fingerprint(directory)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, f"a test changed the shared {what} (copy it before writing): {changed[:5]}"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = ["And", "the", "king", "shall", "Away", "a", "QUEEN", "so", "my", "lord", "Zounds", "jest", "of",
             "BY", "wax", "five", "very", "good", "Exit", "Titus", "Ho", "quick", "Cry", "mercy"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + rng.choice(".,;:!?")
             for _ in range(700)]
    text = "\n".join(lines) + "\n"
    (root / "input.txt").write_text(text)
    out = root / "chars"
    prepare_shakespeare.prepare(input_path=str(root / "input.txt"), out_dir=str(out))
    yield from unchanged(str(out), "data_dir")


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, data_dir):
    """A tiny run of 4 steps (test_train.TINY) that ended normally: best.pt, ckpt.pt, log.jsonl,
    metrics.json and its run.json. Read-only."""
    from test_train import TINY
    out = str(tmp_path_factory.mktemp("runs") / "done")
    result = subprocess.run([sys.executable, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}",
                             f"--out_dir={out}", *TINY, *FINISHED_RUN], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    yield from unchanged(out, "finished_run")


@pytest.fixture(scope="session")
def small_data_dir(data_dir):
    """The same text cut to 415 characters: a training split of 373 tokens, 23 windows of 16 (data_order
    = 'epoch' passes over it in 6 steps of 4 windows); the text is small.txt beside the folder."""
    root = os.path.dirname(data_dir)
    with open(os.path.join(root, "input.txt")) as f:
        text = f.read()[:415]
    with open(os.path.join(root, "small.txt"), "w") as f:
        f.write(text)
    prepare_shakespeare.prepare(input_path=os.path.join(root, "small.txt"), out_dir=os.path.join(root, "small"))
    return os.path.join(root, "small")
