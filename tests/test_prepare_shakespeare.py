"""Tests for prepare_shakespeare.py.

Everything runs on small texts written into tmp_path. The download tests use
a real HTTP server on 127.0.0.1, so the requests/streaming/checksum code runs
for real, without touching the internet.
"""

import functools
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

import prepare_shakespeare as ps  # noqa: E402
from data import DataError, read_meta  # noqa: E402

SHARED_INPUT = Path("/work/shared/data/tinyshakespeare/input.txt")
SAMPLE_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die "
    "than to famish?\n\nAll:\nResolved. resolved.\n"
    "Unicode too: caf\u00e9 \u2014 na\u00efve \u00fcber \U0001F3AD\n"
)
OUTPUT_NAMES = {"train.bin", "val.bin", "meta.json"}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_in(directory: Path) -> list:
    """All names in directory (including hidden temp files); [] if it is absent."""
    return sorted(os.listdir(directory)) if directory.exists() else []


def decode_outputs(out_dir: Path):
    meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    train = np.fromfile(out_dir / "train.bin", dtype=np.uint16)
    val = np.fromfile(out_dir / "val.bin", dtype=np.uint16)
    itos = meta["itos"]
    return meta, train, val, "".join(itos[i] for i in train), "".join(itos[i] for i in val)


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def http_root(tmp_path, monkeypatch):
    """Serve a fresh directory over HTTP on 127.0.0.1; yields (dir, base_url)."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")

    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def sample_file(tmp_path):
    path = tmp_path / "sample.txt"
    path.write_bytes(SAMPLE_TEXT.encode("utf-8"))
    return path


# ---------------------------------------------------------------------------
# local --input
# ---------------------------------------------------------------------------

def test_local_input_roundtrip_split_and_meta(tmp_path, sample_file):
    out_dir = tmp_path / "out"
    meta = ps.prepare(input_path=str(sample_file), out_dir=str(out_dir))

    assert set(files_in(out_dir)) == OUTPUT_NAMES  # no temp files, no input.txt
    on_disk, train, val, train_text, val_text = decode_outputs(out_dir)
    assert on_disk == meta

    # ids decode back to exactly the original text
    assert train_text + val_text == SAMPLE_TEXT
    # first 90% by position is train, the rest val
    n = len(SAMPLE_TEXT)
    assert len(train) == int(n * 0.9) and len(val) == n - int(n * 0.9)
    assert train_text == SAMPLE_TEXT[: int(n * 0.9)]

    # raw uint16: file size is exactly 2 bytes per token
    assert (out_dir / "train.bin").stat().st_size == 2 * len(train)
    assert (out_dir / "val.bin").stat().st_size == 2 * len(val)

    assert meta["tokenizer"] == "char"
    assert meta["itos"] == sorted(set(SAMPLE_TEXT))
    assert meta["vocab_size"] == len(meta["itos"])
    assert meta["n_train"] == len(train) and meta["n_val"] == len(val)
    assert meta["source"] == str(sample_file)
    assert meta["sha256"] == sha256_hex(SAMPLE_TEXT.encode("utf-8"))
    assert int(max(train.max(), val.max())) == meta["vocab_size"] - 1  # every id is used
    assert set(meta) == {"tokenizer", "vocab_size", "itos", "n_train", "n_val", "source", "sha256", "train_sha256",
                         "val_sha256"}
    for split in ("train", "val"):  # each token file's own hash (train.py and evaluate.py compare it)
        assert meta[f"{split}_sha256"] == sha256_hex((out_dir / f"{split}.bin").read_bytes())


def test_meta_json_is_indented(tmp_path, sample_file):
    out_dir = tmp_path / "out"
    ps.prepare(input_path=str(sample_file), out_dir=str(out_dir))
    raw = (out_dir / "meta.json").read_text(encoding="utf-8")
    assert raw.startswith('{\n  "tokenizer": "char"')


def test_crlf_and_trailing_whitespace_are_preserved(tmp_path):
    text = "a\r\nb\r\n  \t\n"
    path = tmp_path / "crlf.txt"
    path.write_bytes(text.encode("utf-8"))
    out_dir = tmp_path / "out"
    ps.prepare(input_path=str(path), out_dir=str(out_dir))
    _, _, _, train_text, val_text = decode_outputs(out_dir)
    assert train_text + val_text == text


def test_note_when_input_differs_from_reference(tmp_path, sample_file, capsys):
    ps.prepare(input_path=str(sample_file), out_dir=str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and str(sample_file) in out


def distinct_chars(count):
    """`count` distinct non-NUL code points, skipping the surrogate range."""
    chars = [chr(c) for c in range(1, 0xD800)] + [chr(c) for c in range(0xE000, 0x20000)]
    return "".join(chars[:count])


def test_too_many_distinct_chars(tmp_path):
    path = tmp_path / "huge_vocab.txt"
    path.write_bytes(distinct_chars(65536).encode("utf-8"))
    out_dir = tmp_path / "out"
    with pytest.raises(DataError, match="65536 distinct characters") as excinfo:
        ps.prepare(input_path=str(path), out_dir=str(out_dir))
    assert str(path) in str(excinfo.value) and "65535" in str(excinfo.value)
    assert files_in(out_dir) == []


def test_largest_allowed_vocab(tmp_path):
    text = distinct_chars(65535)
    path = tmp_path / "max_vocab.txt"
    path.write_bytes(text.encode("utf-8"))
    out_dir = tmp_path / "out"
    meta = ps.prepare(input_path=str(path), out_dir=str(out_dir), sha256=None)
    assert meta["vocab_size"] == 65535
    _, train, val, train_text, val_text = decode_outputs(out_dir)
    assert train_text + val_text == text
    assert int(max(train.max(), val.max())) == 65534


def test_failed_rename_leaves_no_files(tmp_path, sample_file, monkeypatch):
    def broken_replace(src, dst):
        raise OSError("simulated disk failure")

    monkeypatch.setattr(ps.os, "replace", broken_replace)
    out_dir = tmp_path / "out"
    with pytest.raises(DataError, match="simulated disk failure"):
        ps.prepare(input_path=str(sample_file), out_dir=str(out_dir))
    assert files_in(out_dir) == []


def test_failed_write_never_leaves_meta_json_beside_other_bins(tmp_path, sample_file, monkeypatch):
    """train.bin is replaced, val.bin fails: the old meta.json no longer describes both bins, so it is gone."""
    out_dir = tmp_path / "out"
    ps.prepare(input_path=str(sample_file), out_dir=str(out_dir))
    replace = os.replace

    def replace_only_train(src, dst):
        if dst.endswith("val.bin"):
            raise OSError("simulated disk failure")
        replace(src, dst)

    monkeypatch.setattr(ps.os, "replace", replace_only_train)
    with pytest.raises(DataError, match="simulated disk failure"):
        ps.prepare(input_path=str(sample_file), out_dir=str(out_dir), tokenizer="char", sha256=None)
    assert files_in(out_dir) == ["train.bin", "val.bin"]
    with pytest.raises(DataError, match="missing meta.json"):
        read_meta(str(out_dir))


def test_error_keeps_previous_outputs_intact(tmp_path, sample_file):
    out_dir = tmp_path / "out"
    ps.prepare(input_path=str(sample_file), out_dir=str(out_dir))
    before = {name: (out_dir / name).read_bytes() for name in OUTPUT_NAMES}

    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError):
        ps.prepare(input_path=str(bad), out_dir=str(out_dir))
    assert {name: (out_dir / name).read_bytes() for name in OUTPUT_NAMES} == before
    assert set(files_in(out_dir)) == OUTPUT_NAMES


def test_unknown_tokenizer_is_rejected(tmp_path, sample_file):
    with pytest.raises(DataError, match="unknown tokenizer"):
        ps.prepare(input_path=str(sample_file), out_dir=str(tmp_path / "out"), tokenizer="sentencepiece")


def test_gpt2_bpe_splits_characters_then_encodes_each_side(tmp_path, sample_file, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", os.environ.get("TIKTOKEN_CACHE_DIR", str(REPO_ROOT.parent / "shared" / "data" / "tiktoken")))
    import tiktoken
    try:
        enc = tiktoken.get_encoding("r50k_base")
    except Exception as exc:  # no cache and no network
        pytest.skip(f"GPT-2 BPE ranks unavailable ({type(exc).__name__}); set TIKTOKEN_CACHE_DIR")
    text = sample_file.read_text(encoding="utf-8")
    meta = ps.prepare(input_path=str(sample_file), out_dir=str(tmp_path / "out"), tokenizer="gpt2")
    n = int(len(text) * 0.9)
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16).tolist()
    assert enc.decode(train) == text[:n] and enc.decode(val) == text[n:]
    assert (meta["tokenizer"], meta["vocab_size"], meta["n_train"], meta["n_val"]) == ("r50k_base", 50304, len(train), len(val))
    assert "itos" not in meta


def test_gpt2_without_cached_ranks_is_one_line_that_names_the_cache(tmp_path, sample_file, monkeypatch, capsys):
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(SystemExit) as excinfo:
        ps.main(["--input", str(sample_file), "--out_dir", str(tmp_path / "out"), "--tokenizer", "gpt2"])
    assert excinfo.value.code == 1
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ")
    assert "r50k_base" in err_lines[0] and "no network" in err_lines[0] and "TIKTOKEN_CACHE_DIR" in err_lines[0]
    assert files_in(tmp_path / "out") == []


def test_invalid_sha256_argument(tmp_path, sample_file):
    with pytest.raises(DataError, match="64 hex digits"):
        ps.prepare(input_path=str(sample_file), out_dir=str(tmp_path / "out"), sha256="abc")


def test_a_bad_argument_is_one_line_and_status_2(tmp_path, capsys):
    """argparse's own error printed its usage block too (errors.ArgumentParser, as prepare_c4.py)."""
    with pytest.raises(SystemExit) as excinfo:
        ps.main(["--tokenizer", "bpe", "--out_dir", str(tmp_path / "out")])
    assert excinfo.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["error: argument --tokenizer: invalid choice: 'bpe' (choose from 'char', 'gpt2')"]
    assert captured.out == "" and files_in(tmp_path / "out") == []


