"""
Reading a prepared dataset (prepare_shakespeare.py, prepare_c4.py): data_dir holds train.bin and
val.bin (token ids as uint16) and meta.json (vocab_size, and itos for characters). Every way these
files can be wrong gets one line that names the file and what was expected, before a run touches
its out_dir.
"""

import json
import os

import numpy as np


class DataError(Exception):
    pass


def read_meta(data_dir):
    """meta.json as a dict, with a positive integer vocab_size."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise DataError(f"no dataset in data_dir '{data_dir}' (missing meta.json); "
                        f"run prepare_shakespeare.py --out_dir {data_dir} first")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON (truncated or damaged? {e}); prepare the dataset again") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise DataError(f"{path} has no positive integer 'vocab_size' (got {vocab!r}); prepare the dataset again")
    if "itos" in meta and len(meta["itos"]) != vocab:
        raise DataError(f"{path}: 'itos' has {len(meta['itos'])} entries but vocab_size is {vocab}")
    return meta


def load_tokens(data_dir, split, block_size, vocab_size=None):
    """The split as a read-only uint16 memmap (a C4 shard is ~150M tokens: only the sampled windows
    are ever read and widened). It must hold at least one window of block_size + 1 tokens, and
    (if vocab_size is given) no id at or above vocab_size: an embedding lookup past the table
    fails far from the cause."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(path):
        raise DataError(f"missing {path}; prepare the dataset again")
    size = os.path.getsize(path)
    if size % 2:
        raise DataError(f"{path} has an odd number of bytes ({size}): not uint16 token ids (truncated?)")
    if size // 2 < block_size + 1:
        raise DataError(f"{path} holds {size // 2} tokens, fewer than one window of block_size + 1 = "
                        f"{block_size + 1}; use a smaller block_size or more data")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
        raise DataError(f"{path} holds token id {int(tokens.max())} but meta.json's vocab_size is {vocab_size}: the "
                        f"two do not belong together; prepare the dataset again")
    return tokens
