"""data.py's training windows against a plain loop over their definition."""

import numpy as np
import torch

from data import read_windows, sample_windows


def test_windows_are_the_next_token_pairs_shifted_into_the_second_language():
    data = np.arange(100, dtype=np.uint16) * 3 % 65
    starts, is_low = sample_windows(len(data), 8, 64, torch.Generator().manual_seed(0), prob_low_resource=0.5)
    assert starts.min() >= 0 and starts.max() <= len(data) - 8 - 1
    assert 0 < int(is_low.sum()) < 64  # both languages at p = 0.5 in 64 draws
    x, y = read_windows(data, starts, is_low, 8, shift=65)
    for b in range(64):
        s, offset = int(starts[b]), 65 * int(is_low[b])
        assert x[b].tolist() == [int(data[s + t]) + offset for t in range(8)]
        assert y[b].tolist() == [int(data[s + t + 1]) + offset for t in range(8)]
    assert x.dtype == torch.int64


def test_no_low_resource_windows_at_probability_zero():
    _, is_low = sample_windows(1000, 16, 256, torch.Generator().manual_seed(1), prob_low_resource=0.0)
    assert not is_low.any()


def test_sharded_tokens_gather_like_the_concatenation(tmp_path):
    """ShardedTokens over three files of uneven length: any index array (windows crossing file
    boundaries, repeats, the last token) reads what indexing the concatenated array reads."""
    from data import ShardedTokens
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 50257, n).astype(np.uint16) for n in (7, 1, 30)]
    paths = []
    for k, part in enumerate(parts):
        paths.append(tmp_path / f"{k}.bin")
        part.tofile(paths[-1])
    data, whole = ShardedTokens(paths, [len(p) for p in parts]), np.concatenate(parts)
    assert len(data) == len(whole) == 38
    index = rng.integers(0, 38, (5, 9))
    index[0] = np.arange(3, 12)  # from file 0 through file 1 into file 2
    index[1, -1] = 37
    assert np.array_equal(data[index], whole[index]) and data[index].dtype == np.uint16
    assert np.array_equal(data[5:10], whole[5:10]) and data.tolist() == whole.tolist()
    for bad in ([38], [-1]):
        try:
            data[np.array(bad)]
        except IndexError:
            continue
        raise AssertionError(f"index {bad} read past the stream")


def test_dataset_mismatch_compares_per_shard_token_files():
    """Two C4 preparations of the same sizes whose token files differ are not the same dataset;
    a checkpoint from the single-file layout is judged on the keys both record."""
    from data import dataset_mismatch
    entry = {"file": "train/a.bin", "shard": "a", "n_tokens": 10, "max_id": 5, "sha256": "0" * 64}
    meta = {"tokenizer": "r50k_base", "vocab_size": 50304, "n_train": 10, "n_val": 4,
            "token_files": {"train": [entry], "val": [dict(entry, file="val/b.bin", sha256="1" * 64)]}}
    assert dataset_mismatch(meta, meta, "d") is None
    other = {**meta, "token_files": {**meta["token_files"], "train": [dict(entry, sha256="2" * 64)]}}
    assert "token_files" in dataset_mismatch(meta, other, "d")
    assert dataset_mismatch(meta, other, "d", whole=False) is None  # a new run from the checkpoint: same tokens suffice
    old_layout = {k: v for k, v in meta.items() if k != "token_files"} | {"train_sha256": "f" * 64}
    assert dataset_mismatch(old_layout, meta, "d") is None
    assert "n_train" in dataset_mismatch(dict(old_layout, n_train=11), meta, "d")
