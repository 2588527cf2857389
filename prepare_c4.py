"""Prepare English C4 (allenai/c4, "en") as GPT-2 BPE tokens for train.py, shard by shard.

In ``out_dir``:

* the downloaded shards, ``c4-train.00000-of-01024.json.gz`` ... (kept: a rerun needs no network);
* one token file per shard, ``train/c4-train.00000-of-01024.bin``, ``val/c4-validation.00000-of-00008.bin``:
  token ids as raw ``np.uint16`` (nothing to parse), every document followed by the end-of-text
  token 50256, so documents are joined by EOT;
* ``meta.json`` -- tokenizer, vocab_size, token and document counts, and the index
  ``token_files``: per split, in shard order, each file with its source shard (size, sha256), its
  documents, tokens, largest id and sha256. train.py reads a split as the concatenation of its
  files (``data.load_tokens``) and takes the sizes and the largest id from this record instead of
  reading 100 GB of tokens on every process at every start.

Usage::

    python prepare_c4.py                           # 1 train shard (roughly 150M tokens) + 1 val shard
    python prepare_c4.py --shards 8 --workers 16   # more data, more tokenizer processes

C4 comes as 1024 train and 8 validation shards of gzipped JSON lines ({"text", "timestamp",
"url"}). ``--shards N`` takes the first N train shards, ``--val_shards N`` the first N validation
shards.

Why the code looks the way it does:

1. Big downloads fail. Each shard is fetched by ``download.download``: resumed from its
   ``<name>.part`` with an HTTP ``Range`` request, retried with exponential backoff, and renamed
   to its name only when complete; a run that gives up keeps the ``.part`` for the next.
2. The shard is the unit of work. A worker process reads one whole shard: it decompresses it,
   checks every line (gzip intact, JSON with a "text" string), tokenises it into the shard's token
   file and hashes the shard on the way, all in one pass. The main process only downloads (the
   next shard while the workers tokenise the last ones), hands out shards and keeps the index, so
   the pool scales with the cores instead of waiting on one reader. A bad shard stops the run with
   one ``error:`` line naming it and is renamed to ``<name>.corrupt`` (kept for inspection, never
   read again), so rerunning downloads it afresh.
3. A killed run resumes where it was. meta.json is rewritten (temp + rename) after every finished
   shard, the shards still to do listed under ``unfinished`` (``data.read_meta`` refuses a dataset
   with any). A rerun keeps every shard whose entry matches its files' sizes (the shard's bytes,
   the token file's 2 bytes per token) and tokenises the others: ``--shards 351`` after
   ``--shards 350`` tokenises one shard. Sizes, not hashes: hashing 100 GB of shards on every rerun
   would take minutes; to redo a shard replaced by another of the very same size, delete its token file.
4. Never leave half-written output. Every file is written to a temp file and renamed; the temp
   files of a killed run (``.<name>.<random>.tmp``) are removed by the next run, so one
   preparation at a time per ``out_dir``.
5. The same output for any number of workers: a shard's file depends on the shard alone, and the
   index lists the shards in their order whichever finished first.

The vocabulary is GPT-2's 50257 tokens (tiktoken "r50k_base", the same ranks as "gpt2"). meta.json
says ``vocab_size`` 50304: padded up to a multiple of 64, as in nanoGPT, so the embedding and
LM-head matmuls get GPU-friendly shapes; ids 50257..50303 never occur in the data.
"""

import argparse
import concurrent.futures
import errno
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import sys
import time
import zlib

import numpy as np

from data import BPE_ENCODING, BPE_EOT, BPE_TOKENS, BPE_VOCAB_SIZE, DataError, gpt2_encoding, write_meta
from download import CHUNK_SIZE, DEFAULT_RETRIES, DEFAULT_RETRY_DELAY, DEFAULT_TIMEOUT, download
from errors import UsageError, end_with
from utils import atomic_write

DEFAULT_OUT_DIR = os.path.join("data", "c4")
DEFAULT_BASE_URL = "https://huggingface.co/datasets/allenai/c4/resolve/main"
N_TRAIN_SHARDS, N_VAL_SHARDS = 1024, 8
DOCS_PER_BATCH = 256       # documents tokenised and written at a time (~0.5 MB of C4 text)
SPLIT_DIRS = {"train": "train", "validation": "val"}
TEMP_FILE = re.compile(r"\..+\.(bin|json|json\.gz)\.\w+\.tmp")  # utils.atomic_write's temp names


