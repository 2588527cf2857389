"""
A prepared dataset: data_dir holds train.bin and val.bin (token ids as uint16) and meta.json
(vocab_size, and itos for characters). prepare_shakespeare.py and prepare_c4.py write it through
the functions here and train.py and evaluate.py read it through them, so both sides agree on one
format. Every way these files can be wrong, or preparing them can fail, is one DataError: one
line that names the file and what was expected (train.py checks its data before it touches its
out_dir).
"""

import hashlib
import json
import os

import numpy as np

from utils import atomic_write, save_text

# GPT-2's BPE, as both prepare scripts write it and meta.json records it.
BPE_ENCODING = "r50k_base"  # tiktoken's name for GPT-2's ranks ("gpt2" has the same ranks)
BPE_TOKENS = 50257          # tokens in those ranks: every id in the data is below this
BPE_EOT = 50256             # <|endoftext|>
BPE_VOCAB_SIZE = 50304      # BPE_TOKENS padded up to a multiple of 64: GPU-friendly matmul shapes


class DataError(Exception):
    """A dataset that is missing or wrong, or that could not be prepared."""


def gpt2_encoding():
    """tiktoken's GPT-2 BPE. tiktoken downloads the rank file on first use and then caches it,
    so offline the one fix is a cache, and the message says how to point at one."""
    import tiktoken  # only BPE data needs it

    try:
        return tiktoken.get_encoding(BPE_ENCODING)
    except Exception as exc:  # whatever its HTTP client or file reader raised
        raise DataError(f"cannot load tiktoken's {BPE_ENCODING} ranks ({type(exc).__name__}: {exc}); offline, "
                        "point TIKTOKEN_CACHE_DIR at a directory that holds its cached BPE file") from None


