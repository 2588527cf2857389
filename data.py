"""
A prepared dataset: data_dir holds meta.json (vocab_size, and itos for characters) and the token
ids as uint16, either one file per split (train.bin, val.bin: prepare_shakespeare.py, and C4 data
made before the shard index) or one file per C4 shard (train/*.bin, val/*.bin: prepare_c4.py),
listed in meta.json's "token_files" index with each file's token count, largest id and sha256 and
read as one stream (ShardedTokens). prepare_shakespeare.py and prepare_c4.py write it through the
functions here and train.py and evaluate.py read it through them, so both sides agree on one
format. Every way these files can be wrong, or preparing them can fail, is one DataError: one
line that names the file and what was expected (train.py checks its data before it touches its
out_dir).
"""

import hashlib
import json
import os

import numpy as np

from errors import UserError
from utils import atomic_write, save_text

# GPT-2's BPE, as both prepare scripts write it and meta.json records it.
BPE_ENCODING = "r50k_base"  # tiktoken's name for GPT-2's ranks ("gpt2" has the same ranks)
BPE_TOKENS = 50257          # tokens in those ranks: every id in the data is below this
BPE_EOT = 50256             # <|endoftext|>
BPE_VOCAB_SIZE = 50304      # BPE_TOKENS padded up to a multiple of 64: GPU-friendly matmul shapes


# a per-shard train split up to this many bytes is hashed at every load (_load_shards)
HASH_TRAIN_UP_TO = 1 << 30


class DataError(UserError):
    """A dataset that is missing or wrong, or that could not be prepared."""


def gpt2_encoding():
    """tiktoken's GPT-2 BPE. tiktoken downloads the rank file on first use and then caches it,
    so offline the one fix is a cache, and the message says how to point at one."""
    import tiktoken  # only BPE data needs it

    try:
        return tiktoken.get_encoding(BPE_ENCODING)
    except Exception as exc:  # whatever its HTTP client or file reader raised
        raise DataError(f"cannot load tiktoken's {BPE_ENCODING} ranks ({type(exc).__name__}: {exc}); "
                        "offline, point TIKTOKEN_CACHE_DIR at a directory that holds its cached "
                        "BPE file") from None


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
        raise DataError(f"{path} is not valid JSON (truncated or damaged? {e}); "
                        "prepare the dataset again") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise DataError(f"{path} has no positive integer 'vocab_size' (got {vocab!r}); "
                        "prepare the dataset again")
    if "itos" in meta and len(meta["itos"]) != vocab:
        raise DataError(f"{path}: 'itos' has {len(meta['itos'])} entries but vocab_size is {vocab}")
    if meta.get("unfinished"):  # prepare_c4.py writes its index after every shard; this one was cut short
        raise DataError(f"the preparation of {data_dir} did not finish ({len(meta['unfinished'])} shard(s) "
                        f"not yet tokenised, first {meta['unfinished'][0]}); rerun it to finish: "
                        f"{preparation_command(data_dir, len(meta.get('train_shards', [])) or 1)}")
    return meta


def check_readable(*paths):
    """DataError when a dataset file that exists cannot be read: a directory in its place, or a
    file without read permission (read_meta, load_tokens: every file they open)."""
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
    if whole and "token_files" in recorded and "token_files" in meta:  # per-shard C4 files: hashes in order
        hashes = [{split: [f["sha256"] for f in m["token_files"].get(split, [])]
                   for split in ("train", "val")} for m in (recorded, meta)]
        differing += ["token_files"] if hashes[0] != hashes[1] else []
    if not differing:
        return None

    def describe(m):
        sizes = [f"{m[key]:,}" if isinstance(m.get(key), int) else "?" for key in ("n_train", "n_val")]
        return (f"{m.get('tokenizer', 'char')} tokens, vocab_size {m.get('vocab_size')}, "
                f"{sizes[0]} train / {sizes[1]} val")
    return (f"the dataset in {data_dir} is not the checkpoint's ({', '.join(differing)} differ): "
            f"the checkpoint's is {describe(recorded)}; {data_dir} holds {describe(meta)}")


class ShardedTokens:
    """A split kept as one token file per C4 shard, read as the one stream their concatenation is:
    len() is the total, and an integer index array (read_windows' windows, which may cross from
    one file into the next) gathers from the files the offsets fall in. Only what is indexed is
    read; astype/tolist/np.asarray build the whole split in memory (the val split, for evaluation)."""

    def __init__(self, paths, counts):
        self.paths = list(paths)
        self.files = [np.memmap(path, dtype=np.uint16, mode="r") for path in self.paths]
        # file k holds [offsets[k], offsets[k+1])
        self.offsets = np.cumsum([0] + [int(n) for n in counts], dtype=np.int64)

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, index):
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index, dtype=np.int64)
        flat = index.ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        which = np.searchsorted(self.offsets, flat, side="right") - 1  # the file each offset falls in
        out = np.empty(flat.shape, dtype=np.uint16)
        for k in np.unique(which):
            here = which == k
            out[here] = self.files[k][flat[here] - self.offsets[k]]
        return out.reshape(index.shape)

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate(self.files)
        return whole if dtype is None else whole.astype(dtype)

    def astype(self, dtype):
        return np.asarray(self, dtype=dtype)

    def tolist(self):
        return np.asarray(self).tolist()


