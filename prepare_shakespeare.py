"""Prepare the tiny Shakespeare dataset for character-level language modelling.

The result is three files in ``out_dir``:

* ``train.bin`` / ``val.bin`` -- token ids as raw ``np.uint16`` arrays, so the
  training script can ``np.memmap`` them without parsing anything;
* ``meta.json`` -- the vocabulary (``itos``) and a few facts about the run,
  so that samples can be decoded back into text and the run can be audited.

Usage::

    python prepare_shakespeare.py                      # download + prepare
    python prepare_shakespeare.py --input my_text.txt  # bring your own text

Two rules shape the code below:

1. Fail loudly and early. Every problem (bad download, wrong checksum, a file
   that is not text, ...) becomes one ``data.DataError`` with a message that
   names the file and says what was expected.
2. Never leave half-written output. Every file is written to a temporary file
   in the same directory and then moved into place with ``os.replace``, which
   is atomic on the same filesystem (``utils.atomic_write``). meta.json goes
   last (``data.write_tokens``, ``data.write_meta``): a crash leaves a complete
   dataset or one without meta.json, never bins that meta.json does not describe.
"""

import argparse
import hashlib
import os
import sys

import numpy as np
import requests
from tqdm import tqdm

from data import (BPE_ENCODING, BPE_EOT, BPE_TOKENS, BPE_VOCAB_SIZE, DataError, gpt2_encoding, sha256_of_file,
                  write_meta, write_tokens)
from errors import UsageError, UserError, end_with
from utils import atomic_write, check_arguments, check_writable, remove_leftovers

DEFAULT_OUT_DIR = os.path.join("data", "shakespeare_char")
DEFAULT_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/"
    "data/tinyshakespeare/input.txt"
)
# sha256 of the canonical file (1,115,394 characters). Pinning the hash means
# every student trains on exactly the same bytes, and a corrupted or changed
# download is caught here instead of showing up as a mysterious loss curve.
DEFAULT_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

TOKENIZERS = ("char", "gpt2")
TRAIN_FRACTION = 0.9
# Ids are stored as uint16. We allow at most 65535 distinct characters, one
# fewer than uint16 could hold, which keeps the id 65535 free for a later
# padding / end-of-text marker.
MAX_VOCAB = int(np.iinfo(np.uint16).max)  # 65535
HTTP_TIMEOUT = (10, 60)  # seconds: (connect, read between chunks)
CHUNK_SIZE = 1 << 16


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def _normalize_sha256(sha256):
    """Return a lower-case hex digest, or None if no check was requested.

    Catching a malformed hash up front gives a better message than a
    guaranteed "checksum mismatch" after a full download.
    """
    if sha256 is None or sha256.strip() == "":
        return None
    sha256 = sha256.strip().lower()
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise DataError(f"invalid sha256 {sha256!r}: expected 64 hex digits")
    return sha256


# ---------------------------------------------------------------------------
# step 1: get the raw text
# ---------------------------------------------------------------------------

def download(url, dest_path, sha256=None):
    """Download ``url`` to ``dest_path`` and return the sha256 hex digest.

    The hash is computed while streaming, so we never read the file twice.
    If ``sha256`` is given, a mismatch is an error and nothing is left behind;
    if ``dest_path`` already holds a file with that hash, the download is
    skipped (rerunning the script is cheap and works offline).
    """
    expected = _normalize_sha256(sha256)

    if expected is not None and os.path.isfile(dest_path):
        if sha256_of_file(dest_path) == expected:
            print(f"{dest_path} already downloaded and verified, skipping download")
            return expected

    digest = {}

    def write(tmp):  # raising here leaves no file: atomic_write renames only on success
        with requests.get(url, stream=True, timeout=HTTP_TIMEOUT) as resp:
            resp.raise_for_status()
            # Content-Length counts bytes on the wire; with gzip it would not
            # match the decoded bytes we count, so only trust it uncompressed.
            length = resp.headers.get("Content-Length")
            encoded = resp.headers.get("Content-Encoding", "identity") != "identity"
            total = int(length) if length and length.isdigit() and not encoded else None

            h = hashlib.sha256()
            with open(tmp, "wb") as f, tqdm(
                total=total, unit="B", unit_scale=True, desc="downloading"
            ) as bar:
                for chunk in resp.iter_content(chunk_size=CHUNK_SIZE):
                    f.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
        digest["got"] = got = h.hexdigest()
        if expected is not None and got != expected:
            raise DataError(
                f"checksum mismatch for {url}: expected sha256 {expected}, got {got}"
            )

    try:
        atomic_write(dest_path, write)
    except requests.HTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        reason = exc.response.reason if exc.response is not None else ""
        raise DataError(f"download of {url} failed: HTTP {status} {reason}".rstrip()) from exc
    except requests.RequestException as exc:
        raise DataError(f"download of {url} failed: {exc}") from exc
    except OSError as exc:
        raise DataError(f"could not save {url} to {dest_path}: {exc}") from exc
    return digest["got"]


