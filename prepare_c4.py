"""Prepare English C4 (allenai/c4, "en") as GPT-2 BPE tokens for
train.py, shard by shard.

In ``out_dir``: the downloaded shards, one uint16 token file per shard
(``train/``, ``val/``) and ``meta.json``, their index.

Usage::

    python prepare_c4.py                          # 1 train + 1 val shard
    python prepare_c4.py --shards 8 --workers 16  # more data, more workers

A killed run resumes at the shard it was on; ``--shards 351`` after
``--shards 350`` tokenises one shard. One preparation at a time per
``out_dir``.

Design notes: docs/data.md
"""

import concurrent.futures
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
import zlib

import numpy as np

from data import (BPE_ENCODING, BPE_EOT, BPE_META, BPE_TOKENS, DataError,
                  gpt2_encoding, write_meta)
from download import (CHUNK_SIZE, DEFAULT_RETRIES, DEFAULT_RETRY_DELAY,
                      DEFAULT_TIMEOUT, download)
from errors import ArgumentParser, UserError, end_with
from utils import (atomic_write, check_arguments, check_writable,
                   remove_leftovers)

DEFAULT_OUT_DIR = os.path.join("data", "c4")
DEFAULT_BASE_URL = "https://huggingface.co/datasets/allenai/c4/resolve/main"
N_TRAIN_SHARDS = 1024
N_VAL_SHARDS = 8
DOCS_PER_BATCH = 256  # tokenised and written at a time (~0.5 MB of text)
SPLIT_DIRS = {"train": "train", "validation": "val"}


def shard_names(split, n):
    """The first ``n`` shards' names of ``split`` (train, validation)."""
    total = N_TRAIN_SHARDS if split == "train" else N_VAL_SHARDS
    if not 1 <= n <= total:
        raise DataError(f"number of {split} shards must be between 1 and "
                        f"{total}, got {n}")
    return [f"c4-{split}.{i:05d}-of-{total:05d}.json.gz" for i in range(n)]


def token_file(name):
    """Shard ``name``'s token file, relative to out_dir:
    train/c4-train.00000-of-01024.bin."""
    split = name.split(".")[0].removeprefix("c4-")
    return f"{SPLIT_DIRS[split]}/{name.removesuffix('.json.gz')}.bin"


# in a worker process: read, check and tokenise one whole shard

class _HashingReader:
    """The shard's file as gzip reads it, hashed on the way."""

    def __init__(self, f):
        self.f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def read(self, n=-1):
        block = self.f.read(n)
        self.sha256.update(block)
        self.size += len(block)
        return block


def _corrupt(path, reason):
    """Move a bad shard away (a rerun downloads it again); say so."""
    bad = path + ".corrupt"
    os.replace(path, bad)
    return DataError(f"{path} is corrupt ({reason}); moved it to "
                     f"{os.path.basename(bad)}, rerun to download it again")


def iter_documents(path, raw):
    """Yield (text, bytes of its JSON line) for every line of the shard
    read from ``raw`` (its open file); a damaged shard: DataError."""
    lineno = 0
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    doc = json.loads(line)
                except ValueError as exc:  # also a line that is not UTF-8
                    raise _corrupt(path, f"line {lineno} is not JSON: "
                                         f"{exc}") from None
                if (not isinstance(doc, dict)
                        or not isinstance(doc.get("text"), str)):
                    raise _corrupt(path, f'line {lineno} has no "text" '
                                         'string')
                yield doc["text"], len(line)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        what = "truncated" if isinstance(exc, EOFError) else "bad gzip data"
        raise _corrupt(path, f"{what} after line {lineno}: {exc}") from None
    except OSError as exc:  # the disk's read error, not the data's: keep it
        raise DataError(f"could not read {path}: {exc}") from exc
    if lineno == 0:
        raise _corrupt(path, "no documents")


def encode_batch(enc, texts):
    """GPT-2 ids of documents, each followed by EOT, as one uint16
    array; a document's own "<|endoftext|>" is plain text."""
    ids = []
    for text in texts:
        ids.extend(enc.encode_ordinary(text))
        ids.append(BPE_EOT)
    return np.array(ids, dtype=np.uint16)


