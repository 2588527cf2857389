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
import threading
import urllib.parse
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# tiktoken reads its BPE file from this cache (no network here); spawned workers inherit it.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO_ROOT.parent / "shared" / "data" / "tiktoken"))

import tiktoken  # noqa: E402

import prepare_c4 as pc  # noqa: E402
from data import BPE_EOT, BPE_TOKENS, DataError  # noqa: E402

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


def check_outputs(out_dir, docs_train, docs_val):
    meta = json.loads((out_dir / "meta.json").read_text())
    train = np.fromfile(out_dir / "train.bin", dtype=np.uint16)
    val = np.fromfile(out_dir / "val.bin", dtype=np.uint16)
    assert train.tolist() == expected_ids(docs_train)
    assert val.tolist() == expected_ids(docs_val)
    assert meta["n_train"] == len(train) and meta["n_val"] == len(val)
    assert meta["n_train_docs"] == len(docs_train) and meta["n_val_docs"] == len(docs_val)
    return meta, train, val


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
    assert meta["train_sha256"] == hashlib.sha256((out_dir / "train.bin").read_bytes()).hexdigest()
    assert meta["val_sha256"] == hashlib.sha256((out_dir / "val.bin").read_bytes()).hexdigest()
    assert (out_dir / "meta.json").read_text().startswith('{\n  "tokenizer": "r50k_base"')

    assert files_in(out_dir) == sorted(["meta.json", "train.bin", "val.bin", train_name(0),
                                        train_name(1), val_name(0)])
    assert sorted(server.paths()) == sorted(f"/en/{n}" for n in meta["train_shards"] + meta["val_shards"])
    assert all(rng is None for _, rng in server.requests)


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
    # the bad shard is moved aside; no bins, no meta, no temp files
    assert files_in(out_dir) == sorted([train_name(0), f"{name}.corrupt", val_name(0)])

    # the server has a good copy again: a rerun downloads only that shard and succeeds
    (server.root / "en" / name).write_bytes(good)
    server.requests.clear()
    assert pc.main(args) == 0
    assert server.requests == [(f"/en/{name}", None)]
    check_outputs(out_dir, server.docs[train_name(0)] + server.docs[name], server.docs[val_name(0)])
    assert leftovers(out_dir) == []


def test_corrupt_new_shard_keeps_previous_outputs(tmp_path, server):
    out_dir = tmp_path / "c4"
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    before = {n: (out_dir / n).read_bytes() for n in ("train.bin", "val.bin", "meta.json")}

    (server.root / "en" / train_name(1)).write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(DataError, match=re.escape(train_name(1))):
        pc.prepare(shards=2, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    assert {n: (out_dir / n).read_bytes() for n in before} == before
    assert leftovers(out_dir) == []


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
    assert files_in(out_dir) == [train_name(0)]  # the shard before it, nothing else
    assert server.paths().count(f"/en/{name}") == 1  # a 404 is not retried


@pytest.mark.parametrize("args, expected", [
    (["--shards", "0"], "between 1 and 1024"),
    (["--shards", "1025"], "between 1 and 1024"),
    (["--val_shards", "9"], "between 1 and 8"),
    (["--workers", "0"], "workers must be at least 1"),
])
def test_bad_arguments(tmp_path, capsys, args, expected):
    out_dir = tmp_path / "c4"
    with pytest.raises(SystemExit) as excinfo:
        pc.main(args + ["--out_dir", str(out_dir), "--base_url", "http://127.0.0.1:9"])
    assert excinfo.value.code == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and expected in lines[0]
    assert files_in(out_dir) == []


# ---------------------------------------------------------------------------
# reruns
# ---------------------------------------------------------------------------

def test_rerun_downloads_nothing_and_adding_a_shard_fetches_only_it(tmp_path, server, capsys):
    out_dir = tmp_path / "c4"
    meta = pc.prepare(shards=2, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    mtimes = {n: os.stat(out_dir / n).st_mtime_ns for n in ("train.bin", "val.bin", "meta.json")}

    server.requests.clear()
    capsys.readouterr()
    assert pc.prepare(shards=2, out_dir=str(out_dir), base_url=server.base_url, **FAST) == meta
    assert server.requests == []
    assert "up to date" in capsys.readouterr().out
    assert {n: os.stat(out_dir / n).st_mtime_ns for n in mtimes} == mtimes  # not rewritten

    pc.prepare(shards=3, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    assert server.requests == [(f"/en/{train_name(2)}", None)]
    docs = sum((server.docs[train_name(i)] for i in range(3)), [])
    check_outputs(out_dir, docs, server.docs[val_name(0)])
    assert leftovers(out_dir) == []


def test_changed_shard_is_retokenised(tmp_path, server):
    """The up-to-date check compares shard hashes, not just names."""
    out_dir = tmp_path / "c4"
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    new_docs = make_docs("replaced", n=6)
    (out_dir / val_name(0)).write_bytes(shard_bytes(new_docs))  # e.g. a hand-copied shard
    pc.prepare(shards=1, out_dir=str(out_dir), base_url=server.base_url, **FAST)
    check_outputs(out_dir, server.docs[train_name(0)], new_docs)


def test_from_text_makes_c4_shards_offline_and_c4_tiny_trains_on_them(tmp_path):
    """The offline path: paragraphs of a text become C4-format shards (every 10th to validation),
    checked and tokenised like downloaded ones; then config/c4_tiny.py trains on the result."""
    paragraphs = [f"Paragraph {i}: to be, or not to be.\nThat is line two of {i}." for i in range(400)]
    text = tmp_path / "input.txt"
    text.write_text("\n\n".join(paragraphs) + "\n")
    out = tmp_path / "c4"
    meta = pc.prepare(out_dir=str(out), workers=1, from_text=str(text))
    enc = tiktoken.get_encoding("r50k_base")
    train = np.fromfile(out / "train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(out / "val.bin", dtype=np.uint16).tolist()
    assert val == [t for p in paragraphs[9::10] for t in enc.encode_ordinary(p) + [EOT]]
    assert train == [t for i, p in enumerate(paragraphs) if i % 10 != 9 for t in enc.encode_ordinary(p) + [EOT]]
    assert meta["source"].startswith("file://") and meta["n_val_docs"] == 40
    with gzip.open(out / train_name(0), "rt") as f:
        assert json.loads(f.readline())["text"] == paragraphs[0]
    assert pc.prepare(out_dir=str(out), workers=1, from_text=str(text)) == meta  # rerun: up to date
    run = subprocess.run([sys.executable, "train.py", "config/c4_tiny.py", f"--data_dir={out}",
                          f"--out_dir={tmp_path / 'run'}", "--max_iters=3", "--eval_interval=3", "--eval_iters=1",
                          "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16", "--batch_size=2", "--warmup_iters=1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert records[-1]["iter"] == 3 and records[-1]["val"] < records[0]["val"]
    # the final evaluation streams: 40 val documents (> 333 tokens) x 50304 logits is past evaluate.STREAM_ABOVE
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
