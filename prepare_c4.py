"""Prepare English C4 (allenai/c4, "en") as GPT-2 BPE tokens for train.py.

The result is the same three files that prepare_shakespeare.py writes, in ``out_dir``:

* ``train.bin`` / ``val.bin`` -- token ids as raw ``np.uint16`` arrays (nothing to parse);
  every document is followed by the end-of-text token 50256, so documents are joined by EOT;
* ``meta.json`` -- tokenizer, vocab_size, token and document counts, the shards used and sha256
  of every shard and of both bins, so a run can be audited and reproduced.

Usage::

    python prepare_c4.py                           # 1 train shard (roughly 150M tokens) + 1 val shard
    python prepare_c4.py --shards 8 --workers 16   # more data, more tokenizer processes

C4 comes as 1024 train and 8 validation shards of gzipped JSON lines ({"text", "timestamp",
"url"}). ``--shards N`` takes the first N train shards, ``--val_shards N`` the first N validation
shards. The shards are kept next to the outputs, so a rerun needs no network; a rerun whose shards
are unchanged (same sha256) finds meta.json up to date and rewrites nothing.

Why the code looks the way it does:

1. Big downloads fail. Each shard streams into ``<name>.part``; if that file exists, the next
   attempt asks the server only for the missing bytes (HTTP ``Range``). Connection errors, 5xx
   answers and transfers cut short are retried with exponential backoff, and a run that gives up
   keeps the ``.part`` so the next run resumes. Only a complete shard is renamed to its name.
2. A corrupt shard must not become a silently short dataset. Every shard is decompressed and
   parsed (gzip intact, every line JSON with a "text" string) *before* anything is tokenised. A
   bad one stops the run with one ``error:`` line naming it and is renamed to ``<name>.corrupt``
   (kept for inspection, never read again), so rerunning downloads it afresh.
3. Never leave half-written output. Bins and meta.json are written to a temp file and renamed
   (``data.write_tokens``, ``data.write_meta``). meta.json is removed first and written last:
   when it exists, the bins next to it are complete and are the ones it describes.
4. Tokenising is the slow part (minutes of CPU per train shard), so batches of documents go to
   a pool of processes; results are taken back in submission order, so the output is the same
   for any number of workers.

The vocabulary is GPT-2's 50257 tokens (tiktoken "r50k_base", the same ranks as "gpt2"). meta.json
says ``vocab_size`` 50304: padded up to a multiple of 64, as in nanoGPT, so the embedding and
LM-head matmuls get GPU-friendly shapes; ids 50257..50303 never occur in the data.
"""

import argparse
import collections
import gzip
import json
import multiprocessing
import os
import re
import sys
import time
import zlib

import numpy as np
import requests
import urllib3
from tqdm import tqdm

from data import BPE_ENCODING, BPE_EOT, BPE_TOKENS, BPE_VOCAB_SIZE, DataError, gpt2_encoding, read_meta, \
    sha256_of_file, write_meta, write_tokens
from utils import atomic_write

DEFAULT_OUT_DIR = os.path.join("data", "c4")
DEFAULT_BASE_URL = "https://huggingface.co/datasets/allenai/c4/resolve/main"
N_TRAIN_SHARDS, N_VAL_SHARDS = 1024, 8
DOCS_PER_BATCH = 256       # documents per task sent to a tokenizer process (~0.5 MB of C4 text)
CHUNK_SIZE = 1 << 20       # download block
DEFAULT_RETRIES = 5
DEFAULT_RETRY_DELAY = 2.0  # seconds before the first retry; doubles every retry
MAX_RETRY_DELAY = 60.0
DEFAULT_TIMEOUT = 60.0     # seconds to connect, and at most between two received blocks


class _Retryable(Exception):
    """A download failure that may well go away if we try again."""


def shard_names(split, n):
    """File names of the first ``n`` shards of ``split`` ('train' or 'validation')."""
    total = N_TRAIN_SHARDS if split == "train" else N_VAL_SHARDS
    if not 1 <= n <= total:
        raise DataError(f"number of {split} shards must be between 1 and {total}, got {n}")
    return [f"c4-{split}.{i:05d}-of-{total:05d}.json.gz" for i in range(n)]


# ---------------------------------------------------------------------------
# step 1: download, resumably
# ---------------------------------------------------------------------------

