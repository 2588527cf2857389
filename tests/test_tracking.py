"""Weights & Biases tracking (tracking.py, train.py's wandb_log): what a run sends to W&B is what
it writes to log.jsonl, a resume continues the same W&B run, and a missing wandb is one line.

W&B is run offline (no account, no network) and its local transaction log (the run's .wandb
file) is read back: a LevelDB-style log of protobuf Records, the format `wandb sync` uploads."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

import run
from test_train import REPO, TINY, read_log

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.py)


def train(out_dir, data_dir, *args, env=None, prefix=()):
    return subprocess.run([sys.executable, *prefix, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}",
                           f"--out_dir={out_dir}", *TINY, *args],
                          cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def wandb_records(path):
    """The protobuf Records of one .wandb file. The file: a 7-byte header (':W&B', a 2-byte magic
    and a version byte), then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length,
    type: 1 whole record, 2/3/4 first/middle/last piece); a block's last < 7 bytes are padding."""
    from wandb.proto import wandb_internal_pb2

    block = 32 * 1024
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        left_in_block = block - pos % block
        if left_in_block < 7:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += left_in_block
            continue
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def read_wandb_run(run_dir):
    """(run id, config, {step: history row}) of one offline run directory, W&B's own keys
    (_step, _runtime, _timestamp, _wandb) left out."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    items = lambda update: {item.key or "/".join(item.nested_key): json.loads(item.value_json)  # noqa: E731
                            for item in update}  # a key is in one field or the other
    run_id, config, rows = None, {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update(items(record.run.config.update))
        elif kind == "config":
            config.update(items(record.config.update))
        elif kind == "history":
            rows[record.history.step.num] = items(record.history.item)
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("_")}  # noqa: E731
    return run_id, strip(config), {step: strip(row) for step, row in rows.items()}


def rows_by_iter(records):
    """log.jsonl's records merged per iteration, as W&B merges what is logged at one step (an
    evaluation and the training record of the same iteration share only 'iter')."""
    rows = {}
    for record in records:
        row = rows.setdefault(record["iter"], {})
        assert not (set(row) & set(record)) - {"iter"}, f"two records of iter {record['iter']} share a key"
        row.update(record)
    return rows


def test_wandb_records_equal_log_jsonl_and_resume_continues_the_run(tmp_path, data_dir):
    pytest.importorskip("wandb")
    # offline, and nothing written outside tmp_path (W&B keeps caches and logs in the home directory)
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
           **{f"WANDB_{kind}_DIR": str(tmp_path / f"wandb_{kind.lower()}") for kind in ("CACHE", "CONFIG", "DATA")}}
    out = tmp_path / "run"
    for args in (["--max_iters=10", "--final_eval=False"], ["--init_from=resume", "--final_eval=False"]):
        result = train(out, data_dir, "--wandb_log=True", "--wandb_project=tests", *args, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*")))  # W&B's files: in out_dir
    assert len(run_dirs) == 2  # the first run and its resumption
    first, resumed = (read_wandb_run(d) for d in run_dirs)
    stored_id = (out / "wandb_id.txt").read_text().strip()
    assert first[0] == resumed[0] == stored_id  # one W&B run
    assert "wandb_id.txt" in run.existing_run(str(out))  # a run file: --overwrite=True starts a new W&B run

    # the history: the resumption logs again from its checkpoint's step on, as log.jsonl does
    rows = {**first[2], **resumed[2]}
    expected = rows_by_iter(read_log(out))
    assert sorted(rows) == sorted(expected) == list(range(21))
    for step, row in expected.items():
        assert rows[step] == row, step  # every key, every value, exactly
    assert {"loss", "ce", "lr", "val", "val_high", "val_low"} <= set(rows[10])

    # the config: what the checkpoint says the run was trained with
    with open(out / "ckpt.json") as f:
        config = json.load(f)["config"]
    assert resumed[1] == config
    assert first[1]["init_from"] == "scratch" and first[1]["max_iters"] == 10


def test_without_wandb_one_line_before_anything_is_written(tmp_path, data_dir):
    """`import wandb` fails as it does where wandb is not installed (None in sys.modules is
    Python's own way to make an import fail); the run stops at config time, out_dir untouched."""
    block_wandb = ["-c", "import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
                         "runpy.run_path(sys.argv[0], run_name='__main__')"]
    out = tmp_path / "run"
    result = train(out, data_dir, "--wandb_log=True", prefix=block_wandb)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: wandb_log=True needs `pip install wandb` (an optional extra; WANDB_MODE=offline needs no account)"]
    assert not out.exists()
