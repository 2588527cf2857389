"""
A prepared dataset: meta.json and uint16 token ids, one file per split
(prepare_shakespeare.py) or per C4 shard, indexed in meta.json
(prepare_c4.py). Written and read only here; every way it can be
wrong is one DataError naming the file and what was expected.

Design notes: docs/data.md
"""

import hashlib
import json
import os

import numpy as np

from errors import UserError
from utils import atomic_write, save_text

# GPT-2's BPE, as meta.json records it
BPE_ENCODING = "r50k_base"  # tiktoken's name for "gpt2"'s ranks
BPE_TOKENS = 50257       # every id in the data is below this
BPE_EOT = 50256          # <|endoftext|>
BPE_VOCAB_SIZE = 50304   # BPE_TOKENS padded to a multiple of 64
BPE_META = {"tokenizer": BPE_ENCODING, "vocab_size": BPE_VOCAB_SIZE,
            "tokenizer_vocab_size": BPE_TOKENS, "eot_token": BPE_EOT}

# a per-shard train split up to this many bytes is hashed at every load
HASH_TRAIN_UP_TO = 1 << 30


class DataError(UserError):
    """A dataset that is missing, wrong or could not be prepared."""


def gpt2_encoding():
    """tiktoken's GPT-2 BPE; offline, its cached rank file."""
    import tiktoken  # only BPE data needs it

    try:
        return tiktoken.get_encoding(BPE_ENCODING)
    except Exception as exc:  # whatever its HTTP client or reader raised
        raise DataError(
            f"cannot load tiktoken's {BPE_ENCODING} ranks "
            f"({type(exc).__name__}: {exc}); offline, point "
            "TIKTOKEN_CACHE_DIR at a directory that holds its cached "
            "BPE file") from None


def write_meta(meta, data_dir, bins=()):
    """Write each (split, uint16 ids) of `bins` to {split}.bin, its
    sha256 into meta as {split}_sha256, then meta.json, each through a
    temp file. The old meta.json goes first, the new one last: it
    means the files beside it are complete."""
    meta_path = os.path.join(data_dir, "meta.json")
    try:
        if bins and os.path.exists(meta_path):
            os.remove(meta_path)
        for split, ids in bins:
            atomic_write(os.path.join(data_dir, f"{split}.bin"), ids.tofile)
            sha256 = hashlib.sha256(ids.tobytes()).hexdigest()
            meta[f"{split}_sha256"] = sha256
        text = json.dumps(meta, indent=2, ensure_ascii=False) + "\n"
        save_text(text, meta_path)
    except OSError as exc:
        raise DataError(
            f"could not write outputs to {data_dir}: {exc}") from exc


def preparation_command(data_dir, shards=1):
    """The command that prepares data_dir, by its name: c4* is C4;
    *gpt2* or *bpe* tiny Shakespeare in BPE, else in characters."""
    name = os.path.basename(os.path.normpath(data_dir)).lower()
    if name.startswith("c4"):
        return (f"python prepare_c4.py --shards {shards} "
                f"--out_dir {data_dir} (offline, from any plain text: "
                "--from_text FILE instead of --shards)")
    bpe = "gpt2" in name or "bpe" in name
    tokenizer = " --tokenizer gpt2" if bpe else ""
    return f"python prepare_shakespeare.py{tokenizer} --out_dir {data_dir}"