def _parse_content_range(value):
    """'bytes START-END/TOTAL' -> (START, TOTAL); 'bytes */TOTAL' -> (None, TOTAL)."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+)\s*", value or "")
    if m is None:
        return None, None
    return (int(m.group(1)) if m.group(1) is not None else None), int(m.group(2))


def _fetch_into(url, part, timeout):
    """One attempt: bring ``part`` up to the full file. Raises _Retryable or DataError."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    # identity: we want the file's own bytes, never a server-side re-compression of them.
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    name = os.path.basename(part).removesuffix(".part")
    try:
        with requests.get(url, headers=headers, stream=True, timeout=timeout) as resp:
            status = resp.status_code
            if status == 416 and have:  # nothing left to send: is the .part already complete?
                if _parse_content_range(resp.headers.get("Content-Range"))[1] == have:
                    return
                os.remove(part)
                raise _Retryable(f"server refused to resume at byte {have:,}; starting over")
            if status == 429 or status >= 500:
                raise _Retryable(f"HTTP {status} {resp.reason}")
            if status >= 400 or status not in (200, 206):
                raise DataError(f"download of {url} failed: HTTP {status} {resp.reason}")
            if status == 206:
                start, total = _parse_content_range(resp.headers.get("Content-Range"))
                if start != have or total is None:
                    os.remove(part)
                    raise _Retryable("server resumed at the wrong offset; starting over")
                mode = "ab"
            else:  # 200: the whole file, whether or not we asked for a range
                if have:
                    print(f"{name}: server ignored the resume request, starting over")
                have, mode = 0, "wb"
                length = resp.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
            with open(part, mode) as f, tqdm(total=total, initial=have, unit="B", unit_scale=True,
                                             unit_divisor=1024, desc=name, leave=False) as bar:
                # raw.stream: the bytes as sent (no transparent decoding), block by block.
                for chunk in resp.raw.stream(CHUNK_SIZE, decode_content=False):
                    f.write(chunk)
                    have += len(chunk)
                    bar.update(len(chunk))
            if total is not None and have != total:
                raise _Retryable(f"connection closed after {have:,} of {total:,} bytes")
    except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.HTTPError) as exc:
        raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
    except requests.RequestException as exc:  # bad URL and the like: retrying will not help
        raise DataError(f"download of {url} failed: {exc}") from exc
    except OSError as exc:
        raise DataError(f"could not write {part}: {exc}") from exc


def download(url, dest_path, retries=DEFAULT_RETRIES, retry_delay=DEFAULT_RETRY_DELAY,
             timeout=DEFAULT_TIMEOUT):
    """Download ``url`` to ``dest_path`` unless that file exists; returns True if it downloaded.

    Bytes go to ``dest_path + '.part'`` (resumed with a Range request if it exists) and are
    renamed to ``dest_path`` only when complete. Up to ``retries`` retries, waiting
    ``retry_delay * 2**k`` seconds (at most MAX_RETRY_DELAY) before retry k+1.
    """
    if os.path.isfile(dest_path):
        return False
    os.makedirs(os.path.dirname(dest_path) or ".", exist_ok=True)
    part = dest_path + ".part"
    for attempt in range(retries + 1):
        try:
            _fetch_into(url, part, timeout)
            break
        except _Retryable as exc:
            if attempt == retries:
                kept = (f"; the partial download {part} is kept, rerun to resume"
                        if os.path.exists(part) else "")
                raise DataError(
                    f"download of {url} failed after {attempt + 1} attempts: {exc}{kept}") from None
            delay = min(retry_delay * 2 ** attempt, MAX_RETRY_DELAY)
            print(f"{os.path.basename(dest_path)}: {exc}; retry {attempt + 1}/{retries} "
                  f"in {delay:.1f}s", file=sys.stderr)
            time.sleep(delay)
    os.replace(part, dest_path)
    return True


# ---------------------------------------------------------------------------
# step 2: check every shard
# ---------------------------------------------------------------------------

def _corrupt(path, reason):
    """Move a bad shard out of the way (a rerun downloads it again) and describe it."""
    bad = path + ".corrupt"
    os.replace(path, bad)
    return DataError(f"{path} is corrupt ({reason}); moved it to {os.path.basename(bad)}, "
                     "rerun to download it again")


def iter_documents(path):
    """Yield the "text" of every line of a shard; a damaged shard raises DataError."""
    lineno = 0
    try:
        with gzip.open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    doc = json.loads(line)
                except ValueError as exc:  # also a line that is not UTF-8
                    raise _corrupt(path, f"line {lineno} is not JSON: {exc}") from None
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    raise _corrupt(path, f'line {lineno} has no "text" string')
                yield doc["text"]
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        what = "truncated" if isinstance(exc, EOFError) else "bad gzip data"
        raise _corrupt(path, f"{what} after line {lineno}: {exc}") from None
    except FileNotFoundError:
        raise DataError(f"shard {path} not found") from None
    except OSError as exc:  # a read error of the disk, not of the data: leave the file alone
        raise DataError(f"could not read {path}: {exc}") from exc
    if lineno == 0:
        raise _corrupt(path, "no documents")