def _check_window(path, n, block_size):
    if n < block_size + 1:
        raise DataError(f"{path} holds {n} tokens, fewer than one window of block_size + 1 = "
                        f"{block_size + 1}; use a smaller block_size or more data")


def _load_shards(data_dir, split, files, block_size, vocab_size, n_tokens):
    """The split's per-shard files (meta.json's token_files index): every check from the index and
    the files' sizes. prepare_c4.py recorded each file's token count, largest id and sha256 when it
    wrote it; a file of another size is truncated or from another preparation. The content is hashed
    against the sha256 where that is cheap: the val split (an evaluation reads it whole anyway) and a
    train split of at most HASH_TRAIN_UP_TO bytes (c4_tiny). A larger train split is not read at the
    start (a 105 GB C4 run starts at once): a train shard rewritten in place with the same size is
    not seen there (docs/data.md)."""
    paths, counts = [], []
    sizes = [os.path.getsize(path) if os.path.isfile(path) else 0
             for path in (os.path.join(data_dir, e["file"]) for e in files)]
    hash_them = split == "val" or sum(sizes) <= HASH_TRAIN_UP_TO
    for entry in files:
        path = os.path.join(data_dir, entry["file"])
        check_readable(path)
        if not os.path.isfile(path):
            raise DataError(f"missing {path} (listed in {data_dir}/meta.json); prepare the dataset again: "
                            f"{preparation_command(data_dir)}")
        size = os.path.getsize(path)
        if size != 2 * entry["n_tokens"]:
            raise DataError(f"{path} has {size:,} bytes but meta.json records {entry['n_tokens']:,} tokens "
                            f"({2 * entry['n_tokens']:,} bytes): truncated or from another preparation; "
                            f"prepare the dataset again")
        if vocab_size is not None and entry["max_id"] >= vocab_size:
            raise DataError(f"{path} holds token id {entry['max_id']} (recorded by its preparation) but "
                            f"meta.json's vocab_size is {vocab_size}: the two do not belong together; "
                            "prepare the dataset again")
        if hash_them and entry.get("sha256"):
            _check_content(path, sha256_of_file(path), entry["sha256"], data_dir)
        paths.append(path)
        counts.append(entry["n_tokens"])
    total = sum(counts)
    where = os.path.join(data_dir, split)
    if n_tokens is not None and total != n_tokens:
        raise DataError(f"{where}: the token files listed hold {total:,} tokens but meta.json says "
                        f"n_{split} is {n_tokens:,}; prepare the dataset again")
    _check_window(where, total, block_size)
    if len(paths) == 1:  # one file: the memmap itself (no offsets to look up)
        return np.memmap(paths[0], dtype=np.uint16, mode="r")
    return ShardedTokens(paths, counts)