def shard_names(split, n):
    """File names of the first ``n`` shards of ``split`` ('train' or 'validation')."""
    total = N_TRAIN_SHARDS if split == "train" else N_VAL_SHARDS
    if not 1 <= n <= total:
        raise DataError(f"number of {split} shards must be between 1 and {total}, got {n}")
    return [f"c4-{split}.{i:05d}-of-{total:05d}.json.gz" for i in range(n)]


def token_file(name):
    """The token file of shard ``name``, relative to out_dir: train/c4-train.00000-of-01024.bin."""
    split = name.split(".")[0].removeprefix("c4-")
    return f"{SPLIT_DIRS[split]}/{name.removesuffix('.json.gz')}.bin"


# ---------------------------------------------------------------------------
# in a worker process: read, check and tokenise one whole shard
# ---------------------------------------------------------------------------

class _HashingReader:
    """The shard's file as gzip reads it, hashing the bytes on their way: the shard's sha256
    comes with the one read the tokenising needs anyway."""

    def __init__(self, f):
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def read(self, n=-1):
        block = self.f.read(n)
        self.sha256.update(block)
        self.size += len(block)
        return block


def _corrupt(path, reason):
    """Move a bad shard out of the way (a rerun downloads it again) and describe it."""
    bad = path + ".corrupt"
    os.replace(path, bad)
    return DataError(f"{path} is corrupt ({reason}); moved it to {os.path.basename(bad)}, "
                     "rerun to download it again")


def iter_documents(path, raw):
    """Yield (text, bytes of its JSON line) for every line of the shard read from ``raw`` (its
    open file); a damaged shard raises DataError."""
    lineno = 0
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    doc = json.loads(line)
                except ValueError as exc:  # also a line that is not UTF-8
                    raise _corrupt(path, f"line {lineno} is not JSON: {exc}") from None
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    raise _corrupt(path, f'line {lineno} has no "text" string')
                yield doc["text"], len(line)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        what = "truncated" if isinstance(exc, EOFError) else "bad gzip data"
        raise _corrupt(path, f"{what} after line {lineno}: {exc}") from None
    except OSError as exc:  # a read error of the disk, not of the data: leave the file alone
        raise DataError(f"could not read {path}: {exc}") from exc
    if lineno == 0:
        raise _corrupt(path, "no documents")


def encode_batch(enc, texts):
    """GPT-2 ids of a list of documents, each followed by EOT, as one uint16 array.

    encode_ordinary: a document that contains the string "<|endoftext|>" gets it as plain
    text, so the only 50256s in the data are the separators we add.
    """
    ids = []
    for text in texts:
        ids.extend(enc.encode_ordinary(text))
        ids.append(BPE_EOT)
    return np.array(ids, dtype=np.uint16)


def tokenize_shard(path, out_path):
    """Decompress, check and tokenise the shard at ``path`` into ``out_path`` (temp + rename), in
    one pass. Returns (its index entry, seconds, bytes of JSON text read)."""
    t0 = time.perf_counter()
    enc = gpt2_encoding()  # tiktoken caches it per process after the first call
    entry = {"file": token_file(os.path.basename(path)), "shard": os.path.basename(path)}
    counts = {"n_docs": 0, "n_tokens": 0, "max_id": 0, "text_bytes": 0}
    token_sha = hashlib.sha256()

    def write(tmp):
        with open(path, "rb") as raw_file, open(tmp, "wb") as out:
            raw = _HashingReader(raw_file)
            batch = []
            for text, n_bytes in iter_documents(path, raw):
                batch.append(text)
                counts["n_docs"] += 1
                counts["text_bytes"] += n_bytes
                if len(batch) == DOCS_PER_BATCH:
                    _write_ids(out, encode_batch(enc, batch), counts, token_sha)
                    batch = []
            if batch:
                _write_ids(out, encode_batch(enc, batch), counts, token_sha)
            while raw.read(CHUNK_SIZE):  # whatever gzip left unread still belongs to the shard's hash
                pass
            entry["shard_bytes"], entry["shard_sha256"] = raw.size, raw.sha256.hexdigest()

    try:
        atomic_write(out_path, write)
    except FileNotFoundError as exc:
        if not os.path.exists(path):
            raise DataError(f"shard {path} not found") from None
        raise DataError(f"could not write {out_path}: {exc}") from None
    except OSError as exc:
        raise DataError(f"could not write {out_path}: {exc}") from None
    text_bytes = counts.pop("text_bytes")
    entry.update(counts, sha256=token_sha.hexdigest())
    return entry, time.perf_counter() - t0, text_bytes