def count_documents(path):
    """Read a shard completely (the validation pass) and return its number of documents."""
    return sum(1 for _ in iter_documents(path))


# ---------------------------------------------------------------------------
# step 3: tokenise in parallel, write
# ---------------------------------------------------------------------------

def encode_batch(texts):
    """GPT-2 ids of a list of documents, each followed by EOT, as one uint16 array.

    encode_ordinary: a document that contains the string "<|endoftext|>" gets it as plain
    text, so the only 50256s in the data are the separators we add.
    """
    enc = gpt2_encoding()  # tiktoken caches it per process after the first call
    ids = []
    for text in texts:
        ids.extend(enc.encode_ordinary(text))
        ids.append(BPE_EOT)
    return np.array(ids, dtype=np.uint16)


def _batches(paths):
    for path in paths:
        batch = []
        for text in iter_documents(path):
            batch.append(text)
            if len(batch) == DOCS_PER_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch


def _encode_in_order(batches, pool, ahead):
    """Yield (number of documents, ids) per batch, in order.

    Pool.imap would read the whole input ahead (all of a shard's text in memory); submitting at
    most ``ahead`` batches keeps memory flat and every worker busy.
    """
    if pool is None:
        for batch in batches:
            yield len(batch), encode_batch(batch)
        return
    pending = collections.deque()
    for batch in batches:
        pending.append((len(batch), pool.apply_async(encode_batch, (batch,))))
        if len(pending) >= ahead:
            n, result = pending.popleft()
            yield n, result.get()
    while pending:
        n, result = pending.popleft()
        yield n, result.get()


def tokenize_split(paths, out_path, n_docs, pool, ahead, desc):
    """Stream the documents of ``paths`` through the tokenizer into ``out_path``.

    Returns (number of tokens, sha256 of the file).
    """
    def arrays():
        with tqdm(total=n_docs, unit="doc", desc=desc) as bar:
            for n, ids in _encode_in_order(_batches(paths), pool, ahead):
                yield ids
                bar.update(n)

    return write_tokens(out_path, arrays())


def _outputs_match(out_dir, train, val, shard_sha):
    """True if meta.json and the bins already hold exactly these shards, tokenised."""
    try:
        meta = read_meta(out_dir)
        return (meta.get("tokenizer") == BPE_ENCODING and meta.get("vocab_size") == BPE_VOCAB_SIZE
                and meta.get("train_shards") == train and meta.get("val_shards") == val
                and meta.get("shard_sha256") == shard_sha
                and os.path.getsize(os.path.join(out_dir, "train.bin")) == 2 * meta["n_train"]
                and os.path.getsize(os.path.join(out_dir, "val.bin")) == 2 * meta["n_val"])
    except (DataError, OSError, KeyError, TypeError):
        return False


