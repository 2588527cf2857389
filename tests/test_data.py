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
