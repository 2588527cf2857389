"""losses.py against brute-force definitions on tiny tensors."""

import math

import pytest
import torch

from losses import cross_entropy, linear_cross_entropy, threshold_logits  # noqa: E402
from objective import Objective  # noqa: E402


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


# linear_cross_entropy: the LM head and cross-entropy in chunks ---------------------------------

def head_case(seed=0, N=23, C=6, V=13):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[2, N - 1]] = -1
    return h, weight, targets


@pytest.mark.parametrize("margin", [None, 0.0, 0.6, 2.0])
@pytest.mark.parametrize("chunk", [1, 5, 23, 100])
def test_linear_cross_entropy_equals_cross_entropy_on_the_whole_logits(margin, chunk):
    """Value against the brute-force loop; value and both gradients against cross_entropy of
    h @ weight^T, for chunks that divide N, do not, hold one row, or hold all."""
    h, weight, targets = head_case()
    got = linear_cross_entropy(h, weight, targets, margin=margin, chunk_size=chunk)
    whole = cross_entropy(h @ weight.t(), targets, margin=margin)
    assert got.item() == pytest.approx(brute_force_ce(h @ weight.t(), targets, margin), rel=1e-9)
    for a, b in zip(torch.autograd.grad(3 * got, (h, weight)), torch.autograd.grad(3 * whole, (h, weight))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_linear_cross_entropy_gradcheck():
    h, weight, targets = head_case(N=9, C=3, V=5)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_cross_entropy(h, w, targets, margin=0.6, chunk_size=4), (h, weight))
    assert torch.autograd.gradcheck(lambda h, w: linear_cross_entropy(h, w, targets, chunk_size=2), (h, weight))


def test_linear_cross_entropy_per_token_losses_and_batch_shape():
    """reduction='none' gives F.cross_entropy's per-position losses (0 where ignored); (B, T, C) input
    is the same as its flattened rows."""
    h, weight, targets = head_case()
    expected = torch.nn.functional.cross_entropy(h @ weight.t(), targets, ignore_index=-1, reduction="none")
    got = linear_cross_entropy(h, weight, targets, chunk_size=4, reduction="none")
    torch.testing.assert_close(got, expected.detach())
    assert not got.requires_grad
    batched = linear_cross_entropy(h[:22].view(2, 11, -1), weight, targets[:22].view(2, 11), chunk_size=7)
    assert batched.item() == pytest.approx(linear_cross_entropy(h[:22], weight, targets[:22]).item(), rel=1e-12)


def test_linear_cross_entropy_edge_cases():
    """All positions ignored: NaN, as F.cross_entropy's mean; bad arguments: one clear error."""
    h, weight, targets = head_case()
    assert math.isnan(linear_cross_entropy(h, weight, torch.full_like(targets, -1)).item())
    assert math.isnan(cross_entropy(h @ weight.t(), torch.full_like(targets, -1)).item())
    for kwargs, match in (({"chunk_size": 0}, "chunk_size"), ({"margin": -1.0}, "margin"),
                          ({"reduction": "sum"}, "reduction")):
        with pytest.raises(ValueError, match=match):
            linear_cross_entropy(h, weight, targets, **kwargs)


def test_linear_cross_entropy_under_bf16_autocast_is_close_to_the_whole_logits():
    """Under autocast the head's matmuls run in bf16 as the model's would; loss and gradients stay
    within bf16's rounding of the whole-logits path, and come back in the inputs' dtypes. The whole
    path runs after the chunked one in the same autocast region and still reaches the weight: the
    chunked forward, which runs without gradients, leaves no cast of it in autocast's cache (on
    torch 2.6 it did, and the later matmul lost the weight's gradient)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(64, 32, generator=g).requires_grad_()
    weight = (torch.randn(50, 32, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, 50, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, weight, targets, chunk_size=16)
        whole = cross_entropy(torch.nn.functional.linear(h, weight), targets)
    assert got.item() == pytest.approx(whole.item(), rel=1e-3)
    for a, b in zip(torch.autograd.grad(got, (h, weight)), torch.autograd.grad(whole, (h, weight))):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.02, atol=2e-3)


@pytest.mark.parametrize("margin", [None, 0.6])
def test_objective_with_ce_chunk_size_needs_no_logits_and_trains_the_same(margin):
    """Objective(ce_chunk_size=n): the model computes no logits; the CE term and the gradients of
    the model's weights (the tied head included) equal those of the whole logits."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=8)).double()
    x, y = torch.randint(0, 20, (3, 8)), torch.randint(0, 20, (3, 8))
    results = []
    for chunk in (0, 5):
        objective = Objective(2, 8, margin=margin, ce_chunk_size=chunk)
        assert objective.needs_logits == (chunk == 0) and objective.trains_head
        logits, hidden = model(x, return_hidden_states=True, compute_logits=objective.needs_logits)
        assert (logits is None) == bool(chunk)
        loss, terms = objective(logits, hidden, y, model.embeddings())
        model.zero_grad()
        loss.backward()
        results.append((terms["ce"].item(), [p.grad.clone() for p in model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="ce_chunk_size"):
        Objective(2, 8, ce_chunk_size=-1)