def shards_from_text(text_path, paths, train, val):
    """Offline stand-in for the download: cut a plain-text file into "documents" at blank lines
    (tiny Shakespeare: one speech each), every 10th to validation, and deal them round-robin into
    shards with the real C4 names and line format, so checking and tokenising run unchanged.
    Shards already there are kept (a rerun finds everything up to date)."""
    try:
        with open(text_path, encoding="utf-8") as f:
            docs = [d.strip("\n") for d in re.split(r"\n\s*\n", f.read()) if d.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read --from_text {text_path}: {exc}") from None
    split_docs = {"train": [d for i, d in enumerate(docs) if i % 10 != 9], "val": docs[9::10]}
    for split, names in (("train", train), ("val", val)):
        if len(split_docs[split]) < len(names):
            raise DataError(f"--from_text {text_path} has {len(docs)} paragraphs: too few for {len(names)} {split} shards")
        for k, name in enumerate(names):
            if os.path.exists(paths[name]):
                continue
            lines = "".join(json.dumps({"text": d, "timestamp": "", "url": f"file://{os.path.abspath(text_path)}"}) + "\n"
                            for d in split_docs[split][k::len(names)])
            def write(tmp, lines=lines):
                with gzip.open(tmp, "wt", encoding="utf-8") as f:
                    f.write(lines)
            atomic_write(paths[name], write)


def prepare(shards=1, val_shards=1, out_dir=DEFAULT_OUT_DIR, base_url=DEFAULT_BASE_URL,
            workers=None, retries=DEFAULT_RETRIES, retry_delay=DEFAULT_RETRY_DELAY,
            timeout=DEFAULT_TIMEOUT, from_text=None):
    """Download, check and tokenise; write train.bin, val.bin, meta.json; return the meta dict.

    If meta.json already describes exactly these shards (same sha256) and the bins have the
    sizes it records, nothing is rewritten.
    """
    train, val = shard_names("train", shards), shard_names("validation", val_shards)
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise DataError(f"workers must be at least 1, got {workers}")
    if retries < 0:
        raise DataError(f"retries must be at least 0, got {retries}")
    gpt2_encoding()  # fail now, not after an hour of downloads
    base_url = base_url.rstrip("/")
    paths = {name: os.path.join(out_dir, name) for name in train + val}

    os.makedirs(out_dir, exist_ok=True)
    if from_text:
        shards_from_text(from_text, paths, train, val)
    for i, (name, path) in enumerate(() if from_text else paths.items(), 1):
        if download(f"{base_url}/en/{name}", path, retries, retry_delay, timeout):
            print(f"[{i}/{len(paths)}] downloaded {name}")
        else:
            print(f"[{i}/{len(paths)}] {name} already downloaded")

    shard_sha = {name: sha256_of_file(path) for name, path in paths.items()}
    if _outputs_match(out_dir, train, val, shard_sha):
        print(f"{out_dir}: train.bin, val.bin, meta.json are up to date for these shards")
        return read_meta(out_dir)

    n_docs = {}
    for name, path in tqdm(paths.items(), desc="checking shards", unit="shard"):
        n_docs[name] = count_documents(path)

    # From here on the old outputs are replaced: write_tokens removes meta.json first, so no
    # meta.json ever sits next to bins it does not describe.
    ahead = 2 * workers
    # spawn, not fork: forking a process that runs threads (tqdm's monitor, an HTTP client) can
    # deadlock, and spawn behaves the same on Linux, macOS and Windows.
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None
    try:
        counts = {}
        for split, names in (("train", train), ("val", val)):
            counts[split] = tokenize_split(
                [paths[n] for n in names], os.path.join(out_dir, f"{split}.bin"),
                sum(n_docs[n] for n in names), pool, ahead, desc=f"tokenizing {split}")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    meta = {
        "tokenizer": BPE_ENCODING,
        "vocab_size": BPE_VOCAB_SIZE,
        "tokenizer_vocab_size": BPE_TOKENS,
        "eot_token": BPE_EOT,
        "dtype": "uint16",
        "n_train": counts["train"][0],
        "n_val": counts["val"][0],
        "n_train_docs": sum(n_docs[n] for n in train),
        "n_val_docs": sum(n_docs[n] for n in val),
        "source": f"file://{os.path.abspath(from_text)} (C4-format shards made from a text file)" if from_text else f"{base_url}/en",
        "train_shards": train,
        "val_shards": val,
        "shard_sha256": shard_sha,
        "train_sha256": counts["train"][1],
        "val_sha256": counts["val"][1],
    }
    write_meta(meta, out_dir)  # last: its presence means the bins are done
    return meta


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

def main(argv=None):
    """Parse arguments, run ``prepare`` and print a summary.

    Errors are reported as one ``error: ...`` line and exit code 1, instead of a traceback,
    because they are about the data or the network, not about this code.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=1,
                        help=f"number of train shards, the first N of {N_TRAIN_SHARDS} (default: 1)")
    parser.add_argument("--val_shards", type=int, default=1,
                        help=f"number of validation shards, of {N_VAL_SHARDS} (default: 1)")
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL,
                        help="the dataset root; shards are fetched from BASE_URL/en/NAME")
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR,
                        help=f"shards, train.bin, val.bin, meta.json go here (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes (default: all CPUs)")
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

    try:
        meta = prepare(shards=args.shards, val_shards=args.val_shards, out_dir=args.out_dir,
                       base_url=args.base_url, workers=args.workers, retries=args.retries,
                       retry_delay=args.retry_delay, timeout=args.timeout, from_text=args.from_text)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)

    print(f"vocab size:   {meta['vocab_size']:,} ({BPE_ENCODING}, {BPE_TOKENS:,} padded)")
    print(f"train tokens: {meta['n_train']:,} ({meta['n_train_docs']:,} documents)")
    print(f"val tokens:   {meta['n_val']:,} ({meta['n_val_docs']:,} documents)")
    print(f"wrote train.bin, val.bin, meta.json to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
