"""train.py's evaluation (scoring.validation_losses) against a loop over windows and positions."""
import contextlib
import math

import numpy as np
import pytest
import torch

from data import read_windows, sample_windows
from scoring import validation_losses
from objective import Objective
from model import GPT, GPTConfig


def loop_nll(model, x, y):
    """Mean next-token negative log-likelihood of one window, position by position."""
    with torch.no_grad():
        logits = model(x.unsqueeze(0))[0]
    return sum(math.log(sum(math.exp(v) for v in logits[t].tolist())) - logits[t, y[t]].item()
               for t in range(len(y))) / len(y)


@pytest.mark.parametrize("shift,ce_chunk_size,simreg", [(0, 0, 0.0), (20, 0, 0.0), (0, 5, 0.0), (20, 5, 1.0)])
def test_validation_losses_match_a_loop(shift, ce_chunk_size, simreg):
    """val_high / val_low: mean over the eval windows of each window's mean NLL in that language;
    val: each window in the language its (fixed) draw picked, as in training. ce_chunk_size: the
    same figures from the head and the loss in chunks (no logits), beside another term."""
    torch.manual_seed(0)
    vocab, block, batch, iters, prob = 20, 8, 3, 2, 0.5
    model = GPT(GPTConfig(vocab_size=vocab + shift, block_size=block, n_layer=1, n_head=2, n_embd=8))
    val_data = np.random.default_rng(0).integers(0, vocab, 200).astype(np.uint16)
    objective = Objective(1, 8, ce_chunk_size=ce_chunk_size, simreg_weight=simreg)
    out = validation_losses(model, objective, val_data, batch, block, iters, shift, prob if shift else 0.0,
                            "cpu", contextlib.nullcontext())
    generator = torch.Generator().manual_seed(0)  # the draw validation_losses makes
    high, low, mixed = [], [], []
    for _ in range(iters):
        starts = sample_windows(len(val_data), block, batch, generator)
        x, y = read_windows(val_data, *starts, block, shift)
        is_low = (torch.rand(batch, generator=generator) < prob).tolist()
        for i in range(batch):
            high.append(loop_nll(model, x[i], y[i]))
            if shift:
                low.append(loop_nll(model, x[i] + shift, y[i] + shift))
            mixed.append(low[-1] if shift and is_low[i] else high[-1])
    assert out["val_high"] == pytest.approx(np.mean(high), rel=1e-5)
    assert out["val"] == pytest.approx(np.mean(mixed), rel=1e-5)
    if shift:
        assert out["val_low"] == pytest.approx(np.mean(low), rel=1e-5)
    assert ("val_simreg" in out) == bool(simreg)