def _write_ids(out, ids, counts, token_sha):
    block = ids.tobytes()
    out.write(block)
    token_sha.update(block)
    counts["n_tokens"] += len(ids)
    counts["max_id"] = max(counts["max_id"], int(ids.max()))


# ---------------------------------------------------------------------------
# in the main process: schedule the shards, keep the index
# ---------------------------------------------------------------------------

def check_out_dir(out_dir):
    """Make out_dir and prove it writable before any download: one DataError naming it otherwise."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        atomic_write(os.path.join(out_dir, ".write_test.json"), lambda tmp: None)
        os.remove(os.path.join(out_dir, ".write_test.json"))
    except OSError as exc:
        reason = {errno.EACCES: "permission denied: this user may not write there",
                  errno.EPERM: "permission denied: this user may not write there",
                  errno.ENOSPC: "the disk is full", errno.EROFS: "read-only file system",
                  errno.ENOTDIR: "it, or a folder on its path, is a file",
                  errno.EEXIST: "it, or a folder on its path, is a file"}.get(
                      exc.errno, exc.strerror or str(exc))
        raise DataError(f"cannot write the outputs to --out_dir {out_dir}: {reason} "
                        f"({exc.filename or out_dir})") from None


def remove_stale_temporaries(out_dir):
    """The temp files a killed run left (utils.atomic_write's names): never complete, never read."""
    for directory in [out_dir] + [os.path.join(out_dir, sub) for sub in SPLIT_DIRS.values()]:
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if TEMP_FILE.fullmatch(name):
                os.remove(os.path.join(directory, name))
                print(f"removed {os.path.join(directory, name)} (left by an interrupted run)")


def previous_index(out_dir):
    """{shard name: entry} of the token files meta.json lists (finished or not): {} if none."""
    path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except IsADirectoryError:
        raise DataError(f"{path} is a directory, not the dataset's meta.json; move it away") from None
    except (OSError, ValueError) as exc:
        print(f"{path} cannot be read ({exc}); every shard is tokenised again")
        return {}
    if (not isinstance(meta, dict) or meta.get("tokenizer") != BPE_ENCODING
            or not isinstance(meta.get("token_files"), dict)):
        return {}  # another tokenizer, or a train.bin/val.bin dataset of the old layout
    return {entry["shard"]: entry for files in meta["token_files"].values() for entry in files}


def is_finished(out_dir, name, entry):
    """The shard's entry matches its files' sizes (see 3. above)."""
    if entry is None or entry.get("file") != token_file(name):
        return False
    shard, tokens = os.path.join(out_dir, name), os.path.join(out_dir, entry["file"])
    return (os.path.isfile(shard) and os.path.getsize(shard) == entry.get("shard_bytes")
            and os.path.isfile(tokens) and os.path.getsize(tokens) == 2 * entry.get("n_tokens", -1))


def make_meta(splits, done, source):
    """meta.json's dict for these shards, the finished ones in ``done`` ({name: entry})."""
    files = {split: [done[n] for n in names if n in done] for split, names in splits.items()}
    meta = {
        "tokenizer": BPE_ENCODING,
        "vocab_size": BPE_VOCAB_SIZE,
        "tokenizer_vocab_size": BPE_TOKENS,
        "eot_token": BPE_EOT,
        "dtype": "uint16",
        "n_train": sum(e["n_tokens"] for e in files["train"]),
        "n_val": sum(e["n_tokens"] for e in files["val"]),
        "n_train_docs": sum(e["n_docs"] for e in files["train"]),
        "n_val_docs": sum(e["n_docs"] for e in files["val"]),
        "source": source,
        "train_shards": splits["train"],
        "val_shards": splits["val"],
        "shard_sha256": {e["shard"]: e["shard_sha256"] for split in ("train", "val") for e in files[split]},
        "token_files": files,
    }
    unfinished = [n for names in splits.values() for n in names if n not in done]
    if unfinished:
        meta["unfinished"] = unfinished
    return meta


def write_index(out_dir, meta):
    write_meta(meta, out_dir)
    for old in ("train.bin", "val.bin"):  # the single-file layout this index replaces
        if os.path.exists(os.path.join(out_dir, old)):
            os.remove(os.path.join(out_dir, old))
            print(f"removed {os.path.join(out_dir, old)}: the old single-file layout, "
                  "replaced by per-shard files")


def shards_from_text(text_path, paths, train, val):
    """Offline stand-in for the download: cut a plain-text file into "documents" at blank lines
    (tiny Shakespeare: one speech each), every 10th to validation, and deal them round-robin into
    shards with the real C4 names and line format, so checking and tokenising run unchanged.
    Shards already there are kept. The gzip header carries no time and a fixed name, so the same
    text gives the same shard bytes (and meta.json the same shard_sha256) on every run."""
    try:
        with open(text_path, encoding="utf-8") as f:
            docs = [d.strip("\n") for d in re.split(r"\n\s*\n", f.read()) if d.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read --from_text {text_path}: {exc}") from None
    split_docs = {"train": [d for i, d in enumerate(docs) if i % 10 != 9], "val": docs[9::10]}
    for split, names in (("train", train), ("val", val)):
        if len(split_docs[split]) < len(names):
            raise DataError(f"--from_text {text_path} has {len(docs)} paragraphs: "
                            f"too few for {len(names)} {split} shards")
        for k, name in enumerate(names):
            if os.path.exists(paths[name]):
                continue
            url = f"file://{os.path.abspath(text_path)}"
            lines = "".join(json.dumps({"text": d, "timestamp": "", "url": url}) + "\n"
                            for d in split_docs[split][k::len(names)])

            def write(tmp, lines=lines, name=name):
                with open(tmp, "wb") as raw, \
                        gzip.GzipFile(name.removesuffix(".gz"), "wb", fileobj=raw, mtime=0) as f:
                    f.write(lines.encode("utf-8"))
            atomic_write(paths[name], write)


def prepare(shards=1, val_shards=1, out_dir=DEFAULT_OUT_DIR, base_url=DEFAULT_BASE_URL,
            workers=None, retries=DEFAULT_RETRIES, retry_delay=DEFAULT_RETRY_DELAY,
            timeout=DEFAULT_TIMEOUT, from_text=None):
    """Download, check and tokenise the shards not yet tokenised; keep meta.json's index; return
    the meta dict. A rerun with nothing to do rewrites nothing."""
    splits = {"train": shard_names("train", shards), "val": shard_names("validation", val_shards)}
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise DataError(f"workers must be at least 1, got {workers}")
    if retries < 0:
        raise DataError(f"retries must be at least 0, got {retries}")
    gpt2_encoding()  # fail now, not after an hour of downloads
    base_url = base_url.rstrip("/")
    names = splits["train"] + splits["val"]
    paths = {name: os.path.join(out_dir, name) for name in names}
    source = (f"file://{os.path.abspath(from_text)} (C4-format shards made from a text file)" if from_text
              else f"{base_url}/en")

    check_out_dir(out_dir)
    remove_stale_temporaries(out_dir)
    if from_text:
        shards_from_text(from_text, paths, splits["train"], splits["val"])
    old = previous_index(out_dir)
    done = {name: old[name] for name in names if is_finished(out_dir, name, old.get(name))}
    todo = [name for name in names if name not in done]
    meta = make_meta(splits, done, source)
    if not todo:  # nothing to tokenise: at most the index changes (fewer shards asked for, another source)
        try:
            with open(os.path.join(out_dir, "meta.json"), encoding="utf-8") as f:
                up_to_date = json.load(f) == meta
        except (OSError, ValueError):
            up_to_date = False
        if up_to_date:
            print(f"{out_dir}: meta.json and the token files are up to date for these shards")
        else:
            write_index(out_dir, meta)
        return meta
    # The index is first written when a shard is finished: until then the old meta.json still
    # describes files that are all there.
    print(f"{len(done)} of {len(names)} shards already tokenised, {len(todo)} to do ({workers} worker(s))")

    # spawn, not fork: forking a process that runs threads (tqdm's monitor, an HTTP client) can
    # deadlock, and spawn behaves the same on Linux, macOS and Windows.
    spawn = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), spawn) \
        if workers > 1 and len(todo) > 1 else None
    pending, t0, text_bytes = {}, time.perf_counter(), 0

    def record(name, result):
        nonlocal meta, text_bytes
        entry, seconds, n_bytes = result
        done[name] = entry
        text_bytes += n_bytes
        meta = make_meta(splits, done, source)
        write_index(out_dir, meta)
        print(f"[{len(done)}/{len(names)}] tokenised {name}: {entry['n_docs']:,} documents, "
              f"{entry['n_tokens']:,} tokens, {n_bytes / 1e6:.1f} MB of JSON in {seconds:.1f}s")

    def collect(block):
        """Record the shards finished so far (all of them if block); a worker's error is raised."""
        finished, _ = concurrent.futures.wait(pending, timeout=None if block else 0)
        for future in sorted(finished, key=lambda fut: names.index(pending[fut])):
            name = pending.pop(future)
            try:
                result = future.result()
            except concurrent.futures.process.BrokenProcessPool:
                raise DataError(f"a tokenizer process died while working on {name} (out of memory? killed?); "
                                "rerun to resume") from None
            record(name, result)

    try:
        for i, name in enumerate(todo, 1):
            if not from_text:
                if download(f"{base_url}/en/{name}", paths[name], retries, retry_delay, timeout):
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
        if pool is not None:  # the shards in work finish and are recorded, the queued ones are dropped
            pool.shutdown(wait=True, cancel_futures=True)
            for future, name in list(pending.items()):
                if future.done() and not future.cancelled() and future.exception() is None:
                    record(name, future.result())
            pool = None
        raise
    finally:
        if pool is not None:
            pool.shutdown()
    seconds = time.perf_counter() - t0
    if todo:
        print(f"tokenised {len(todo)} shard(s): {text_bytes / 1e6:.1f} MB of JSON in {seconds:.1f}s "
              f"({text_bytes / 1e6 / seconds:.1f} MB/s)")
    return meta


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, the usage error's status (argparse's own prints the usage too)
        end_with(UsageError(message))


