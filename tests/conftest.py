"""Shared by every test: the repository on sys.path (the tests import its modules by name) and
the small character dataset that the end-to-end tests train on."""

import os
import random
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import prepare_shakespeare  # noqa: E402

pytest_plugins = ["tiers"]  # the quick tier and its check (tiers.py)


# The files whose tests start several processes or train for a minute run first: with pytest-xdist
# (.ci/run) the suite then ends on short tests that every worker shares, not on one worker's long test.
LONG_FILES = ("test_distributed.py", "test_reliability.py", "test_requeue.py", "test_compare.py",
              "test_train.py", "test_user_actions.py", "test_run_lock.py", "test_plan.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: os.path.basename(item.fspath) not in LONG_FILES)  # stable: file order kept


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
    return str(out)


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