@pytest.mark.skipif(not SHARED_INPUT.is_file(), reason="shared tiny Shakespeare copy not present")
def test_real_tiny_shakespeare(tmp_path, capsys):
    out_dir = tmp_path / "out"
    meta = ps.prepare(input_path=str(SHARED_INPUT), out_dir=str(out_dir))
    assert meta["sha256"] == ps.DEFAULT_SHA256
    assert meta["vocab_size"] == 65
    assert meta["n_train"] + meta["n_val"] == 1_115_394
    assert meta["n_train"] == int(1_115_394 * 0.9)
    assert "note:" not in capsys.readouterr().out  # it is the reference file
    assert np.fromfile(out_dir / "train.bin", dtype=np.uint16).size == meta["n_train"]


# ---------------------------------------------------------------------------
# download over a real local HTTP server
# ---------------------------------------------------------------------------

def test_download_correct_sha(tmp_path, http_root):
    root, base_url = http_root
    payload = SAMPLE_TEXT.encode("utf-8")
    (root / "input.txt").write_bytes(payload)
    out_dir = tmp_path / "out"

    meta = ps.prepare(out_dir=str(out_dir), url=f"{base_url}/input.txt", sha256=sha256_hex(payload))

    assert set(files_in(out_dir)) == OUTPUT_NAMES | {"input.txt"}
    assert (out_dir / "input.txt").read_bytes() == payload
    assert meta["source"] == f"{base_url}/input.txt"
    assert meta["sha256"] == sha256_hex(payload)
    _, _, _, train_text, val_text = decode_outputs(out_dir)
    assert train_text + val_text == SAMPLE_TEXT