def main(argv=None):
    """Parse arguments, run ``prepare`` and print a summary.

    A bad argument is one ``error: ...`` line and exit status 2; a problem with the data, the
    output folder or the network one ``error: ...`` line and status 1, never a traceback.
    """
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=1,
                        help=f"number of train shards, the first N of {N_TRAIN_SHARDS} (default: 1)")
    parser.add_argument("--val_shards", type=int, default=1,
                        help=f"number of validation shards, of {N_VAL_SHARDS} (default: 1)")
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL,
                        help="the dataset root; shards are fetched from BASE_URL/en/NAME")
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR,
                        help=f"shards, token files, meta.json go here (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes, one shard each at a time; "
                             "1: tokenise in this process (default: all CPUs)")
    parser.add_argument("--retries", type=int, default=DEFAULT_RETRIES,
                        help=f"retries per shard after a network error (default: {DEFAULT_RETRIES})")
    parser.add_argument("--retry_delay", type=float, default=DEFAULT_RETRY_DELAY,
                        help="seconds before the first retry, doubled every retry "
                             f"(default: {DEFAULT_RETRY_DELAY})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds to wait for the server before retrying (default: {DEFAULT_TIMEOUT})")
    parser.add_argument("--from_text", default=None, metavar="PATH",
                        help="no download: make C4-format shards from a plain-text file's paragraphs "
                             "(e.g. tiny Shakespeare, for config/c4_tiny.py on a machine without C4)")
    args = parser.parse_args(argv)
    for wrong, message in (
            (not 1 <= args.shards <= N_TRAIN_SHARDS,
             f"--shards must be between 1 and {N_TRAIN_SHARDS}, got {args.shards}"),
            (not 1 <= args.val_shards <= N_VAL_SHARDS,
             f"--val_shards must be between 1 and {N_VAL_SHARDS}, got {args.val_shards}"),
            (args.workers < 1, f"--workers must be at least 1, got {args.workers}"),
            (args.retries < 0, f"--retries must be at least 0, got {args.retries}"),
            (not 0 <= args.retry_delay < float("inf"),
             f"--retry_delay must be a number of seconds >= 0, got {args.retry_delay}"),
            (not 0 < args.timeout < float("inf"),
             f"--timeout must be a number of seconds > 0, got {args.timeout}"),
            (not re.match(r"https?://[^/\s]+", args.base_url),
             f"--base_url must be an http:// or https:// address, got {args.base_url!r}")):
        if wrong:
            parser.error(message)

    try:
        meta = prepare(shards=args.shards, val_shards=args.val_shards, out_dir=args.out_dir,
                       base_url=args.base_url, workers=args.workers, retries=args.retries,
                       retry_delay=args.retry_delay, timeout=args.timeout, from_text=args.from_text)
    except DataError as exc:  # (a UserError) the one place it ends the process
        end_with(exc)

    print(f"vocab size:   {meta['vocab_size']:,} ({BPE_ENCODING}, {BPE_TOKENS:,} padded)")
    print(f"train tokens: {meta['n_train']:,} ({meta['n_train_docs']:,} documents, "
          f"{len(meta['train_shards'])} file(s))")
    print(f"val tokens:   {meta['n_val']:,} ({meta['n_val_docs']:,} documents, "
          f"{len(meta['val_shards'])} file(s))")
    print(f"wrote train/, val/, meta.json to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
