"""Prepare the tiny Shakespeare dataset for character-level (or GPT-2
BPE) language modelling.

Writes ``train.bin``, ``val.bin`` (``np.uint16`` ids) and
``meta.json`` in ``out_dir``.

Usage::

    python prepare_shakespeare.py                      # download + prepare
    python prepare_shakespeare.py --input my_text.txt  # bring your own text

Design notes: docs/data.md
"""

import hashlib
import os
import re
import sys

import numpy as np

import download as downloads
from data import (BPE_ENCODING, BPE_META, BPE_VOCAB_SIZE, DataError,
                  gpt2_encoding, write_meta)
from errors import ArgumentParser, UsageError, UserError, end_with
from utils import check_arguments, check_writable, remove_leftovers

DEFAULT_OUT_DIR = os.path.join("data", "shakespeare_char")
DEFAULT_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/"
               "master/data/tinyshakespeare/input.txt")
DEFAULT_SHA256 = ("86c4e6aa9db7c042ec79f339dcb96d42"
                  "b0075e16b8fc2e86bf0ca57e2dc565ed")

TOKENIZERS = ("char", "gpt2")
TRAIN_FRACTION = 0.9
MAX_VOCAB = int(np.iinfo(np.uint16).max)


def _normalize_sha256(sha256):
    """A lower-case hex digest, or None if no check was requested."""
    if sha256 is None or sha256.strip() == "":
        return None
    sha256 = sha256.strip().lower()
    if not re.fullmatch("[0-9a-f]{64}", sha256):
        raise DataError(f"invalid sha256 {sha256!r}: expected 64 hex digits")
    return sha256