def test_download_function_returns_digest(tmp_path, http_root):
    root, base_url = http_root
    payload = b"hello world\n" * 1000
    (root / "f.txt").write_bytes(payload)
    dest = tmp_path / "dl" / "f.txt"
    assert ps.download(f"{base_url}/f.txt", str(dest)) == sha256_hex(payload)
    assert dest.read_bytes() == payload
    assert files_in(dest.parent) == ["f.txt"]


def test_download_skipped_when_verified_file_exists(tmp_path, http_root, capsys):
    root, base_url = http_root
    payload = SAMPLE_TEXT.encode("utf-8")
    (root / "input.txt").write_bytes(payload)
    out_dir = tmp_path / "out"
    url, sha = f"{base_url}/input.txt", sha256_hex(payload)
    ps.prepare(out_dir=str(out_dir), url=url, sha256=sha)

    # The server no longer has the file: a second run only works if it skips the download.
    (root / "input.txt").unlink()
    capsys.readouterr()
    ps.prepare(out_dir=str(out_dir), url=url, sha256=sha)
    assert "skipping download" in capsys.readouterr().out


def test_download_wrong_sha_leaves_nothing(tmp_path, http_root):
    root, base_url = http_root
    payload = SAMPLE_TEXT.encode("utf-8")
    (root / "input.txt").write_bytes(payload)
    out_dir = tmp_path / "out"
    url, wrong = f"{base_url}/input.txt", "0" * 64

    with pytest.raises(DataError) as excinfo:
        ps.prepare(out_dir=str(out_dir), url=url, sha256=wrong)
    msg = str(excinfo.value)
    assert url in msg and wrong in msg and sha256_hex(payload) in msg
    assert files_in(out_dir) == []


