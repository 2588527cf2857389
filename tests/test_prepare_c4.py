"""Tests for prepare_c4.py.

The shards are tiny gzipped JSON-lines files written into tmp_path and served by a real HTTP
server on 127.0.0.1, so requests, resuming, retries, validation, the tokenizer pool and the
atomic writes all run for real, without the internet. The server below (unlike
SimpleHTTPRequestHandler) answers Range requests, records every request it gets, and can be told
to fail a path with a status code or to drop the connection halfway through a body.
"""

import collections
import gzip
import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import signal
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# tiktoken reads its BPE file from this cache (no network here); spawned workers inherit it.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO_ROOT.parent / "shared" / "data" / "tiktoken"))

import tiktoken  # noqa: E402

import prepare_c4 as pc  # noqa: E402
from data import BPE_EOT, BPE_TOKENS, DataError, load_tokens, read_meta, read_windows  # noqa: E402

try:
    ENC = tiktoken.get_encoding("r50k_base")
except Exception as exc:  # no cache beside the repo and no network: these tests cannot run here
    pytest.skip(f"GPT-2 BPE ranks unavailable ({type(exc).__name__}); set TIKTOKEN_CACHE_DIR to a tiktoken cache",
                allow_module_level=True)
EOT = 50256
FAST = dict(workers=1, retries=3, retry_delay=0.01, timeout=5)  # keyword arguments for prepare()


def train_name(i):
    return f"c4-train.{i:05d}-of-01024.json.gz"


def val_name(i):
    return f"c4-validation.{i:05d}-of-00008.json.gz"


def make_docs(tag, n=12):
    """Short documents with the awkward cases: empty, Unicode, newlines, a literal EOT string."""
    docs = [f"{tag} document {i}: the quick brown fox jumps over the lazy dog." for i in range(n)]
    docs[1] = ""
    docs[2] = f"{tag}: caf\u00e9 \u2014 na\u00efve \u00fcber \U0001F3AD \u4e2d\u6587\n\nsecond paragraph\n"
    docs[3] = f"{tag} mentions <|endoftext|> as plain text"
    docs[4] = "  leading and trailing spaces \t "
    return docs


def gzip_lines(lines):
    return gzip.compress("".join(line + "\n" for line in lines).encode("utf-8"), mtime=0)


def shard_bytes(docs):
    return gzip_lines(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z",
                                  "url": f"https://example.com/{i}"}) for i, d in enumerate(docs))


def expected_ids(docs):
    ids = []
    for doc in docs:
        ids += ENC.encode_ordinary(doc) + [EOT]
    return ids


def files_in(directory):
    """All names in directory (including hidden temp files); [] if it is absent."""
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def leftovers(directory):
    """Temp files and partial downloads: a correct run never leaves any."""
    return [n for n in files_in(directory) if n.startswith(".") or n.endswith((".tmp", ".part"))]


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------------------
# the test server
# ---------------------------------------------------------------------------

class ShardServer:
    """Shared state of the handler: what to serve, what to break, what was asked for."""

    def __init__(self, root):
        self.root = root
        self.requests = []                     # (path, Range header or None) per GET
        self.honour_range = True
        self.drop = collections.Counter()      # path -> times to cut the body off halfway
        self.fail = collections.defaultdict(list)  # path -> status codes to answer first
        self.lock = threading.Lock()

    def paths(self):
        return [path for path, _ in self.requests]


class ShardHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        st = self.server.state
        path = urllib.parse.urlsplit(self.path).path
        rng = self.headers.get("Range")
        with st.lock:
            st.requests.append((path, rng))
            status = st.fail[path].pop(0) if st.fail[path] else None
            drop = st.drop[path] > 0
            if drop:
                st.drop[path] -= 1
        if status is not None:
            self.send_error(status)
            return
        file = st.root / path.lstrip("/")
        if not file.is_file():
            self.send_error(404)
            return
        data = file.read_bytes()
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", rng or "")
        if m and st.honour_range:
            start = int(m.group(1))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Type", "application/gzip")
        self.send_header("Content-Length", str(len(body)))  # the full length, even when dropping
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if drop else body)
        self.wfile.flush()
        # HTTP/1.0: the connection closes after every response, so a dropped one ends here.


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A Range-aware server on 127.0.0.1 holding 3 train shards and 1 val shard under en/."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")

    root = tmp_path / "www"
    (root / "en").mkdir(parents=True)
    docs = {}
    for name, tag in [(train_name(0), "t0"), (train_name(1), "t1"), (train_name(2), "t2"),
                      (val_name(0), "v0")]:
        docs[name] = make_docs(tag)
        (root / "en" / name).write_bytes(shard_bytes(docs[name]))

    state = ShardServer(root)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ShardHandler)
    httpd.state = state
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    state.docs = docs
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def stream(out_dir, split):
    """A split's tokens: its per-shard files, in meta.json's order, concatenated."""
    meta = json.loads((out_dir / "meta.json").read_text())
    return np.concatenate([np.fromfile(out_dir / e["file"], dtype=np.uint16) for e in meta["token_files"][split]])