def read_meta(data_dir):
    """meta.json as a dict, with a positive integer vocab_size."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise DataError(
            f"no dataset in data_dir '{data_dir}' (missing meta.json); "
            f"prepare it first: {preparation_command(data_dir)}")
    check_readable(path)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON (truncated or damaged? "
                        f"{e}); prepare the dataset again") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise DataError(f"{path} has no positive integer 'vocab_size' "
                        f"(got {vocab!r}); prepare the dataset again")
    if "itos" in meta and len(meta["itos"]) != vocab:
        raise DataError(f"{path}: 'itos' has {len(meta['itos'])} entries "
                        f"but vocab_size is {vocab}")
    # prepare_c4.py writes its index after every shard: cut short
    unfinished = meta.get("unfinished")
    if unfinished:
        shards = len(meta.get("train_shards", [])) or 1
        raise DataError(
            f"the preparation of {data_dir} did not finish "
            f"({len(unfinished)} shard(s) not yet tokenised, first "
            f"{unfinished[0]}); rerun it to finish: "
            f"{preparation_command(data_dir, shards)}")
    return meta


def check_readable(path):
    """DataError when a dataset file that exists cannot be read: a
    directory in its place, or a file without read permission."""
    if os.path.isdir(path):
        raise DataError(f"{path} is a directory, not a file; "
                        "prepare the dataset again")
    if os.path.exists(path):
        try:
            open(path, "rb").close()
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None


def dataset_mismatch(recorded, meta, data_dir, whole=True):
    """Why the dataset in data_dir (meta: its meta.json) is not the one
    a checkpoint recorded (the meta it saved), in one line, or None.
    The tokenizer and vocabulary always count; whole=True (evaluation,
    resume) also the split sizes and content hashes."""
    keys = ["tokenizer", "vocab_size", "itos"]
    if whole:
        keys += ["n_train", "n_val", "sha256", "train_sha256",
                 "val_sha256"]
    differing = [key for key in keys if key in recorded and key in meta
                 and recorded[key] != meta[key]]
    if whole and "token_files" in recorded and "token_files" in meta:
        # per-shard C4 files: their hashes, in order
        hashes = [[[f["sha256"] for f in m["token_files"].get(split, [])]
                   for split in ("train", "val")]
                  for m in (recorded, meta)]
        if hashes[0] != hashes[1]:
            differing.append("token_files")
    if not differing:
        return None

    def describe(m):
        sizes = [f"{m[key]:,}" if isinstance(m.get(key), int) else "?"
                 for key in ("n_train", "n_val")]
        return (f"{m.get('tokenizer', 'char')} tokens, vocab_size "
                f"{m.get('vocab_size')}, {sizes[0]} train / {sizes[1]} val")
    return (f"the dataset in {data_dir} is not the checkpoint's "
            f"({', '.join(differing)} differ): the checkpoint's is "
            f"{describe(recorded)}; {data_dir} holds {describe(meta)}")


class ShardedTokens:
    """Per-shard token files read as one stream: an index array
    gathers from the files its offsets fall in (a window may cross
    two). astype, tolist and np.asarray read the whole split."""

    def __init__(self, paths, counts):
        self.files = [np.memmap(p, dtype=np.uint16, mode="r") for p in paths]
        # file k holds [offsets[k], offsets[k+1])
        self.offsets = np.cumsum([0] + list(counts), dtype=np.int64)

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, index):
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index, dtype=np.int64)
        flat = index.ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        # the file each offset falls in
        which = np.searchsorted(self.offsets, flat, side="right") - 1
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
        raise DataError(
            f"{path} holds {n} tokens, fewer than one window of block_size"
            f" + 1 = {block_size + 1}; use a smaller block_size or more data")


def _check_vocab(path, largest, vocab_size, recorded=""):
    if vocab_size is not None and largest >= vocab_size:
        raise DataError(
            f"{path} holds token id {largest}{recorded} but meta.json's "
            f"vocab_size is {vocab_size}: the two do not belong together; "
            "prepare the dataset again")


def _check_content(path, digest, recorded, data_dir):
    if digest != recorded:
        raise DataError(
            f"{path} is not the file its preparation wrote (sha256 "
            f"{digest[:12]}..., meta.json records {recorded[:12]}...): "
            "changed in place or copied from another preparation; "
            f"prepare the dataset again: {preparation_command(data_dir)}")


def _load_shards(data_dir, split, files, block_size, vocab_size,
                 n_tokens):
    """The split's per-shard files, checked against meta.json's index
    by size and recorded largest id; hashed where cheap: the val split
    and a train split of at most HASH_TRAIN_UP_TO bytes."""
    paths = [os.path.join(data_dir, e["file"]) for e in files]
    counts = [entry["n_tokens"] for entry in files]
    hash_them = split == "val" or 2 * sum(counts) <= HASH_TRAIN_UP_TO
    for path, entry in zip(paths, files):
        check_readable(path)
        if not os.path.isfile(path):
            raise DataError(
                f"missing {path} (listed in {data_dir}/meta.json); prepare "
                f"the dataset again: {preparation_command(data_dir)}")
        size = os.path.getsize(path)
        n = entry["n_tokens"]
        if size != 2 * n:
            raise DataError(
                f"{path} has {size:,} bytes but meta.json records "
                f"{n:,} tokens ({2 * n:,} bytes): truncated or from "
                "another preparation; prepare the dataset again")
        _check_vocab(path, entry["max_id"], vocab_size,
                     " (recorded by its preparation)")
        if hash_them and entry.get("sha256"):
            _check_content(path, _scan(path)[1], entry["sha256"], data_dir)
    where = os.path.join(data_dir, split)
    if n_tokens is not None and sum(counts) != n_tokens:
        raise DataError(
            f"{where}: the token files listed hold {sum(counts):,} "
            f"tokens but meta.json says n_{split} is {n_tokens:,}; "
            "prepare the dataset again")
    _check_window(where, sum(counts), block_size)
    if len(paths) == 1:  # no offsets to look up
        return np.memmap(paths[0], dtype=np.uint16, mode="r")
    return ShardedTokens(paths, counts)


def load_tokens(data_dir, split, block_size, vocab_size=None,
                n_tokens=None):
    """The split's tokens, read lazily: a uint16 memmap of {split}.bin
    or of meta.json's per-shard files (ShardedTokens for more than
    one), checked: a window of block_size + 1 tokens, n_tokens and
    vocab_size if given, recorded hashes."""
    meta_path = os.path.join(data_dir, "meta.json")
    meta = read_meta(data_dir) if os.path.exists(meta_path) else {}
    files = (meta.get("token_files") or {}).get(split)
    if files:
        return _load_shards(data_dir, split, files, block_size,
                            vocab_size, n_tokens)
    path = os.path.join(data_dir, f"{split}.bin")
    check_readable(path)
    if not os.path.isfile(path):
        raise DataError(f"missing {path}; prepare the dataset again")
    size = os.path.getsize(path)
    if size % 2:
        raise DataError(f"{path} has an odd number of bytes ({size}): "
                        "not uint16 token ids (truncated?)")
    _check_window(path, size // 2, block_size)
    if n_tokens is not None and size // 2 != n_tokens:
        raise DataError(
            f"{path} holds {size // 2:,} tokens but meta.json says "
            f"{n_tokens:,}: the two do not belong together; "
            "prepare the dataset again")
    recorded = meta.get(f"{split}_sha256")
    if vocab_size is not None or recorded:
        largest, digest = _scan(path)
        if recorded:
            _check_content(path, digest, recorded, data_dir)
        _check_vocab(path, largest, vocab_size)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _scan(path):
    """(largest id, sha256) of a token file, read once, in blocks."""
    h = hashlib.sha256()
    largest = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
            ids = np.frombuffer(block, dtype=np.uint16)
            largest = max(largest, int(ids.max()))
    return largest, h.hexdigest()


class EpochWindows:
    """data_order='epoch': the non-overlapping windows (window w: the
    block_size + 1 tokens from w * block_size on), each drawn once an
    epoch in an order seeded by (seed, epoch) (docs/runs.md)."""

    def __init__(self, n_tokens, block_size, seed):
        self.n_windows = (n_tokens - 1) // block_size
        self.block_size = block_size
        self.seed = seed
        self.epoch, self.index = 0, 0
        self._order = (None, None)  # (epoch, its permutation)

    def order(self, epoch):
        """Epoch's permutation of the window indices (SeedSequence:
        neighbouring seeds or epochs give unrelated orders)."""
        if self._order[0] != epoch:
            rng = np.random.default_rng([self.seed % 2 ** 64, epoch])
            self._order = (epoch, rng.permutation(self.n_windows))
        return self._order[1]

    def next(self, n):
        """The start offsets of the next n windows (1-D int64 tensor)."""
        import torch
        taken = [np.zeros(0, dtype=np.int64)]
        while n > 0:
            count = min(n, self.n_windows - self.index)
            order = self.order(self.epoch)
            taken.append(order[self.index:self.index + count])
            self.index += count
            n -= count
            if self.index == self.n_windows:
                self.epoch, self.index = self.epoch + 1, 0
        return torch.from_numpy(np.concatenate(taken) * self.block_size)

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index,
                "n_windows": self.n_windows}

    def load_state_dict(self, state):
        if state["n_windows"] != self.n_windows:
            raise DataError(
                f"the data position was saved over {state['n_windows']:,} "
                f"windows but the training split now has "
                f"{self.n_windows:,} of block_size {self.block_size}")
        self.epoch, self.index = state["epoch"], state["index"]


def sample_windows(n_tokens, block_size, n, generator,
                   prob_low_resource=0.0, epoch_windows=None):
    """n training windows: their start offsets, uniform with
    replacement (nanoGPT's) or epoch_windows' next n, and whether each
    is in the simulated low-resource language (independently with
    probability prob_low_resource: Stop Jostling's code, Sec. 4.1)."""
    import torch
    if epoch_windows is not None:
        starts = epoch_windows.next(n)
    else:
        starts = torch.randint(n_tokens - block_size, (n,),
                               generator=generator)
    is_low = torch.rand(n, generator=generator) < prob_low_resource
    return starts, is_low


def read_windows(data, starts, is_low, block_size, shift, device="cpu"):
    """The windows of block_size + 1 tokens at starts -> inputs and
    next-token targets, (B, T) each, on the device. A low-resource
    window's ids are shifted by `shift`."""
    import torch
    offsets = torch.arange(block_size + 1)
    positions = (starts.unsqueeze(1) + offsets).numpy()
    windows = torch.from_numpy(data[positions].astype(np.int64))
    windows = windows + shift * is_low.unsqueeze(1)
    x, y = windows[:, :-1], windows[:, 1:]
    if str(device).startswith("cuda"):  # pinned: the copy overlaps compute
        x, y = x.pin_memory(), y.pin_memory()
        return (x.to(device, non_blocking=True),
                y.to(device, non_blocking=True))
    return x.to(device), y.to(device)
