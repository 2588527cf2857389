"""data.py's training windows, random and epoch by epoch, against plain loops over their definitions."""

import collections
import os

import numpy as np
import pytest
import torch

from data import DataError, EpochWindows, load_tokens, read_meta, read_windows, sample_windows


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


# data_order='epoch' (data.EpochWindows) against its definition: window w holds tokens w*T .. w*T + T,
# n_windows = (n - 1) // T of them, each once per epoch, epoch e in an order seeded by (seed, e).

def test_an_epoch_draws_every_window_exactly_once():
    for n_tokens, T in [(100, 8), (97, 8), (9, 8), (1000, 7), (5000, 64)]:
        n_windows = (n_tokens - 1) // T
        windows = EpochWindows(n_tokens, T, seed=5)
        drawn = []
        while len(drawn) < n_windows:  # in steps of 3, the last one running into the next epoch
            drawn += windows.next(3).tolist()
        counts = collections.Counter(drawn[:n_windows])
        assert counts == {w * T: 1 for w in range(n_windows)}, (n_tokens, T)
        assert max(drawn) + T <= n_tokens - 1  # every window's T + 1 tokens lie in the split
        if n_windows > 20:
            assert drawn[:n_windows] != sorted(drawn[:n_windows])  # an order, not the file's


def test_an_epoch_of_a_prepared_split_reads_all_its_text_once(small_data_dir):
    """Through the training path (load_tokens, read_windows) on real files: the windows of one epoch,
    put back in order, are the training text's first n_windows * T + 1 characters."""
    T = 16
    meta = read_meta(small_data_dir)
    train = load_tokens(small_data_dir, "train", T, meta["vocab_size"], meta["n_train"])
    windows = EpochWindows(len(train), T, seed=1337)
    starts = windows.next(windows.n_windows)
    x, y = read_windows(train, starts, torch.zeros(len(starts), dtype=torch.bool), T, shift=0)
    rows = [(s, x[i].tolist() + y[i, -1:].tolist()) for i, s in enumerate(starts.tolist())]
    rows.sort()
    assert windows.n_windows == 23 and (windows.epoch, windows.index) == (1, 0)
    assert [s for s, _ in rows] == [w * T for w in range(23)]
    decoded = "".join(meta["itos"][i] for i in rows[0][1] + [t for _, r in rows[1:] for t in r[1:]])
    with open(os.path.join(os.path.dirname(small_data_dir), "small.txt")) as f:
        assert decoded == f.read()[:23 * T + 1]


def test_epochs_differ_in_order_and_come_back_from_the_seed():
    windows = EpochWindows(1000, 10, seed=3)  # 99 windows
    first, second = windows.next(99).tolist(), windows.next(99).tolist()
    assert first != second and sorted(first) == sorted(second)
    again = EpochWindows(1000, 10, seed=3)
    assert again.next(198).tolist() == first + second
    assert EpochWindows(1000, 10, seed=4).next(99).tolist() != first
    assert EpochWindows(1000, 10, seed=-3).next(99).tolist() != first  # any integer seeds it


def test_the_draws_do_not_depend_on_how_they_are_split():
    """250 windows of 99 (two epochs and a half) drawn at once, in steps of 8, or in uneven pieces; and
    train.py's rule: each process draws the step's global batch, micro-step k of rank r reads rows
    (k * processes + r) * B onwards: their union is one process's batch on every split."""
    whole = EpochWindows(1000, 10, seed=0).next(250).tolist()
    for pieces in ([8] * 31 + [2], [1, 98, 2, 149], [250]):
        windows = EpochWindows(1000, 10, seed=0)
        assert sum((windows.next(n).tolist() for n in pieces), []) == whole
    global_batch, steps = 16, 5
    one_process = EpochWindows(1000, 10, seed=0).next(global_batch * steps).tolist()
    reference = torch.Generator().manual_seed(0)  # the language draws, as the one process makes them
    low = torch.cat([torch.rand(global_batch, generator=reference) < 0.5 for _ in range(steps)])
    for processes, B in [(1, 4), (2, 8), (2, 2), (4, 1), (16, 1)]:
        ranks = [EpochWindows(1000, 10, seed=0) for _ in range(processes)]  # one per process
        generators = [torch.Generator().manual_seed(0) for _ in range(processes)]
        seen = []
        for _ in range(steps):
            batches = [sample_windows(1000, 10, global_batch, g, 0.5, w) for g, w in zip(generators, ranks)]
            for k in range(global_batch // (processes * B)):
                for r in range(processes):
                    rows = slice((k * processes + r) * B, (k * processes + r + 1) * B)
                    seen.append((batches[r][0][rows], batches[r][1][rows]))
        assert torch.cat([starts for starts, _ in seen]).tolist() == one_process, (processes, B)
        assert torch.equal(torch.cat([is_low for _, is_low in seen]), low), (processes, B)


def test_a_saved_position_continues_exactly(tmp_path):
    windows = EpochWindows(1000, 10, seed=9)
    windows.next(130)  # epoch 1, window 31
    torch.save(windows.state_dict(), tmp_path / "position.pt")
    resumed = EpochWindows(1000, 10, seed=9)
    resumed.load_state_dict(torch.load(tmp_path / "position.pt", weights_only=True))
    assert (resumed.epoch, resumed.index) == (1, 31)
    assert resumed.next(200).tolist() == windows.next(200).tolist()
    with pytest.raises(DataError, match="saved over 99 windows but the training split now has 49"):
        EpochWindows(1000, 20, seed=9).load_state_dict(windows.state_dict())
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