def read_text(path):
    """Read ``path`` as UTF-8 text, checking it is something we can train on.

    Returns ``(text, sha256 of the raw bytes)``. We decode the bytes ourselves
    (no newline translation) so that the ids decode back to exactly the file.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"input file {path} not found: expected a UTF-8 text file") from None
    except IsADirectoryError:
        raise DataError(f"input {path} is a directory: expected a UTF-8 text file") from None
    except OSError as exc:
        raise DataError(f"could not read input file {path}: {exc}") from exc

    if not data:
        raise DataError(f"input file {path} is empty: expected non-empty UTF-8 text")
    if b"\x00" in data:
        raise DataError(
            f"input file {path} contains NUL bytes (at byte {data.index(0)}): "
            "expected UTF-8 text, this looks like a binary file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"input file {path} is not valid UTF-8 (bad byte at offset {exc.start}): "
            "expected UTF-8 text"
        ) from None
    if len(text) < 2:
        raise DataError(
            f"input file {path} has {len(text)} character: expected at least 2 "
            "so that both train and val splits are non-empty"
        )
    return text, hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------
# step 2: tokenize, split, write
# ---------------------------------------------------------------------------

def build_char_vocab(text, source):
    """The vocabulary is every distinct character, sorted so it is reproducible.

    Sorting means the same text always gives the same ids, independent of
    Python's set ordering.
    """
    itos = sorted(set(text))
    if len(itos) > MAX_VOCAB:
        raise DataError(
            f"input {source} has {len(itos)} distinct characters: expected at most "
            f"{MAX_VOCAB} so that ids fit in uint16 (with one id to spare)"
        )
    return itos


def encode_char(text, itos):
    """Map each character to its index in ``itos``, as a uint16 array."""
    stoi = {ch: i for i, ch in enumerate(itos)}
    return np.array([stoi[ch] for ch in text], dtype=np.uint16)


def default_out_dir(tokenizer):
    return DEFAULT_OUT_DIR if tokenizer == "char" else os.path.join("data", "shakespeare_gpt2")


def prepare_missing(data_dir, source=""):
    """What train.py calls before reading data_dir: if data_dir is one of this script's default
    folders and holds no dataset yet, prepare it (so the quick start is one command) and return
    True; otherwise leave it alone and return False. `source` is a URL or a local file ('' = the
    public tiny Shakespeare, sha256-checked); a failed download says how to use a local copy."""
    tokenizer = next((t for t in TOKENIZERS if os.path.normpath(data_dir) == default_out_dir(t)), None)
    if tokenizer is None and source:  # it would be ignored: the run would train on what data_dir holds
        folders = " or ".join(default_out_dir(t) for t in TOKENIZERS)
        raise UsageError(f"--data_source prepares {folders} while it is empty, not --data_dir {data_dir}: "
                         f"prepare that with python prepare_shakespeare.py --input ... --out_dir {data_dir}")
    if tokenizer is None or os.path.exists(os.path.join(data_dir, "meta.json")):
        return False
    is_url = not source or source.startswith(("http://", "https://"))
    print(f"{data_dir} holds no dataset yet: preparing tiny Shakespeare ({tokenizer}) "
          f"from {source or DEFAULT_URL}")
    try:
        prepare(input_path=None if is_url else source, out_dir=data_dir, url=source or DEFAULT_URL,
                tokenizer=tokenizer)
    except DataError as exc:
        if not is_url:
            raise
        raise DataError(f"{exc} (offline? give a local copy of the text: "
                        "--data_source=/path/to/input.txt)") from exc
    return True


def prepare(
    input_path=None,
    out_dir=None,
    url=DEFAULT_URL,
    sha256=DEFAULT_SHA256,
    tokenizer="char",
):
    """Build ``train.bin``, ``val.bin`` and ``meta.json`` in ``out_dir``.

    Without ``input_path`` the text is downloaded from ``url`` and verified
    against ``sha256``. With ``input_path`` the file is used as is: people
    bring their own text, so a different hash only earns a note.
    Returns the meta dict that was written to ``meta.json``.
    """
    if tokenizer not in TOKENIZERS:
        raise DataError(
            f"unknown tokenizer {tokenizer!r}: expected one of {', '.join(TOKENIZERS)}"
        )
    expected = _normalize_sha256(sha256)
    out_dir = out_dir or default_out_dir(tokenizer)
    try:
        for name in remove_leftovers(out_dir, ("input.txt", "train.bin", "val.bin", "meta.json")):
            print(f"note: removed {name} in {out_dir}, left by a preparation that was killed")
    except OSError as exc:
        raise DataError(f"could not write outputs to {out_dir}: {exc}") from exc

    if input_path is None:
        source = url
        text_path = os.path.join(out_dir, "input.txt")
        download(url, text_path, sha256=expected)
    else:
        source = str(input_path)
        text_path = input_path

    text, digest = read_text(text_path)
    if input_path is not None and expected is not None and digest != expected:
        print(
            f"note: {input_path} is not the reference tiny Shakespeare "
            f"(sha256 {digest[:12]}..., expected {expected[:12]}...); using it anyway"
        )

    # Split by position, not at random: the val set is a contiguous chunk of
    # unseen text, so val loss measures generalisation to new passages.
    if tokenizer == "char":
        itos = build_char_vocab(text, text_path)
        ids = encode_char(text, itos)
        n_train = int(len(ids) * TRAIN_FRACTION)
        train_ids, val_ids = ids[:n_train], ids[n_train:]
        vocab = {"tokenizer": "char", "vocab_size": len(itos), "itos": itos}
    else:  # GPT-2 BPE: the same character split, each side encoded on its own
        encoding = gpt2_encoding()
        n_chars = int(len(text) * TRAIN_FRACTION)
        train_ids, val_ids = (np.array(encoding.encode_ordinary(part), dtype=np.uint16)
                              for part in (text[:n_chars], text[n_chars:]))
        vocab = {"tokenizer": BPE_ENCODING, "vocab_size": BPE_VOCAB_SIZE,
                 "tokenizer_vocab_size": BPE_TOKENS, "eot_token": BPE_EOT}

    meta = {
        **vocab,
        "n_train": int(len(train_ids)),
        "n_val": int(len(val_ids)),
        "source": source,
        "sha256": digest,
    }
    # each file's hash: train.py and evaluate.py compare it
    for split, ids in (("train", train_ids), ("val", val_ids)):
        meta[f"{split}_sha256"] = write_tokens(os.path.join(out_dir, f"{split}.bin"), [ids])[1]
    write_meta(meta, out_dir)  # last: its presence means the bins are done
    return meta


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

def main(argv=None):
    """Parse arguments, run ``prepare`` and print a summary.

    Errors are reported as one ``error: ...`` line and exit code 1, instead of
    a traceback, because they are about the user's data, not about this code.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default=None,
                        help="use this local text file instead of downloading")
    parser.add_argument("--out_dir", default=None,
                        help="where to write train.bin, val.bin, meta.json "
                             f"(default: {DEFAULT_OUT_DIR}, or data/shakespeare_gpt2 with --tokenizer gpt2)")
    parser.add_argument("--url", default=DEFAULT_URL,
                        help="where to download the text from")
    parser.add_argument("--sha256", default=DEFAULT_SHA256,
                        help="expected sha256 of the download; '' disables the check")
    parser.add_argument("--tokenizer", default="char", choices=TOKENIZERS,
                        help="char: one id per character; gpt2: GPT-2 BPE through tiktoken "
                             f"({BPE_ENCODING}, vocab padded to {BPE_VOCAB_SIZE})")
    args = parser.parse_args(argv)
    try:
        _normalize_sha256(args.sha256)
        bad_sha256 = None
    except DataError as exc:
        bad_sha256 = str(exc)
    try:
        check_arguments(  # the usage error's status, before anything is downloaded or written
            (bad_sha256 is not None, f"--sha256: {bad_sha256}"),
            (args.input is not None and args.input.strip() == "", "--input must name a file"),
            (args.out_dir is not None and args.out_dir.strip() == "", "--out_dir must not be empty"))
        check_writable(args.out_dir or default_out_dir(args.tokenizer), "--out_dir", directory=True)
        meta = prepare(
            input_path=args.input,
            out_dir=args.out_dir,
            url=args.url,
            sha256=args.sha256,
            tokenizer=args.tokenizer,
        )
    except UserError as exc:  # the one place it ends the process
        end_with(exc)

    print(f"vocab size:   {meta['vocab_size']:,}")
    print(f"train tokens: {meta['n_train']:,}")
    print(f"val tokens:   {meta['n_val']:,}")
    print(f"wrote train.bin, val.bin, meta.json to {args.out_dir or default_out_dir(args.tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