def sha256_of_file(path):
    """Hashed in blocks, so a multi-GB shard never has to fit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_tokens(path, arrays):
    """Stream uint16 token arrays into `path` (a split's .bin) through a temp file renamed into
    place; return (number of tokens, sha256 of the file). The meta.json beside it is removed
    first and write_meta writes it after the bins, so a meta.json always describes the bins next
    to it: a crash leaves a complete dataset or one that read_meta reports as missing."""
    directory = os.path.dirname(path) or "."
    meta_path = os.path.join(directory, "meta.json")
    result = {}

    def write(tmp):
        h, n_tokens = hashlib.sha256(), 0
        with open(tmp, "wb") as f:
            for ids in arrays:
                block = ids.tobytes()
                f.write(block)
                h.update(block)
                n_tokens += len(ids)
        result["n_tokens"], result["sha256"] = n_tokens, h.hexdigest()

    try:
        if os.path.exists(meta_path):
            os.remove(meta_path)
        atomic_write(path, write)
    except OSError as exc:
        raise DataError(f"could not write outputs to {directory}: {exc}") from exc
    return result["n_tokens"], result["sha256"]


def write_meta(meta, data_dir):
    """meta.json, last: its presence means the bins beside it are complete (see write_tokens).
    UTF-8 with the characters themselves, so a char vocabulary's itos stays readable."""
    try:
        save_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", os.path.join(data_dir, "meta.json"))
    except OSError as exc:
        raise DataError(f"could not write outputs to {data_dir}: {exc}") from exc


def preparation_command(data_dir, shards=1):
    """The command that prepares the dataset a config's data_dir names: C4 shards for a folder
    called c4*, tiny Shakespeare in GPT-2 BPE for one whose name says gpt2 or bpe, in characters
    otherwise (the configs' folders: data/c4, data/c4_tiny, data/shakespeare_gpt2, data/shakespeare_char)."""
    name = os.path.basename(os.path.normpath(data_dir)).lower()
    if name.startswith("c4"):
        return (f"python prepare_c4.py --shards {shards} --out_dir {data_dir} (offline, from any plain text: "
                f"--from_text FILE instead of --shards)")
    tokenizer = " --tokenizer gpt2" if "gpt2" in name or "bpe" in name else ""
    return f"python prepare_shakespeare.py{tokenizer} --out_dir {data_dir}"


def read_meta(data_dir):
    """meta.json as a dict, with a positive integer vocab_size."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise DataError(f"no dataset in data_dir '{data_dir}' (missing meta.json); prepare it first: "
                        f"{preparation_command(data_dir)}")
    check_readable(path)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON (truncated or damaged? {e}); prepare the dataset again") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise DataError(f"{path} has no positive integer 'vocab_size' (got {vocab!r}); prepare the dataset again")
    if "itos" in meta and len(meta["itos"]) != vocab:
        raise DataError(f"{path}: 'itos' has {len(meta['itos'])} entries but vocab_size is {vocab}")
    return meta


def check_readable(*paths):
    """DataError when a dataset file that exists cannot be read: a directory in its place, or a
    file without read permission (read_meta, and train.py and evaluate.py before load_tokens)."""
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"{path} is a directory, not a file; prepare the dataset again")
        if os.path.exists(path):
            try:
                open(path, "rb").close()
            except OSError as e:
                raise DataError(f"cannot read {path}: {e.strerror}") from None


def dataset_mismatch(recorded, meta, data_dir, whole=True):
    """Why the dataset in data_dir (its meta.json: meta) is not the one a checkpoint recorded
    (recorded: the meta it saved), in one line, or None. The tokenizer, the vocabulary and a char
    vocabulary's characters always count; whole=True (evaluation, resume) also the split sizes and
    the content hashes the preparation recorded; whole=False (starting a new run from a checkpoint)
    lets the text differ."""
    keys = ["tokenizer", "vocab_size", "itos"]
    if whole:
        keys += ["n_train", "n_val", "sha256", "train_sha256", "val_sha256"]
    differing = [key for key in keys if key in recorded and key in meta and recorded[key] != meta[key]]
    if not differing:
        return None

    def describe(m):
        sizes = [f"{m[key]:,}" if isinstance(m.get(key), int) else "?" for key in ("n_train", "n_val")]
        return f"{m.get('tokenizer', 'char')} tokens, vocab_size {m.get('vocab_size')}, {sizes[0]} train / {sizes[1]} val"
    return (f"the dataset in {data_dir} is not the checkpoint's ({', '.join(differing)} differ): the checkpoint's "
            f"is {describe(recorded)}; {data_dir} holds {describe(meta)}")


def load_tokens(data_dir, split, block_size, vocab_size=None, n_tokens=None):
    """The split as a read-only uint16 memmap (a C4 shard is ~150M tokens: only the sampled windows
    are ever read and widened). It must hold at least one window of block_size + 1 tokens, and
    (if vocab_size is given) no id at or above vocab_size: an embedding lookup past the table
    fails far from the cause. n_tokens: the size meta.json records for the split (a bin from
    another preparation copied in), checked from the file's size alone."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(path):
        raise DataError(f"missing {path}; prepare the dataset again")
    size = os.path.getsize(path)
    if size % 2:
        raise DataError(f"{path} has an odd number of bytes ({size}): not uint16 token ids (truncated?)")
    if size // 2 < block_size + 1:
        raise DataError(f"{path} holds {size // 2} tokens, fewer than one window of block_size + 1 = "
                        f"{block_size + 1}; use a smaller block_size or more data")
    if n_tokens is not None and size // 2 != n_tokens:
        raise DataError(f"{path} holds {size // 2:,} tokens but meta.json says {n_tokens:,}: the two do not belong "
                        f"together; prepare the dataset again")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
        raise DataError(f"{path} holds token id {int(tokens.max())} but meta.json's vocab_size is {vocab_size}: the "
                        f"two do not belong together; prepare the dataset again")
    return tokens


def sample_windows(n_tokens, block_size, n, generator, prob_low_resource=0.0):
    """n random training windows of a split of n_tokens tokens: their start offsets, and whether
    each is in the simulated low-resource language (independently with probability
    prob_low_resource: the authors' code decides per window at batch time, Stop Jostling Sec. 4.1)."""
    import torch  # here, not at the top: the prepare scripts import data.py and need no torch
    starts = torch.randint(n_tokens - block_size, (n,), generator=generator)
    is_low = torch.rand(n, generator=generator) < prob_low_resource
    return starts, is_low


def read_windows(data, starts, is_low, block_size, shift, device="cpu"):
    """The windows of block_size + 1 tokens at starts -> inputs (B, T) and next-token targets (B, T)
    on the device; a low-resource window has every id shifted by `shift` (the char vocabulary's
    size: the second language is the first one's copy with its own ids)."""
    import torch
    windows = torch.from_numpy(data[(starts.unsqueeze(1) + torch.arange(block_size + 1)).numpy()].astype(np.int64))
    windows = windows + shift * is_low.unsqueeze(1)
    x, y = windows[:, :-1], windows[:, 1:]
    if str(device).startswith("cuda"):  # pinned host memory: the copy overlaps with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
