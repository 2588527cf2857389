"""docs/adding_a_loss.md works as written: its code blocks, pasted where its steps say, give a loss
on the output embedding whose test passes, whose key is checked, and which trains on the untied
LLaMA toy (config/c4_tiny.py) with its value logged. The steps run on a copy of the repository as
committed, so that a student who made them in the working tree does not see them fail here."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIKTOKEN = os.environ.get("TIKTOKEN_CACHE_DIR",
                          os.path.join(os.path.dirname(REPO), "shared", "data", "tiktoken"))


def edit(path, anchor, replacement):
    """Replace the one occurrence of anchor in path (the step's place must exist exactly once)."""
    text = open(path).read()
    assert text.count(anchor) == 1, f"{os.path.basename(path)}: {anchor!r} found {text.count(anchor)} times"
    open(path, "w").write(text.replace(anchor, replacement))


def committed_copy(dest):
    """The repository as last committed (git archive HEAD), or, outside a git checkout, the working
    tree without its data, runs and results."""
    archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", "HEAD"], capture_output=True)
    if archive.returncode == 0:
        dest.mkdir()
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "data", "out", "results", "__pycache__", "*.pt"))


def python_blocks(markdown):
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


@pytest.mark.skipif(not os.path.isdir(TIKTOKEN), reason="no tiktoken cache: no GPT-2 BPE offline")
def test_the_walk_through_gives_a_loss_that_is_tested_checked_and_trained(tmp_path):
    repo = tmp_path / "repo"
    committed_copy(repo)
    function, test, setting, term = python_blocks((repo / "docs" / "adding_a_loss.md").read_text())[:4]
    losses, objective = repo / "losses.py", repo / "objective.py"
    # 1. the function, at the end of losses.py
    losses.write_text(losses.read_text() + "\n\n" + function)
    # 2. its test, in tests/test_repr_losses.py, imported with the other losses
    tests = repo / "tests" / "test_repr_losses.py"
    edit(tests, "\nfrom losses import ", "\nfrom losses import cosine_regularizer, ")
    tests.write_text(tests.read_text() + "\n\n" + test)
    # 3. its setting in ObjectiveConfig, and the term (the page's four edits in three files, and no other)
    edit(objective, "    # a mixture of experts' router", setting + "    # a mixture of experts' router")
    edit(objective, "        if c.moe_aux_weight and router_loss is not None:",
         term + "        if c.moe_aux_weight and router_loss is not None:")
    assert not [line for path in (losses, objective) for line in path.read_text().splitlines() if len(line) > 110]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIKTOKEN_CACHE_DIR": TIKTOKEN}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                          "-k", "cosine"], cwd=repo, capture_output=True, text=True, env=env)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]

    # 4. run it: the untied LLaMA toy on C4-format shards made from a text
    text = tmp_path / "input.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: to be, or not to be. Line two of {i}." for i in range(200)))
    prepare = subprocess.run([sys.executable, "prepare_c4.py", "--from_text", str(text),
                              "--out_dir", "data/c4_tiny"], cwd=repo, capture_output=True, text=True, env=env)
    assert prepare.returncode == 0, prepare.stderr[-2000:]
    small = ["--max_iters=3", "--eval_interval=3", "--eval_iters=1", "--final_eval=False", "--n_layer=1",
             "--n_embd=16", "--n_head=2", "--block_size=16", "--batch_size=2", "--warmup_iters=1",
             "--log_interval=1"]
    bad = subprocess.run([sys.executable, "train.py", "config/c4_tiny.py", "--cosreg_weight=-1",
                          "--out_dir=out/bad", *small], cwd=repo, capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "cosreg_weight" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    run = subprocess.run([sys.executable, "train.py", "config/c4_tiny.py", "--cosreg_weight=0.1",
                          "--out_dir=out/cosreg", *small], cwd=repo, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (repo / "out" / "cosreg" / "log.jsonl").read_text().splitlines()]
    assert any("cosreg" in r for r in records) and any("val_cosreg" in r for r in records), records