def test_download_404_leaves_nothing(tmp_path, http_root):
    _, base_url = http_root
    out_dir = tmp_path / "out"
    url = f"{base_url}/missing.txt"

    with pytest.raises(DataError) as excinfo:
        ps.prepare(out_dir=str(out_dir), url=url)
    assert url in str(excinfo.value) and "404" in str(excinfo.value)
    assert files_in(out_dir) == []


def test_main_download_error_exit_code(tmp_path, http_root, capsys):
    _, base_url = http_root
    out_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as excinfo:
        ps.main(["--out_dir", str(out_dir), "--url", f"{base_url}/nope.txt"])
    assert excinfo.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "404" in err
    assert files_in(out_dir) == []


# ---------------------------------------------------------------------------
# main() with bad inputs
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("missing.txt", None, "not found"),
        ("empty.txt", b"", "is empty"),
        ("nul.bin", b"hello\x00world\n", "NUL bytes"),
        ("latin1.txt", "caf\u00e9 cr\u00e8me\n".encode("latin-1"), "not valid UTF-8"),
        ("png.bin", b"\x89PNG\r\n\x1a\n\xff\xfe\xfd", "not valid UTF-8"),
    ],
)
def test_main_rejects_bad_input(tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    out_dir = tmp_path / "out"

    with pytest.raises(SystemExit) as excinfo:
        ps.main(["--input", str(path), "--out_dir", str(out_dir)])
    assert excinfo.value.code == 1

    captured = capsys.readouterr()
    err_lines = captured.err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ")
    assert str(path) in err_lines[0] and expected in err_lines[0]
    assert files_in(out_dir) == []


def test_main_success_returns_zero(tmp_path, sample_file, capsys):
    out_dir = tmp_path / "out"
    assert ps.main(["--input", str(sample_file), "--out_dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "vocab size" in out and str(out_dir) in out
    assert set(files_in(out_dir)) == OUTPUT_NAMES


# ---------------------------------------------------------------------------
# end to end through the real command line
# ---------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_subprocess(tmp_path, sample_file):
    out_dir = tmp_path / "cli_out"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "prepare_shakespeare.py"),
         "--input", str(sample_file), "--out_dir", str(out_dir)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    meta, _, _, train_text, val_text = decode_outputs(out_dir)
    assert train_text + val_text == SAMPLE_TEXT
    assert f"vocab size:   {meta['vocab_size']}" in result.stdout
    assert set(files_in(out_dir)) == OUTPUT_NAMES


# ---------------------------------------------------------------------------
# train.py prepares tiny Shakespeare itself when its default data_dir is empty
# ---------------------------------------------------------------------------

TINY_RUN = ["--n_layer=1", "--n_head=1", "--n_embd=8", "--block_size=16", "--batch_size=2", "--max_iters=2",
            "--eval_interval=2", "--eval_iters=1", "--warmup_iters=1", "--lr_decay_iters=2", "--final_eval=False",
            "--num_threads=1"]


def train_in(cwd, *args):
    """train.py run from `cwd`, so its default data_dir (data/shakespeare_char) is cwd's."""
    return subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), str(REPO_ROOT / "config/lowres_baseline.py"),
                           "--out_dir=out", *TINY_RUN, *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_INPUT.exists(), reason="needs the real tiny Shakespeare (its sha256 is checked)")