def load_tokens(data_dir, split, block_size, vocab_size=None, n_tokens=None):
    """The split's tokens, read lazily: a read-only uint16 memmap of {split}.bin, or, where meta.json
    indexes one file per shard (prepare_c4.py), a ShardedTokens stream over them (a memmap when the
    split is one file). Either supports len() and read_windows. The split must hold at least one
    window of block_size + 1 tokens, and (if vocab_size is given) no id at or above vocab_size: an
    embedding lookup past the table fails far from the cause. n_tokens: the size meta.json records
    for the split (a bin from another preparation copied in), checked from the files' sizes.

    The largest id: per-shard files have it recorded at preparation, so nothing is read here (a C4
    run starts without touching its 100 GB of tokens). A single {split}.bin has no record and is
    scanned once per call: a second for the toys, a full read of a C4 train.bin made before the shard
    index (rerun prepare_c4.py on its folder to move it to per-shard files).

    The content: a {split}.bin whose sha256 meta.json records ({split}_sha256, prepare_shakespeare.py
    since issue 43) is hashed in that same pass and must match: a file overwritten in place with the
    same size is refused. A dataset prepared before records none and loads unchecked (prepare it
    again to get the check). Per-shard files: see _load_shards."""
    meta_path = os.path.join(data_dir, "meta.json")
    meta = read_meta(data_dir) if os.path.exists(meta_path) else {}
    files = (meta.get("token_files") or {}).get(split)
    if files:
        return _load_shards(data_dir, split, files, block_size, vocab_size, n_tokens)
    path = os.path.join(data_dir, f"{split}.bin")
    check_readable(path)
    if not os.path.isfile(path):
        raise DataError(f"missing {path}; prepare the dataset again")
    size = os.path.getsize(path)
    if size % 2:
        raise DataError(f"{path} has an odd number of bytes ({size}): not uint16 token ids (truncated?)")
    _check_window(path, size // 2, block_size)
    if n_tokens is not None and size // 2 != n_tokens:
        raise DataError(f"{path} holds {size // 2:,} tokens but meta.json says {n_tokens:,}: "
                        f"the two do not belong together; prepare the dataset again")
    recorded = meta.get(f"{split}_sha256")
    if vocab_size is not None or recorded:
        largest, digest = _scan(path)
        if recorded:
            _check_content(path, digest, recorded, data_dir)
        if vocab_size is not None and largest >= vocab_size:
            raise DataError(f"{path} holds token id {largest} but meta.json's vocab_size is {vocab_size}: "
                            f"the two do not belong together; prepare the dataset again")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _check_content(path, digest, recorded, data_dir):
    if digest != recorded:
        raise DataError(f"{path} is not the file its preparation wrote (sha256 {digest[:12]}..., "
                        f"meta.json records {recorded[:12]}...): changed in place or copied from another "
                        f"preparation; prepare the dataset again: {preparation_command(data_dir)}")


def _scan(path):
    """(largest id, sha256) of a token file, in one pass over it in blocks."""
    h, largest = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
            largest = max(largest, int(np.frombuffer(block, dtype=np.uint16).max()))
    return largest, h.hexdigest()


class EpochWindows:
    """data_order='epoch': the split's non-overlapping windows (window w holds the block_size + 1
    tokens from w * block_size on), each drawn exactly once per epoch, in a new order every epoch.
    Epoch e's order is a permutation seeded by (seed, e), so the position (epoch, index) is all a
    checkpoint keeps; next(n) takes the next n windows, running on into the next epoch's order.
    The draws do not depend on how they are chunked: n = 8 twice gives what n = 16 once gives."""

    def __init__(self, n_tokens, block_size, seed):
        self.n_windows, self.block_size, self.seed = (n_tokens - 1) // block_size, block_size, seed
        self.epoch, self.index = 0, 0
        self._order = (None, None)  # (epoch, its permutation): one permutation held at a time

    def order(self, epoch):
        """Epoch's permutation of the window indices. numpy hashes the pair (seed, epoch) into
        the generator's state (SeedSequence): neighbouring seeds or epochs give unrelated orders."""
        if self._order[0] != epoch:
            rng = np.random.default_rng([self.seed % 2 ** 64, epoch])
            self._order = (epoch, rng.permutation(self.n_windows))
        return self._order[1]

    def next(self, n):
        """The start offsets of the next n windows (a 1-D int64 tensor)."""
        import torch
        taken = [np.zeros(0, dtype=np.int64)]
        while n > 0:
            count = min(n, self.n_windows - self.index)
            taken.append(self.order(self.epoch)[self.index:self.index + count])
            self.index, n = self.index + count, n - count
            if self.index == self.n_windows:
                self.epoch, self.index = self.epoch + 1, 0
        return torch.from_numpy(np.concatenate(taken) * self.block_size)

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "n_windows": self.n_windows}

    def load_state_dict(self, state):
        if state["n_windows"] != self.n_windows:
            raise DataError(f"the data position was saved over {state['n_windows']:,} windows but the "
                            f"training split now has {self.n_windows:,} of block_size {self.block_size}")
        self.epoch, self.index = state["epoch"], state["index"]


def sample_windows(n_tokens, block_size, n, generator, prob_low_resource=0.0, epoch_windows=None):
    """n training windows of a split of n_tokens tokens: their start offsets, and whether each is
    in the simulated low-resource language (independently with probability prob_low_resource:
    the authors' code decides per window at batch time, Stop Jostling Sec. 4.1). The starts are
    uniform with replacement (nanoGPT's, data_order='random'), or epoch_windows' next n."""
    import torch  # here, not at the top: the prepare scripts import data.py and need no torch
    starts = epoch_windows.next(n) if epoch_windows is not None else \
        torch.randint(n_tokens - block_size, (n,), generator=generator)
    is_low = torch.rand(n, generator=generator) < prob_low_resource
    return starts, is_low


def read_windows(data, starts, is_low, block_size, shift, device="cpu"):
    """The windows of block_size + 1 tokens at starts (offsets into the split's whole stream, from
    load_tokens: a window may run from one shard's file into the next) -> inputs (B, T) and
    next-token targets (B, T) on the device; a low-resource window has every id shifted by `shift`
    (the char vocabulary's size: the second language is the first one's copy with its own ids)."""
    import torch
    positions = (starts.unsqueeze(1) + torch.arange(block_size + 1)).numpy()
    windows = torch.from_numpy(data[positions].astype(np.int64))
    windows = windows + shift * is_low.unsqueeze(1)
    x, y = windows[:, :-1], windows[:, 1:]
    if str(device).startswith("cuda"):  # pinned host memory: the copy overlaps with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