def check_outputs(out_dir, docs_train, docs_val):
    """The outputs hold these documents' ids, and the index describes its files exactly."""
    meta = json.loads((out_dir / "meta.json").read_text())
    assert "unfinished" not in meta
    train, val = stream(out_dir, "train"), stream(out_dir, "val")
    assert train.tolist() == expected_ids(docs_train)
    assert val.tolist() == expected_ids(docs_val)
    assert meta["n_train"] == len(train) and meta["n_val"] == len(val)
    assert meta["n_train_docs"] == len(docs_train) and meta["n_val_docs"] == len(docs_val)
    for split, names in (("train", meta["train_shards"]), ("val", meta["val_shards"])):
        assert [e["shard"] for e in meta["token_files"][split]] == names
        for e in meta["token_files"][split]:
            ids = np.fromfile(out_dir / e["file"], dtype=np.uint16)
            shard = (out_dir / e["shard"]).read_bytes()
            assert e["file"] == ("train/" if split == "train" else "val/") + e["shard"].removesuffix(".json.gz") + ".bin"
            assert (e["n_tokens"], e["max_id"], e["n_docs"]) == (len(ids), int(ids.max()), int((ids == EOT).sum()))
            assert e["sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()
            assert (e["shard_bytes"], e["shard_sha256"]) == (len(shard), hashlib.sha256(shard).hexdigest())
            assert meta["shard_sha256"][e["shard"]] == e["shard_sha256"]
    return meta, train, val


def token_files(out_dir):
    """{relative path: bytes} of every token file."""
    return {f"{split}/{n}": (out_dir / split / n).read_bytes() for split in ("train", "val") for n in files_in(out_dir / split)}


def run_script(*args, cwd, timeout=120):
    return subprocess.run([sys.executable, str(REPO_ROOT / "prepare_c4.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


# ---------------------------------------------------------------------------
# happy path
# ---------------------------------------------------------------------------

def test_bpe_constants_are_tiktoken_s():
    """meta.json records data.BPE_TOKENS and BPE_EOT; they must be what the ranks hold."""
    assert (ENC.n_vocab, ENC.eot_token) == (BPE_TOKENS, BPE_EOT) == (50257, EOT)


def test_two_train_shards_one_val_shard(tmp_path, server, monkeypatch):
    monkeypatch.setattr(pc, "DOCS_PER_BATCH", 5)  # many batches, spread over the 2 workers
    out_dir = tmp_path / "c4"
    meta = pc.prepare(shards=2, val_shards=1, out_dir=str(out_dir), base_url=server.base_url,
                      **{**FAST, "workers": 2})

    docs_train = server.docs[train_name(0)] + server.docs[train_name(1)]
    docs_val = server.docs[val_name(0)]
    on_disk, train, val = check_outputs(out_dir, docs_train, docs_val)
    assert on_disk == meta

    # documents joined by EOT, in order; the literal "<|endoftext|>" in a text stays plain text
    pieces = np.split(train, np.flatnonzero(train == EOT) + 1)[:-1]
    assert [ENC.decode(p[:-1].tolist()) for p in pieces] == docs_train
    assert all(p[-1] == EOT for p in pieces) and int((train == EOT).sum()) == len(docs_train)
    assert ENC.decode(val.tolist()) == "".join(d + "<|endoftext|>" for d in docs_val)
    assert int(max(train.max(), val.max())) < 50257

    assert meta["tokenizer"] == "r50k_base" and meta["vocab_size"] == 50304
    assert meta["tokenizer_vocab_size"] == 50257 and meta["eot_token"] == EOT
    assert meta["dtype"] == "uint16"
    assert meta["train_shards"] == [train_name(0), train_name(1)]
    assert meta["val_shards"] == [val_name(0)]
    assert meta["source"] == f"{server.base_url}/en"
    for name in meta["train_shards"] + meta["val_shards"]:
        assert meta["shard_sha256"][name] == hashlib.sha256((out_dir / name).read_bytes()).hexdigest()
        assert (out_dir / name).read_bytes() == (server.root / "en" / name).read_bytes()
    assert (out_dir / "meta.json").read_text().startswith('{\n  "tokenizer": "r50k_base"')

    assert files_in(out_dir) == sorted(["meta.json", "train", "val", train_name(0), train_name(1), val_name(0)])
    assert files_in(out_dir / "train") == ["c4-train.00000-of-01024.bin", "c4-train.00001-of-01024.bin"]
    assert sorted(server.paths()) == sorted(f"/en/{n}" for n in meta["train_shards"] + meta["val_shards"])
    assert all(rng is None for _, rng in server.requests)


@pytest.mark.slow
def test_cli_subprocess_with_worker_pool(tmp_path, server):
    """The real command line; spawned workers re-import the script as __mp_main__."""
    out_dir = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "prepare_c4.py"), "--shards", "1", "--val_shards", "1",
         "--base_url", server.base_url + "/", "--out_dir", str(out_dir), "--workers", "2",
         "--retry_delay", "0.01"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    meta, _, _ = check_outputs(out_dir, server.docs[train_name(0)], server.docs[val_name(0)])
    assert f"train tokens: {meta['n_train']:,}" in result.stdout
    assert leftovers(out_dir) == []


# ---------------------------------------------------------------------------
# resuming and retrying
# ---------------------------------------------------------------------------

def test_resume_from_part_file_with_range(tmp_path, server):
    name = train_name(0)
    full = (server.root / "en" / name).read_bytes()
    half = len(full) // 2
    out_dir = tmp_path / "c4"
    out_dir.mkdir()
    (out_dir / f"{name}.part").write_bytes(full[:half])  # an earlier run was interrupted

    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)

    assert (f"/en/{name}", f"bytes={half}-") in server.requests
    assert (out_dir / name).read_bytes() == full
    check_outputs(out_dir, server.docs[name], server.docs[val_name(0)])
    assert leftovers(out_dir) == []


def test_server_ignoring_range_starts_over(tmp_path, server):
    server.honour_range = False  # answers 200 with the whole file
    name = train_name(0)
    full = (server.root / "en" / name).read_bytes()
    out_dir = tmp_path / "c4"
    out_dir.mkdir()
    (out_dir / f"{name}.part").write_bytes(full[: len(full) // 2])

    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)

    assert (out_dir / name).read_bytes() == full  # not the first half twice
    assert leftovers(out_dir) == []


def test_complete_part_file_is_finished_without_download(tmp_path, server):
    """A crash between the last byte and the rename: the server answers 416, nothing to fetch."""
    name = train_name(0)
    full = (server.root / "en" / name).read_bytes()
    out_dir = tmp_path / "c4"
    out_dir.mkdir()
    (out_dir / f"{name}.part").write_bytes(full)

    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)

    assert (f"/en/{name}", f"bytes={len(full)}-") in server.requests
    assert (out_dir / name).read_bytes() == full
    assert leftovers(out_dir) == []


def test_dropped_connection_is_retried_and_resumed(tmp_path, server, capsys):
    name = train_name(1)
    full = (server.root / "en" / name).read_bytes()
    server.drop[f"/en/{name}"] = 1       # sends Content-Length, then closes halfway
    server.fail[f"/en/{val_name(0)}"] = [503]
    out_dir = tmp_path / "c4"

    pc.prepare(shards=2, out_dir=str(out_dir), base_url=server.base_url, **FAST)

    assert [r for r in server.requests if r[0] == f"/en/{name}"] == [
        (f"/en/{name}", None), (f"/en/{name}", f"bytes={len(full) // 2}-")]
    assert [r for r in server.requests if r[0] == f"/en/{val_name(0)}"] == [
        (f"/en/{val_name(0)}", None)] * 2
    err = capsys.readouterr().err
    assert "retry 1/3" in err and "503" in err
    assert (out_dir / name).read_bytes() == full
    check_outputs(out_dir, server.docs[train_name(0)] + server.docs[name], server.docs[val_name(0)])
    assert leftovers(out_dir) == []


def test_giving_up_keeps_part_and_rerun_resumes(tmp_path, server):
    name = train_name(0)
    server.drop[f"/en/{name}"] = 100
    out_dir = tmp_path / "c4"
    url = f"{server.base_url}/en/{name}"

    with pytest.raises(DataError) as excinfo:
        pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url,
                   **{**FAST, "retries": 2})
    msg = str(excinfo.value)
    assert url in msg and "after 3 attempts" in msg and "rerun to resume" in msg
    assert files_in(out_dir) == [f"{name}.part"]  # no shard, no bins, no meta

    server.drop.clear()
    server.requests.clear()
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    assert server.requests[0][0] == f"/en/{name}" and server.requests[0][1] is not None
    check_outputs(out_dir, server.docs[name], server.docs[val_name(0)])


# ---------------------------------------------------------------------------
# bad shards and HTTP errors: one error line, nothing half-written
# ---------------------------------------------------------------------------

def good_line(text="fine"):
    return json.dumps({"text": text, "timestamp": "t", "url": "u"})


@pytest.mark.parametrize("content, reason", [
    (b"this is not gzip at all", "bad gzip data"),
    ("truncated", "truncated"),
    (gzip_lines([good_line(), "{not json"]), "line 2 is not JSON"),
    (gzip_lines([good_line(), json.dumps({"url": "no text"})]), 'line 2 has no "text" string'),
    (gzip_lines([json.dumps({"text": 42})]), 'line 1 has no "text" string'),
    (gzip.compress(b"", mtime=0), "no documents"),
])
def test_corrupt_shard_stops_cleanly_and_rerun_redownloads(tmp_path, server, capsys, content, reason):
    name = train_name(1)
    good = (server.root / "en" / name).read_bytes()
    if content == "truncated":
        content = good[: len(good) // 2]
    (server.root / "en" / name).write_bytes(content)
    out_dir = tmp_path / "c4"
    args = ["--shards", "2", "--out_dir", str(out_dir), "--base_url", server.base_url,
            "--workers", "1", "--retry_delay", "0.01"]

    with pytest.raises(SystemExit) as excinfo:
        pc.main(args)
    assert excinfo.value.code == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1
    assert name in lines[0] and "is corrupt" in lines[0] and reason in lines[0]
    # the bad shard is moved aside; the shard before it is tokenised and indexed, the dataset is
    # marked unfinished; no temp files
    assert files_in(out_dir) == sorted([train_name(0), f"{name}.corrupt", "meta.json", "train"])
    assert files_in(out_dir / "train") == ["c4-train.00000-of-01024.bin"]
    assert json.loads((out_dir / "meta.json").read_text())["unfinished"] == [name, val_name(0)]
    with pytest.raises(DataError, match="did not finish"):
        read_meta(str(out_dir))

    # the server has a good copy again: a rerun downloads the shards not yet there and succeeds
    (server.root / "en" / name).write_bytes(good)
    server.requests.clear()
    capsys.readouterr()
    assert pc.main(args) == 0
    assert server.requests == [(f"/en/{name}", None), (f"/en/{val_name(0)}", None)]
    assert "tokenised c4-train.00000" not in capsys.readouterr().out
    check_outputs(out_dir, server.docs[train_name(0)] + server.docs[name], server.docs[val_name(0)])
    assert leftovers(out_dir) == []


def test_corrupt_new_shard_keeps_previous_outputs(tmp_path, server):
    """Growing by a bad shard: nothing finished, so meta.json still describes the complete 1-shard data."""
    out_dir = tmp_path / "c4"
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    before = {**token_files(out_dir), "meta.json": (out_dir / "meta.json").read_bytes()}

    (server.root / "en" / train_name(1)).write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(DataError, match=re.escape(train_name(1))):
        pc.prepare(shards=2, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    assert {**token_files(out_dir), "meta.json": (out_dir / "meta.json").read_bytes()} == before
    assert leftovers(out_dir) == [] and leftovers(out_dir / "train") == []


def test_http_404_names_the_url(tmp_path, server, capsys):
    name = train_name(1)
    (server.root / "en" / name).unlink()
    out_dir = tmp_path / "c4"

    with pytest.raises(SystemExit) as excinfo:
        pc.main(["--shards", "2", "--out_dir", str(out_dir), "--base_url", server.base_url,
                 "--workers", "1", "--retry_delay", "0.01"])
    assert excinfo.value.code == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1
    assert f"{server.base_url}/en/{name}" in lines[0] and "404" in lines[0]
    assert files_in(out_dir) == sorted([train_name(0), "meta.json", "train"])  # the shard before it, tokenised
    assert json.loads((out_dir / "meta.json").read_text())["unfinished"] == [name, val_name(0)]
    assert server.paths().count(f"/en/{name}") == 1  # a 404 is not retried


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["--shards", "0"], "--shards must be between 1 and 1024, got 0"),
    (["--shards", "1025"], "--shards must be between 1 and 1024, got 1025"),
    (["--shards", "many"], "argument --shards: invalid int value: 'many'"),
    (["--val_shards", "9"], "--val_shards must be between 1 and 8, got 9"),
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--retries", "-1"], "--retries must be at least 0, got -1"),
    (["--timeout", "0"], "--timeout must be a number of seconds > 0, got 0.0"),
    (["--base_url", "ftp://example.com/c4"], "--base_url must be an http:// or https:// address, got 'ftp://example.com/c4'"),
    (["--base_url", "huggingface.co"], "--base_url must be an http:// or https:// address"),
])
def test_bad_arguments(tmp_path, args, expected):
    """The real script: one line, the usage error's status 2, nothing made."""
    out_dir = tmp_path / "c4"
    result = run_script("--out_dir", out_dir, "--base_url", "http://127.0.0.1:9", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: {expected}"] or \
        (len(result.stderr.splitlines()) == 1 and result.stderr.startswith(f"error: {expected}"))
    assert result.stdout == "" and not out_dir.exists()


def unwritable_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked / "c4"


@pytest.mark.slow
@pytest.mark.parametrize("make_out_dir, expected", [
    (lambda tmp: (tmp.joinpath("file").write_text("x"), tmp / "file" / "c4")[1], "which is a file, not a directory"),
    (lambda tmp: "/proc/c4", "/proc/c4"),
    (unwritable_dir, "permission denied"),
])
def test_unusable_out_dir(tmp_path, server, make_out_dir, expected):
    """An out_dir that cannot be written: one line naming it (status 1) before any download."""
    out_dir = make_out_dir(tmp_path)
    if expected == "permission denied" and os.access(out_dir.parent, os.W_OK):
        pytest.skip("this user (root?) may write anywhere")
    result = run_script("--out_dir", out_dir, "--base_url", server.base_url, "--retry_delay", "0.01", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out_dir {out_dir}")  # utils.check_writable's line
    assert expected in lines[0] and "Traceback" not in result.stderr
    assert server.requests == []


@pytest.mark.slow
def test_unreachable_server_is_one_line(tmp_path):
    result = run_script("--out_dir", tmp_path / "c4", "--base_url", "http://127.0.0.1:9", "--retries", "0", cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: download of http://127.0.0.1:9/en/c4-train.00000")


# ---------------------------------------------------------------------------
# reruns
# ---------------------------------------------------------------------------

def test_rerun_downloads_nothing_and_adding_a_shard_tokenises_only_it(tmp_path, server, capsys):
    out_dir = tmp_path / "c4"
    meta = pc.prepare(shards=2, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    before = token_files(out_dir)
    mtimes = {n: os.stat(out_dir / n).st_mtime_ns for n in [*before, "meta.json"]}

    server.requests.clear()
    capsys.readouterr()
    assert pc.prepare(shards=2, out_dir=str(out_dir), base_url=server.base_url, **FAST) == meta
    assert server.requests == []
    assert "up to date" in capsys.readouterr().out
    assert {n: os.stat(out_dir / n).st_mtime_ns for n in mtimes} == mtimes  # not rewritten

    pc.prepare(shards=3, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    out = capsys.readouterr().out
    assert server.requests == [(f"/en/{train_name(2)}", None)]
    assert "3 of 4 shards already tokenised, 1 to do" in out
    assert re.findall(r"tokenised (\S+):", out) == [train_name(2)]
    assert {n: os.stat(out_dir / n).st_mtime_ns for n in before} == {n: mtimes[n] for n in before}
    docs = sum((server.docs[train_name(i)] for i in range(3)), [])
    meta3, train, _ = check_outputs(out_dir, docs, server.docs[val_name(0)])
    assert meta3["token_files"]["train"][:2] == meta["token_files"]["train"]
    assert leftovers(out_dir) == [] and leftovers(out_dir / "train") == []

    # fewer shards asked for: the index shrinks, nothing is tokenised
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    assert "tokenised" not in capsys.readouterr().out
    check_outputs(out_dir, server.docs[train_name(0)], server.docs[val_name(0)])


def test_changed_shard_is_retokenised(tmp_path, server):
    """A shard of another size than its index entry records is tokenised again."""
    out_dir = tmp_path / "c4"
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    new_docs = make_docs("replaced", n=6)
    (out_dir / val_name(0)).write_bytes(shard_bytes(new_docs))  # e.g. a hand-copied shard
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    check_outputs(out_dir, server.docs[train_name(0)], new_docs)


@pytest.mark.slow
def test_from_text_makes_c4_shards_offline_and_c4_tiny_trains_on_them(tmp_path):
    """The offline path: paragraphs of a text become C4-format shards (every 10th to validation),
    checked and tokenised like downloaded ones; then config/c4_tiny.py trains on the result."""
    paragraphs = [f"Paragraph {i}: to be, or not to be.\nThat is line two of {i}." for i in range(400)]
    text = tmp_path / "input.txt"
    text.write_text("\n\n".join(paragraphs) + "\n")
    out = tmp_path / "c4"
    meta = pc.prepare(shards=2, out_dir=str(out), workers=2, from_text=str(text))
    enc = tiktoken.get_encoding("r50k_base")
    train, val = stream(out, "train").tolist(), stream(out, "val").tolist()
    assert val == [t for p in paragraphs[9::10] for t in enc.encode_ordinary(p) + [EOT]]
    train_docs = [p for i, p in enumerate(paragraphs) if i % 10 != 9]  # dealt round-robin into the 2 shards
    assert train == [t for p in train_docs[0::2] + train_docs[1::2] for t in enc.encode_ordinary(p) + [EOT]]
    assert meta["source"].startswith("file://") and meta["n_val_docs"] == 40
    with gzip.open(out / train_name(0), "rt") as f:
        assert json.loads(f.readline())["text"] == paragraphs[0]
    assert pc.prepare(shards=2, out_dir=str(out), workers=1, from_text=str(text)) == meta  # rerun: up to date
    run = subprocess.run([sys.executable, "train.py", "config/c4_tiny.py", f"--data_dir={out}",
                          f"--out_dir={tmp_path / 'run'}", "--max_iters=3", "--eval_interval=3", "--eval_iters=1",
                          "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16", "--batch_size=2", "--warmup_iters=1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert records[-1]["iter"] == 3 and records[-1]["val"] < records[0]["val"]
    # the final evaluation streams: 40 val documents (> 333 tokens) x 50304 logits is past scoring.STREAM_ABOVE
    result = json.loads((tmp_path / "run" / "metrics.json").read_text())
    scores = result["val"]
    assert len(val) * 50304 > 2 ** 24 and 1 < scores["ppl_best"] <= scores["ppl"] * 1.0001 and 0 <= scores["accuracy"] <= 1
    # the rare targets: val tokens seen at most 10 times in train
    counts = np.bincount(train, minlength=50304)
    n_blocks = (len(val) - 1) // 16
    targets = np.array(val[1:n_blocks * 16 + 1])
    assert result["rare"]["tokens"] == int((counts[targets] <= 10).sum()) > 0 and result["rare"]["ppl"] > 1
    sample = subprocess.run([sys.executable, "sample.py", str(tmp_path / "run" / "best.pt"), "--start", "To be",
                             "--max_new_tokens", "5"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert sample.returncode == 0 and sample.stdout.startswith("To be"), sample.stderr[-2000:]


# ---------------------------------------------------------------------------
# shard by shard: resuming a killed preparation, the index, the stream train.py reads
# ---------------------------------------------------------------------------

def big_docs(tag, n):
    """Enough text that tokenising the shard takes a moment (a window to kill the run in)."""
    return [f"{tag} {i}: " + " ".join(f"word{(i * 7 + j) % 997}" for j in range(60)) for i in range(n)]


@pytest.mark.slow
def test_killed_preparation_resumes_at_its_shard(tmp_path, server):
    """SIGKILL (the whole process group: a node going down) while the third of four train shards is
    being tokenised; the rerun removes the killed run's temp file, does not tokenise the two finished
    shards again, and ends byte for byte where an uninterrupted preparation ends."""
    server.docs[train_name(2)] = big_docs("t2", 40000)
    server.docs[train_name(3)] = make_docs("t3")
    for i in (2, 3):
        (server.root / "en" / train_name(i)).write_bytes(shard_bytes(server.docs[train_name(i)]))
    args = ["--shards", "4", "--base_url", server.base_url, "--workers", "1", "--retry_delay", "0.01"]
    killed, whole = tmp_path / "killed", tmp_path / "whole"

    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "prepare_c4.py"), *args, "--out_dir", str(killed)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    temp = None
    try:
        deadline = time.monotonic() + 120
        while temp is None and proc.poll() is None and time.monotonic() < deadline:
            temp = next((n for n in files_in(killed / "train") if n.startswith(".c4-train.00002")), None)
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    assert temp is not None, "the third shard's temp file never appeared"
    assert re.findall(r"tokenised (\S+):", out) == [train_name(0), train_name(1)]
    index = json.loads((killed / "meta.json").read_text())
    assert index["unfinished"] == [train_name(2), train_name(3), val_name(0)]
    assert files_in(killed / "train") == sorted(["c4-train.00000-of-01024.bin", "c4-train.00001-of-01024.bin", temp])
    with pytest.raises(DataError, match="did not finish"):
        load_tokens(str(killed), "train", 8)

    rerun = run_script(*args, "--out_dir", killed, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert f"removed {killed / 'train' / temp} (left by an interrupted run)" in rerun.stdout
    assert "2 of 5 shards already tokenised, 3 to do" in rerun.stdout
    assert re.findall(r"tokenised (\S+):", rerun.stdout) == [train_name(2), train_name(3), val_name(0)]

    assert run_script(*args, "--out_dir", whole, cwd=tmp_path).returncode == 0
    assert token_files(killed) == token_files(whole)
    assert (killed / "meta.json").read_bytes() == (whole / "meta.json").read_bytes()
    check_outputs(killed, sum((server.docs[train_name(i)] for i in range(4)), []), server.docs[val_name(0)])
    assert leftovers(killed / "train") == []


@pytest.mark.slow
def test_lost_last_shard_is_the_only_one_tokenised_again(tmp_path, server):
    """A token file deleted (or never renamed into place): the rerun tokenises that shard alone,
    with 2 workers, and rebuilds the same bytes."""
    out_dir = tmp_path / "c4"
    args = ["--shards", "3", "--base_url", server.base_url, "--workers", "2", "--out_dir", out_dir]
    assert run_script(*args, cwd=tmp_path).returncode == 0
    before, meta_before = token_files(out_dir), (out_dir / "meta.json").read_bytes()
    mtimes = {n: os.stat(out_dir / n).st_mtime_ns for n in before}
    (out_dir / "train" / "c4-train.00002-of-01024.bin").unlink()

    rerun = run_script(*args, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert re.findall(r"tokenised (\S+):", rerun.stdout) == [train_name(2)]
    assert token_files(out_dir) == before and (out_dir / "meta.json").read_bytes() == meta_before
    assert {n: os.stat(out_dir / n).st_mtime_ns for n in before if "00002" not in n} == \
        {n: t for n, t in mtimes.items() if "00002" not in n}


def test_stream_reads_windows_across_shard_boundaries(tmp_path, server):
    """load_tokens gives the train split of 3 files as one stream: every window, those that cross
    from one file into the next included, equals the same window of the files concatenated."""
    out_dir = tmp_path / "c4"
    pc.prepare(shards=3, out_dir=str(out_dir), base_url=server.base_url, **{**FAST, "workers": 2})
    whole = stream(out_dir, "train")
    data = load_tokens(str(out_dir), "train", 8, vocab_size=50304, n_tokens=len(whole))
    assert len(data) == len(whole)
    meta = read_meta(str(out_dir))
    boundaries = np.cumsum([e["n_tokens"] for e in meta["token_files"]["train"]])[:-1]
    starts = torch.tensor(sorted({int(b) + d for b in boundaries for d in range(-9, 2)} | {0, len(whole) - 9}))
    is_low = torch.zeros(len(starts), dtype=torch.bool)
    x, y = read_windows(data, starts, is_low, 8, shift=0)
    windows = np.stack([whole[s:s + 9] for s in starts.tolist()]).astype(np.int64)
    assert np.array_equal(x.numpy(), windows[:, :-1]) and np.array_equal(y.numpy(), windows[:, 1:])
    assert np.array_equal(data.astype(np.int64), whole.astype(np.int64))  # evaluate.py's whole-split read
    val = load_tokens(str(out_dir), "val", 8)  # one file: the memmap itself
    assert isinstance(val, np.memmap) and np.array_equal(val, stream(out_dir, "val"))


@pytest.mark.slow
@pytest.mark.parametrize("damage, expected", [
    (lambda f: f.write_bytes(f.read_bytes()[:-2]), "has {size} bytes but meta.json records"),
    (lambda f: f.write_bytes(f.read_bytes() + b"\x00\x00"), "has {size} bytes but meta.json records"),
    (lambda f: f.unlink(), "missing {file}"),
])
def test_damaged_token_file_is_refused_in_one_line(tmp_path, server, damage, expected):
    """train.py checks each file against its index entry (sizes only) before touching out_dir."""
    data_dir = tmp_path / "c4"
    pc.prepare(shards=2, out_dir=str(data_dir), base_url=server.base_url, **FAST)
    file = data_dir / "train" / "c4-train.00001-of-01024.bin"
    damage(file)
    run = subprocess.run([sys.executable, "train.py", "config/c4_tiny.py", f"--data_dir={data_dir}",
                          f"--out_dir={tmp_path / 'run'}", "--max_iters=1", "--n_layer=1", "--n_embd=16", "--n_head=2",
                          "--block_size=8", "--batch_size=2"],
                         cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    size = file.stat().st_size if file.exists() else None
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(file) in lines[0], run.stderr
    assert expected.format(size=f"{size:,}" if size is not None else "", file=file) in lines[0]
    assert not (tmp_path / "run").exists()


def test_recorded_largest_id_is_checked_without_reading_the_tokens(tmp_path, server):
    """The vocabulary check reads the index's max_id: an entry saying 60000 is refused for a
    50304-token vocabulary, naming the file, though the file itself holds only GPT-2 ids."""
    data_dir = tmp_path / "c4"
    pc.prepare(shards=2, out_dir=str(data_dir), base_url=server.base_url, **FAST)
    meta = json.loads((data_dir / "meta.json").read_text())
    assert all(e["max_id"] == int(np.fromfile(data_dir / e["file"], dtype=np.uint16).max())
               for e in meta["token_files"]["train"])
    meta["token_files"]["train"][1]["max_id"] = 60000
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=re.escape(str(data_dir / "train" / "c4-train.00001-of-01024.bin")) +
                       ".*token id 60000.*vocab_size is 50304"):
        load_tokens(str(data_dir), "train", 8, vocab_size=50304)


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path, server, capsys):
    out_dir = tmp_path / "c4"
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    stale = [out_dir / ".meta.json.k2j3h4_x.tmp", out_dir / "train" / ".c4-train.00000-of-01024.bin.abc123.tmp",
             out_dir / f".{train_name(0)}.q1w2e3r4.tmp"]
    kept = [out_dir / "notes.tmp", out_dir / "train" / "mine.bin.tmp"]
    for path in stale + kept:
        path.write_bytes(b"partial")
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    out = capsys.readouterr().out
    assert all(not p.exists() and f"removed {p}" in out for p in stale)
    assert all(p.exists() for p in kept)


@pytest.mark.slow
def test_from_text_shards_are_byte_reproducible(tmp_path):
    """Two runs on the same text make the same shard bytes (the gzip header's time is 0 and its
    name fixed), so meta.json's shard_sha256 and the whole meta.json are the same."""
    text = tmp_path / "input.txt"
    text.write_text("\n\n".join(f"Speech {i}.\nTo be or not to be, {i}." for i in range(60)) + "\n")
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        result = run_script("--from_text", text, "--shards", "2", "--workers", "1", "--out_dir", out, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        time.sleep(1.1)  # a header that carried the time would now differ
    names = [train_name(0), train_name(1), val_name(0)]
    assert all((outs[0] / n).read_bytes() == (outs[1] / n).read_bytes() for n in names)
    assert (outs[0] / "meta.json").read_bytes() == (outs[1] / "meta.json").read_bytes()
    raw = (outs[0] / train_name(0)).read_bytes()
    assert raw[4:8] == b"\x00\x00\x00\x00" and raw[10:].startswith(train_name(0).removesuffix(".gz").encode() + b"\x00")


def test_old_single_file_layout_is_replaced(tmp_path, server, capsys):
    """data/c4 as the single-file preparation left it (train.bin, val.bin, no index): the first run
    tokenises every shard into its own file and removes the two bins the new index replaces."""
    out_dir = tmp_path / "c4"
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    meta = json.loads((out_dir / "meta.json").read_text())
    for split in ("train", "val"):
        (out_dir / f"{split}.bin").write_bytes(stream(out_dir, split).tobytes())
    old = {k: v for k, v in meta.items() if k != "token_files"}
    (out_dir / "meta.json").write_text(json.dumps(old))
    assert len(load_tokens(str(out_dir), "train", 8, 50304, old["n_train"])) == old["n_train"]  # still readable

    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    assert "0 of 2 shards already tokenised" in capsys.readouterr().out
    assert not (out_dir / "train.bin").exists() and not (out_dir / "val.bin").exists()
    check_outputs(out_dir, server.docs[train_name(0)], server.docs[val_name(0)])


@pytest.mark.slow
def test_meta_json_that_is_a_directory_is_one_line(tmp_path, server):
    out_dir = tmp_path / "c4"
    (out_dir / "meta.json").mkdir(parents=True)
    result = run_script("--out_dir", out_dir, "--base_url", server.base_url, "--workers", "1", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"error: {out_dir / 'meta.json'} is a directory, not the dataset's meta.json; "
                                          "move it away"]
    assert server.requests == []


@pytest.mark.slow
def test_corrupt_shard_in_a_worker_pool_is_one_line(tmp_path, server):
    """With 2 worker processes: the worker's error reaches the user as the one line, the shards
    finished meanwhile stay recorded, no temp file is left, and the rerun completes."""
    name = train_name(1)
    good = (server.root / "en" / name).read_bytes()
    (server.root / "en" / name).write_bytes(good[: len(good) // 2])
    out_dir = tmp_path / "c4"
    args = ["--shards", "3", "--out_dir", out_dir, "--base_url", server.base_url, "--workers", "2"]
    result = run_script(*args, cwd=tmp_path)
    assert result.returncode == 1
    lines = error_lines(result.stderr)  # (the download's progress bars share stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: {out_dir / name} is corrupt (truncated"), result.stderr
    assert "Traceback" not in result.stderr
    index = json.loads((out_dir / "meta.json").read_text())
    recorded = [e["shard"] for files in index["token_files"].values() for e in files]
    assert name not in recorded and name in index["unfinished"] and train_name(0) in recorded
    assert sorted(files_in(out_dir / "train")) == sorted(f"{n.removesuffix('.json.gz')}.bin" for n in recorded
                                                         if n.startswith("c4-train"))
    (server.root / "en" / name).write_bytes(good)
    rerun = run_script(*args, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert name in re.findall(r"tokenised (\S+):", rerun.stdout) and train_name(0) not in rerun.stdout.split("to do")[1]
    check_outputs(out_dir, sum((server.docs[train_name(i)] for i in range(3)), []), server.docs[val_name(0)])
