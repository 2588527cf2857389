"""
Every training loss of this repository, each one plain function: tensors in, scalar out.

A loss never reaches into the model. The model returns logits and hidden states (model.py);
train.py calls the functions here and adds them up with the weights a config names.
Formulas, defaults and edge cases are pinned down in SPEC.md; each docstring repeats them.
"""

import torch
from torch.nn import functional as F


def threshold_logits(logits, targets, margin, ignore_index=-1):
    """Stop Jostling's logit thresholding (Turumtaev 2024, Sec. 3).

        threshold_t = z_t[y_t] - margin
        z_t[i] -> -inf   wherever z_t[i] < threshold_t

    A non-target whose probability is already below p(target) * e^-margin is removed from the
    softmax, so cross-entropy stops pushing its embedding away from this context ("non-target
    marginalization"): it receives exactly zero gradient from this position. The target always
    survives (margin >= 0), and its gradient keeps the usual form p - 1, with p now the softmax
    over the surviving logits. Training only: evaluation never thresholds.

    logits (..., V), targets (...) with ignore_index marking positions left untouched.
    The comparison has no gradient, so detaching the threshold or not changes nothing.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0 (a negative margin would remove the target), got {margin}")
    valid = targets != ignore_index
    target_logit = logits.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1))
    below = (logits < target_logit - margin) & valid.unsqueeze(-1)
    return logits.masked_fill(below, float("-inf"))


def cross_entropy(logits, targets, ignore_index=-1, margin=None):
    """Mean next-token cross-entropy over positions whose target is not ignore_index.

        L = mean_t [ logsumexp_i z_t[i] - z_t[y_t] ]

    With `margin` (a float >= 0), the logits are first thresholded as in threshold_logits
    (Stop Jostling; the paper's margins 8, 4, 2, 1, 0.6). Default None: plain cross-entropy.
    Half-precision (bf16/fp16 autocast) logits are upcast to float32 before the softmax.
    logits (..., V), targets (...).
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # upcast half precision; float64 stays float64
    if margin is not None:
        logits = threshold_logits(logits, targets, margin, ignore_index)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=ignore_index)