def tokenize_shard(path, out_path):
    """Decompress, check and tokenise the shard at ``path`` into
    ``out_path``, in one pass. Returns (its index entry, seconds,
    bytes of JSON text read)."""
    t0 = time.perf_counter()
    enc = gpt2_encoding()  # tiktoken caches it per process
    name = os.path.basename(path)
    entry = {"file": token_file(name), "shard": name}
    counts = {"n_docs": 0, "n_tokens": 0, "max_id": 0, "text_bytes": 0}
    token_sha = hashlib.sha256()

    def write_ids(out, ids):
        block = ids.tobytes()
        out.write(block)
        token_sha.update(block)
        counts["n_tokens"] += len(ids)
        counts["max_id"] = max(counts["max_id"], int(ids.max()))

    def write(tmp):
        with open(path, "rb") as raw_file, open(tmp, "wb") as out:
            raw = _HashingReader(raw_file)
            docs = iter_documents(path, raw)
            while batch := list(itertools.islice(docs, DOCS_PER_BATCH)):
                counts["n_docs"] += len(batch)
                counts["text_bytes"] += sum(n for _, n in batch)
                write_ids(out, encode_batch(enc, [t for t, _ in batch]))
            # what gzip left unread still belongs to the shard's hash
            while raw.read(CHUNK_SIZE):
                pass
            entry["shard_bytes"] = raw.size
            entry["shard_sha256"] = raw.sha256.hexdigest()

    try:
        atomic_write(out_path, write)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not os.path.exists(path):
            raise DataError(f"shard {path} not found") from None
        raise DataError(f"could not write {out_path}: {exc}") from None
    text_bytes = counts.pop("text_bytes")
    entry.update(counts, sha256=token_sha.hexdigest())
    return entry, time.perf_counter() - t0, text_bytes


# in the main process: schedule the shards, keep the index

def remove_stale_temporaries(out_dir):
    """Remove the temp files a killed run left (of any shard)."""
    shards = (shard_names("train", N_TRAIN_SHARDS)
              + shard_names("validation", N_VAL_SHARDS))
    names = ["meta.json", *shards]
    names += [os.path.basename(token_file(name)) for name in shards]
    for sub in ("", *SPLIT_DIRS.values()):
        directory = os.path.join(out_dir, sub)
        for name in remove_leftovers(directory, names):
            path = os.path.join(directory, name)
            print(f"removed {path} (left by an interrupted run)")


def previous_meta(out_dir):
    """The meta.json of a per-shard C4 dataset in out_dir (finished or
    not): {} if none."""
    path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except IsADirectoryError:
        raise DataError(f"{path} is a directory, not the dataset's "
                        "meta.json; move it away") from None
    except (OSError, ValueError) as exc:
        print(f"{path} cannot be read ({exc}); "
              "every shard is tokenised again")
        return {}
    if (not isinstance(meta, dict) or meta.get("tokenizer") != BPE_ENCODING
            or not isinstance(meta.get("token_files"), dict)):
        return {}  # another tokenizer, or the old train.bin layout
    return meta


def is_finished(out_dir, name, entry):
    """The shard's entry matches its files' sizes (hashes would take
    minutes over 100 GB)."""
    if entry is None or entry.get("file") != token_file(name):
        return False
    shard = os.path.join(out_dir, name)
    tokens = os.path.join(out_dir, entry["file"])
    return (os.path.isfile(shard)
            and os.path.getsize(shard) == entry.get("shard_bytes")
            and os.path.isfile(tokens)
            and os.path.getsize(tokens) == 2 * entry.get("n_tokens", -1))


def make_meta(splits, done, source):
    """meta.json's dict for these shards, the finished ones in ``done``
    ({name: entry})."""
    files = {split: [done[n] for n in names if n in done]
             for split, names in splits.items()}
    entries = files["train"] + files["val"]
    meta = {
        **BPE_META,
        "dtype": "uint16",
        **{f"n_{split}": sum(e["n_tokens"] for e in files[split])
           for split in files},
        **{f"n_{split}_docs": sum(e["n_docs"] for e in files[split])
           for split in files},
        "source": source,
        "train_shards": splits["train"],
        "val_shards": splits["val"],
        "shard_sha256": {e["shard"]: e["shard_sha256"] for e in entries},
        "token_files": files,
    }
    unfinished = [n for names in splits.values() for n in names
                  if n not in done]
    if unfinished:
        meta["unfinished"] = unfinished
    return meta


def write_index(out_dir, meta):
    write_meta(meta, out_dir)
    for old in ("train.bin", "val.bin"):  # the layout this index replaces
        path = os.path.join(out_dir, old)
        if os.path.exists(path):
            os.remove(path)
            print(f"removed {path}: the old single-file layout, "
                  "replaced by per-shard files")