def test_train_prepares_missing_data_from_the_url(tmp_path, http_root):
    root, base_url = http_root
    (root / "input.txt").write_bytes(SHARED_INPUT.read_bytes())
    result = train_in(tmp_path, f"--data_source={base_url}/input.txt")
    assert result.returncode == 0, result.stderr[-2000:]
    meta = read_meta(str(tmp_path / "data" / "shakespeare_char"))
    assert meta["sha256"] == ps.DEFAULT_SHA256 and meta["n_train"] + meta["n_val"] == 1_115_394
    assert (tmp_path / "out" / "log.jsonl").exists()
    again = train_in(tmp_path, "--out_dir=out2", "--data_source=http://127.0.0.1:9/never-asked")
    assert again.returncode == 0 and "preparing" not in again.stdout  # prepared once, then only read


@pytest.mark.slow
def test_train_refuses_a_download_with_the_wrong_checksum(tmp_path, http_root):
    root, base_url = http_root
    (root / "input.txt").write_bytes(SAMPLE_TEXT.encode("utf-8"))
    result = train_in(tmp_path, f"--data_source={base_url}/input.txt")
    assert result.returncode == 1
    error = result.stderr.strip().splitlines()[-1]
    assert "checksum mismatch" in error and "--data_source=/path/to/input.txt" in error
    assert files_in(tmp_path / "data" / "shakespeare_char") == [] and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_train_prepares_from_a_local_copy(tmp_path, sample_file):
    result = train_in(tmp_path, f"--data_source={sample_file}", "--low_resource=False")
    assert result.returncode == 0, result.stderr[-2000:]
    _, _, _, train_text, val_text = decode_outputs(tmp_path / "data" / "shakespeare_char")
    assert train_text + val_text == SAMPLE_TEXT and "note:" in result.stdout


def test_a_data_source_for_a_folder_it_does_not_prepare_is_refused(tmp_path):
    """--data_source prepares only this script's own folders while they are empty; with another
    --data_dir it was ignored without a word (the run trained on that folder's data)."""
    from errors import UsageError
    with pytest.raises(UsageError, match=rf"--data_source prepares data/shakespeare_char or data/shakespeare_gpt2 "
                                         rf"while it is empty, not --data_dir {tmp_path}: prepare that with"):
        ps.prepare_missing(str(tmp_path), "input.txt")
    assert ps.prepare_missing(str(tmp_path)) is False and os.listdir(tmp_path) == []  # no source: its data