def download(url, dest_path, sha256=None):
    """Download ``url`` to ``dest_path`` (download.py's); return its
    sha256. Given ``sha256``, a mismatch leaves nothing behind, and a
    ``dest_path`` that already has it is not downloaded again."""
    expected = _normalize_sha256(sha256)
    if os.path.isfile(dest_path):
        if file_sha256(dest_path) == expected:
            print(f"{dest_path} already downloaded and verified, "
                  "skipping download")
            return expected
        os.remove(dest_path)
    downloads.download(url, dest_path)
    got = file_sha256(dest_path)
    if expected is not None and got != expected:
        os.remove(dest_path)
        raise DataError(f"checksum mismatch for {url}: expected sha256 "
                        f"{expected}, got {got}")
    return got


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_text(path):
    """``path`` as UTF-8 text (no newline translation), and the
    sha256 of its bytes."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"input file {path} not found: "
                        "expected a UTF-8 text file") from None
    except IsADirectoryError:
        raise DataError(f"input {path} is a directory: "
                        "expected a UTF-8 text file") from None
    except OSError as exc:
        raise DataError(f"could not read input file {path}: {exc}") \
            from exc

    if not data:
        raise DataError(f"input file {path} is empty: "
                        "expected non-empty UTF-8 text")
    if b"\x00" in data:
        raise DataError(
            f"input file {path} contains NUL bytes (at byte "
            f"{data.index(0)}): expected UTF-8 text, this looks like a "
            "binary file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"input file {path} is not valid UTF-8 (bad byte at offset "
            f"{exc.start}): expected UTF-8 text") from None
    if len(text) < 2:
        raise DataError(
            f"input file {path} has {len(text)} character: expected at "
            "least 2 so that both train and val splits are non-empty")
    return text, hashlib.sha256(data).hexdigest()


def build_char_vocab(text, source):
    """Every distinct character, sorted."""
    itos = sorted(set(text))
    if len(itos) > MAX_VOCAB:
        raise DataError(
            f"input {source} has {len(itos)} distinct characters: "
            f"expected at most {MAX_VOCAB} so that ids fit in uint16 "
            "(with one id to spare)")
    return itos


def default_out_dir(tokenizer):
    if tokenizer == "char":
        return DEFAULT_OUT_DIR
    return os.path.join("data", "shakespeare_gpt2")


def prepare_missing(data_dir, source=""):
    """Prepare data_dir and return True if it is one of this script's
    default folders and holds no dataset (train.py's quick start);
    else False. `source`: a URL or a local file ('' = the public tiny
    Shakespeare, sha256-checked)."""
    tokenizer = next((t for t in TOKENIZERS
                      if os.path.normpath(data_dir) == default_out_dir(t)),
                     None)
    if tokenizer is None and source:
        # ignored, the run would train on what data_dir holds: refuse
        folders = " or ".join(default_out_dir(t) for t in TOKENIZERS)
        raise UsageError(
            f"--data_source prepares {folders} while it is empty, not "
            f"--data_dir {data_dir}: prepare that with python "
            f"prepare_shakespeare.py --input ... --out_dir {data_dir}")
    if tokenizer is None or os.path.exists(
            os.path.join(data_dir, "meta.json")):
        return False
    is_url = not source or source.startswith(("http://", "https://"))
    print(f"{data_dir} holds no dataset yet: preparing tiny Shakespeare "
          f"({tokenizer}) from {source or DEFAULT_URL}")
    try:
        prepare(input_path=None if is_url else source, out_dir=data_dir,
                url=source or DEFAULT_URL, tokenizer=tokenizer)
    except DataError as exc:
        if not is_url:
            raise
        raise DataError(f"{exc} (offline? give a local copy of the text: "
                        "--data_source=/path/to/input.txt)") from exc
    return True


def prepare(input_path=None, out_dir=None, url=DEFAULT_URL,
            sha256=DEFAULT_SHA256, tokenizer="char"):
    """Build the dataset in ``out_dir``; return meta.json's dict.
    Without ``input_path`` the text is downloaded from ``url`` and
    checked against ``sha256``; an ``input_path`` is used as is (a
    different hash earns a note)."""
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {tokenizer!r}: expected one "
                        f"of {', '.join(TOKENIZERS)}")
    expected = _normalize_sha256(sha256)
    out_dir = out_dir or default_out_dir(tokenizer)
    names = ("input.txt", "train.bin", "val.bin", "meta.json")
    try:
        for name in remove_leftovers(out_dir, names):
            print(f"note: removed {name} in {out_dir}, left by a "
                  "preparation that was killed")
    except OSError as exc:
        raise DataError(f"could not write outputs to {out_dir}: {exc}") \
            from exc

    if input_path is None:
        source = url
        text_path = os.path.join(out_dir, "input.txt")
        download(url, text_path, sha256=expected)
    else:
        source = str(input_path)
        text_path = input_path

    text, digest = read_text(text_path)
    if input_path is not None and expected is not None and digest != expected:
        print(f"note: {input_path} is not the reference tiny Shakespeare "
              f"(sha256 {digest[:12]}..., expected {expected[:12]}...); "
              "using it anyway")

    # by position (docs/data.md), each side encoded alone
    n_chars = int(len(text) * TRAIN_FRACTION)
    halves = (text[:n_chars], text[n_chars:])
    if tokenizer == "char":
        itos = build_char_vocab(text, text_path)
        vocab = {"tokenizer": "char", "vocab_size": len(itos), "itos": itos}
        stoi = {ch: i for i, ch in enumerate(itos)}
        parts = [[stoi[ch] for ch in half] for half in halves]
    else:  # GPT-2 BPE
        vocab = BPE_META
        parts = [gpt2_encoding().encode_ordinary(half) for half in halves]
    train_ids, val_ids = (np.array(p, dtype=np.uint16) for p in parts)

    meta = {**vocab, "n_train": int(len(train_ids)),
            "n_val": int(len(val_ids)), "source": source, "sha256": digest}
    write_meta(meta, out_dir, [("train", train_ids), ("val", val_ids)])
    return meta


def main(argv=None):
    """Run ``prepare`` from the command line; an error is one line
    (status 2: a bad argument, else 1)."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--input", default=None,
        help="use this local text file instead of downloading")
    add("--out_dir", default=None,
        help="where to write train.bin, val.bin, meta.json (default: "
             f"{DEFAULT_OUT_DIR}, or data/shakespeare_gpt2 with "
             "--tokenizer gpt2)")
    add("--url", default=DEFAULT_URL,
        help="where to download the text from")
    add("--sha256", default=DEFAULT_SHA256,
        help="expected sha256 of the download; '' disables the check")
    add("--tokenizer", default="char", choices=TOKENIZERS,
        help="char: one id per character; gpt2: GPT-2 BPE through "
             f"tiktoken ({BPE_ENCODING}, vocab padded to {BPE_VOCAB_SIZE})")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or default_out_dir(args.tokenizer)
    try:  # a usage error's status, before anything is written
        try:
            _normalize_sha256(args.sha256)
        except DataError as exc:
            raise UsageError(f"--sha256: {exc}") from None
        check_arguments(
            (args.input is not None and args.input.strip() == "",
             "--input must name a file"),
            (args.out_dir is not None and args.out_dir.strip() == "",
             "--out_dir must not be empty"))
        check_writable(out_dir, "--out_dir", directory=True)
        meta = prepare(input_path=args.input, out_dir=args.out_dir,
                       url=args.url, sha256=args.sha256,
                       tokenizer=args.tokenizer)
    except UserError as exc:  # the one place it ends the process
        end_with(exc)

    print(f"vocab size:   {meta['vocab_size']:,}")
    print(f"train tokens: {meta['n_train']:,}")
    print(f"val tokens:   {meta['n_val']:,}")
    print(f"wrote train.bin, val.bin, meta.json to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
