"""losses.py against brute-force definitions on tiny tensors."""

import math

import pytest
import torch

from losses import cross_entropy, threshold_logits  # noqa: E402


def brute_force_ce(logits, targets, margin=None, ignore_index=-1):
    """Loop over positions: drop logits below z[y] - margin, then -log softmax at the target."""
    total, count = 0.0, 0
    for z, y in zip(logits.tolist(), targets.tolist()):
        if y == ignore_index:
            continue
        kept = [v for v in z if margin is None or v >= z[y] - margin]
        total += math.log(sum(math.exp(v) for v in kept)) - z[y]
        count += 1
    return total / count


@pytest.mark.parametrize("margin", [None, 0.0, 0.6, 2.0, 8.0])
def test_cross_entropy_matches_brute_force(margin):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 11, (7,), generator=g)
    targets[2] = -1
    got = cross_entropy(logits, targets, margin=margin)
    assert got.item() == pytest.approx(brute_force_ce(logits, targets, margin), rel=1e-6)


def test_no_margin_is_plain_cross_entropy_and_3d_input_works():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 9, generator=g)
    targets = torch.randint(0, 9, (2, 5), generator=g)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 9), targets.reshape(-1))
    assert torch.allclose(cross_entropy(logits, targets), expected)


def test_threshold_logits_masks_exactly_the_logits_below_target_minus_margin():
    logits = torch.tensor([[3.0, 2.5, 1.9, 2.0, -5.0]])
    targets = torch.tensor([0])
    out = threshold_logits(logits, targets, margin=1.0)  # threshold 2.0: 2.0 itself survives
    assert out[0].tolist() == [3.0, 2.5, float("-inf"), 2.0, float("-inf")]
    # the target survives any margin >= 0, even when it is the smallest logit
    out = threshold_logits(torch.tensor([[1.0, 5.0, 9.0]]), torch.tensor([0]), margin=0.0)
    assert out[0, 0] == 1.0 and torch.isfinite(out).sum() == 3
    with pytest.raises(ValueError, match="margin"):
        threshold_logits(logits, targets, margin=-0.1)


def test_ignored_positions_are_not_thresholded():
    logits = torch.tensor([[3.0, -9.0], [0.0, -9.0]])
    out = threshold_logits(logits, torch.tensor([0, -1]), margin=1.0)
    assert out[1].tolist() == [0.0, -9.0]


def test_thresholded_non_targets_get_exactly_zero_gradient_and_target_gradient_keeps_its_form():
    g = torch.Generator().manual_seed(2)
    N, V, margin = 6, 10, 1.0
    logits = (torch.randn(N, V, generator=g, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    cross_entropy(logits, targets, margin=margin).backward()
    z = logits.detach()
    below = z < z.gather(1, targets[:, None]) - margin
    assert below.any(), "the example must threshold something"
    assert (logits.grad[below] == 0).all()  # exactly zero, not small
    # surviving logits: gradient (softmax over survivors - onehot) / N, the usual CE form
    survivors = z.masked_fill(below, float("-inf"))
    expected = (torch.softmax(survivors, dim=1) - torch.nn.functional.one_hot(targets, V)) / N
    assert torch.allclose(logits.grad, expected, atol=1e-12)
    target_grad = logits.grad.gather(1, targets[:, None]).squeeze(1)
    only_target_left = (~below).sum(1) == 1  # p(target) = 1 among survivors: loss and gradient 0
    assert only_target_left.any() and (target_grad[only_target_left] == 0).all()
    assert (target_grad[~only_target_left] < 0).all()  # otherwise the target is still pulled up


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=g)
    targets[0] = -1
    # margin 3 keeps every logit far from the threshold boundary, where the loss is not smooth
    for margin in (None, 3.0):
        assert torch.autograd.gradcheck(lambda z: cross_entropy(z, targets, margin=margin), (logits,))


def test_bf16_logits_are_computed_in_float32():
    logits = torch.randn(4, 130).bfloat16()
    targets = torch.randint(0, 130, (4,))
    loss = cross_entropy(logits, targets, margin=0.6)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(brute_force_ce(logits.float(), targets, 0.6), rel=1e-5)


def test_all_positions_ignored_gives_nan_like_torch():
    logits = torch.randn(2, 5)
    assert torch.isnan(cross_entropy(logits, torch.tensor([-1, -1])))