def shards_from_text(text_path, paths, train, val):
    """Offline stand-in for the download: a plain-text file's
    paragraphs as documents in shards of C4's names and format;
    shards already there are kept."""
    try:
        with open(text_path, encoding="utf-8") as f:
            docs = [d.strip("\n") for d in re.split(r"\n\s*\n", f.read())
                    if d.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read --from_text {text_path}: {exc}") \
            from None
    split_docs = {"train": [d for i, d in enumerate(docs) if i % 10 != 9],
                  "val": docs[9::10]}
    url = f"file://{os.path.abspath(text_path)}"
    for split, names in (("train", train), ("val", val)):
        if len(split_docs[split]) < len(names):
            raise DataError(f"--from_text {text_path} has {len(docs)} "
                            f"paragraphs: too few for {len(names)} {split} "
                            "shards")
        for k, name in enumerate(names):
            if os.path.exists(paths[name]):
                continue
            lines = "".join(
                json.dumps({"text": d, "timestamp": "", "url": url}) + "\n"
                for d in split_docs[split][k::len(names)])

            def write(tmp, lines=lines, name=name):
                # no time and a fixed name in the gzip header
                with open(tmp, "wb") as raw, gzip.GzipFile(
                        name.removesuffix(".gz"), "wb", fileobj=raw,
                        mtime=0) as f:
                    f.write(lines.encode("utf-8"))
            atomic_write(paths[name], write)


def prepare(shards=1, val_shards=1, out_dir=DEFAULT_OUT_DIR,
            base_url=DEFAULT_BASE_URL, workers=None, retries=DEFAULT_RETRIES,
            retry_delay=DEFAULT_RETRY_DELAY, timeout=DEFAULT_TIMEOUT,
            from_text=None):
    """Download, check and tokenise the shards not yet tokenised; keep
    meta.json's index; return the meta dict."""
    splits = {"train": shard_names("train", shards),
              "val": shard_names("validation", val_shards)}
    workers = (os.cpu_count() or 1) if workers is None else workers
    gpt2_encoding()  # fail now, not after an hour of downloads
    base_url = base_url.rstrip("/")
    names = splits["train"] + splits["val"]
    paths = {name: os.path.join(out_dir, name) for name in names}
    if from_text:
        source = (f"file://{os.path.abspath(from_text)} "
                  "(C4-format shards made from a text file)")
    else:
        source = f"{base_url}/en"

    # before any download: one line naming out_dir
    check_writable(out_dir, "--out_dir", directory=True)
    remove_stale_temporaries(out_dir)
    if from_text:
        shards_from_text(from_text, paths, splits["train"], splits["val"])
    old_meta = previous_meta(out_dir)
    old = {entry["shard"]: entry
           for files in old_meta.get("token_files", {}).values()
           for entry in files}
    done = {name: old[name] for name in names
            if is_finished(out_dir, name, old.get(name))}
    todo = [name for name in names if name not in done]
    meta = make_meta(splits, done, source)
    if not todo:  # at most the index changes (fewer shards, another source)
        if old_meta == meta:
            print(f"{out_dir}: meta.json and the token files are up to "
                  "date for these shards")
        else:
            write_index(out_dir, meta)
        return meta
    print(f"{len(done)} of {len(names)} shards already tokenised, "
          f"{len(todo)} to do ({workers} worker(s))")

    # spawn: forking a process that runs threads can deadlock
    pool = None
    if workers > 1 and len(todo) > 1:
        pool = concurrent.futures.ProcessPoolExecutor(
            min(workers, len(todo)), multiprocessing.get_context("spawn"))
    pending = {}
    t0 = time.perf_counter()
    text_bytes = 0

    def record(name, result):
        nonlocal meta, text_bytes
        entry, seconds, n_bytes = result
        done[name] = entry
        text_bytes += n_bytes
        meta = make_meta(splits, done, source)
        write_index(out_dir, meta)
        print(f"[{len(done)}/{len(names)}] tokenised {name}: "
              f"{entry['n_docs']:,} documents, {entry['n_tokens']:,} "
              f"tokens, {n_bytes / 1e6:.1f} MB of JSON in {seconds:.1f}s")

    def collect(block):
        """Record the shards finished so far (all of them if block); a
        worker's error is raised."""
        timeout = None if block else 0
        finished, _ = concurrent.futures.wait(pending, timeout=timeout)
        for future in sorted(finished, key=lambda f: names.index(pending[f])):
            name = pending.pop(future)
            try:
                result = future.result()
            except concurrent.futures.process.BrokenProcessPool:
                raise DataError(
                    f"a tokenizer process died while working on {name} "
                    "(out of memory? killed?); rerun to resume") from None
            record(name, result)

    try:
        for i, name in enumerate(todo, 1):
            url = f"{base_url}/en/{name}"
            if not from_text and download(url, paths[name], retries,
                                          retry_delay, timeout):
                print(f"[{i}/{len(todo)}] downloaded {name}")
            task = (paths[name], os.path.join(out_dir, token_file(name)))
            if pool is None:
                record(name, tokenize_shard(*task))
            else:
                pending[pool.submit(tokenize_shard, *task)] = name
                collect(block=False)
        while pending:
            collect(block=True)
    except BaseException:
        if pool is not None:
            # the shards in work finish and are recorded, the queued
            # ones are dropped
            pool.shutdown(wait=True, cancel_futures=True)
            for future, name in list(pending.items()):
                if (future.done() and not future.cancelled()
                        and future.exception() is None):
                    record(name, future.result())
            pool = None
        raise
    finally:
        if pool is not None:
            pool.shutdown()
    seconds = time.perf_counter() - t0
    print(f"tokenised {len(todo)} shard(s): {text_bytes / 1e6:.1f} MB of "
          f"JSON in {seconds:.1f}s ({text_bytes / 1e6 / seconds:.1f} MB/s)")
    return meta


# command line

def main(argv=None):
    """Run ``prepare`` from the command line; an error is one line
    (status 2: a bad argument, else 1)."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--shards", type=int, default=1,
        help=f"number of train shards, the first N of {N_TRAIN_SHARDS} "
             "(default: 1)")
    add("--val_shards", type=int, default=1,
        help=f"number of validation shards, of {N_VAL_SHARDS} (default: 1)")
    add("--base_url", default=DEFAULT_BASE_URL,
        help="the dataset root; shards are fetched from BASE_URL/en/NAME")
    add("--out_dir", default=DEFAULT_OUT_DIR,
        help="shards, token files, meta.json go here "
             f"(default: {DEFAULT_OUT_DIR})")
    add("--workers", type=int, default=os.cpu_count() or 1,
        help="tokenizer processes, one shard each at a time; "
             "1: tokenise in this process (default: all CPUs)")
    add("--retries", type=int, default=DEFAULT_RETRIES,
        help="retries per shard after a network error "
             f"(default: {DEFAULT_RETRIES})")
    add("--retry_delay", type=float, default=DEFAULT_RETRY_DELAY,
        help="seconds before the first retry, doubled every retry "
             f"(default: {DEFAULT_RETRY_DELAY})")
    add("--timeout", type=float, default=DEFAULT_TIMEOUT,
        help="seconds to wait for the server before retrying "
             f"(default: {DEFAULT_TIMEOUT})")
    add("--from_text", default=None, metavar="PATH",
        help="no download: make C4-format shards from a plain-text "
             "file's paragraphs (e.g. tiny Shakespeare, for "
             "config/c4_tiny.py on a machine without C4)")
    args = parser.parse_args(argv)
    inf = float("inf")
    try:
        check_arguments(
            (not 1 <= args.shards <= N_TRAIN_SHARDS,
             f"--shards must be between 1 and {N_TRAIN_SHARDS}, "
             f"got {args.shards}"),
            (not 1 <= args.val_shards <= N_VAL_SHARDS,
             f"--val_shards must be between 1 and {N_VAL_SHARDS}, "
             f"got {args.val_shards}"),
            (args.workers < 1,
             f"--workers must be at least 1, got {args.workers}"),
            (args.retries < 0,
             f"--retries must be at least 0, got {args.retries}"),
            (not 0 <= args.retry_delay < inf,
             "--retry_delay must be a number of seconds >= 0, "
             f"got {args.retry_delay}"),
            (not 0 < args.timeout < inf,
             f"--timeout must be a number of seconds > 0, got {args.timeout}"),
            (not re.match(r"https?://[^/\s]+", args.base_url),
             "--base_url must be an http:// or https:// address, "
             f"got {args.base_url!r}"))
        meta = prepare(**vars(args))  # its options are prepare's keywords
    except UserError as exc:  # the one place it ends the process
        end_with(exc)

    print(f"vocab size:   {meta['vocab_size']:,} "
          f"({BPE_ENCODING}, {BPE_TOKENS:,} padded)")
    for split in ("train", "val"):
        print(f"{split + ' tokens:':13} {meta[f'n_{split}']:,} "
              f"({meta[f'n_{split}_docs']:,} documents, "
              f"{len(meta[f'{split}_shards'])} file(s))")
    print(f"wrote train/, val/, meta.json to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
