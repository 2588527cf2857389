"""Representation losses (simreg, dispersion, nitp, cwt) against brute-force loops written
straight from the formulas in losses.py's docstrings (and the papers they cite), on tiny
float64 tensors: same value and same autograd gradient."""

import math

import pytest
import torch
from torch.nn import functional as F

from losses import cwt, dispersion, nitp, simreg  # noqa: E402


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def assert_same_value_and_grad(loss_fn, brute_fn, *inputs):
    """Both functions get their own leaf copies; values and input gradients must agree."""
    ours = [x.clone().requires_grad_() for x in inputs]
    theirs = [x.clone().requires_grad_() for x in inputs]
    value, expected = loss_fn(*ours), brute_fn(*theirs)
    assert torch.allclose(value, expected, rtol=1e-10, atol=1e-12), (value.item(), expected.item())
    for got, want in zip(torch.autograd.grad(value, ours), torch.autograd.grad(expected, theirs)):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)


def cos(a, b):
    return torch.dot(a, b) / (a.norm() * b.norm())


# ---------------------------------------------------------------------------------------- SimReg

def brute_simreg(h, labels, tau, chunk_size=None, ignore_index=-1):
    """Loop over sequences, chunks and anchors; group averaging with a dict of labels."""
    B, T, _ = h.shape
    step = T if chunk_size is None else chunk_size
    sequence_losses = []
    for b in range(B):
        for start in range(0, T, step):
            kept = [t for t in range(start, min(start + step, T)) if labels[b, t] != ignore_index]
            if not kept:
                continue  # a chunk with no valid position drops out
            per_label = {}
            for i in kept:
                y = labels[b, i].item()
                pos = [cos(h[b, i], h[b, j]) / tau for j in kept if labels[b, j] == y]
                neg = [cos(h[b, i], h[b, j]) / tau for j in kept if labels[b, j] != y]
                if neg:
                    token = F.softplus(torch.logsumexp(torch.stack(neg), 0) - torch.logsumexp(torch.stack(pos), 0))
                else:
                    token = h.sum() * 0
                per_label.setdefault(y, []).append(token)
            label_means = [torch.stack(v).mean() for v in per_label.values()]
            sequence_losses.append(torch.stack(label_means).mean())
    return torch.stack(sequence_losses).mean()


def simreg_example(seed=0, B=3, T=7, C=4, n_labels=3):
    h = randn(B, T, C, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    labels = torch.randint(0, n_labels, (B, T), generator=g)
    labels[0, 2] = labels[0, 5] = -1  # ignored positions
    labels[1] = 4                     # one label only: N_i empty everywhere
    labels[2, 0] = 9                  # a label that occurs once: P_i = {i}
    return h, labels


@pytest.mark.parametrize("tau", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("chunk_size", [None, 2, 3, 6, 7, 20])
def test_simreg_matches_brute_force(tau, chunk_size):
    h, labels = simreg_example()
    assert_same_value_and_grad(lambda x: simreg(x, labels, tau, chunk_size),
                               lambda x: brute_simreg(x, labels, tau, chunk_size), h)


def test_simreg_chunk_size_at_least_t_equals_full_loss():
    h, labels = simreg_example(seed=1)
    full = simreg(h, labels, tau=0.1)
    for c in (7, 8, 100):
        assert simreg(h, labels, tau=0.1, chunk_size=c).item() == full.item()
    assert simreg(h, labels, tau=0.1, chunk_size=3).item() != pytest.approx(full.item())
    with pytest.raises(ValueError, match="chunk_size"):
        simreg(h, labels, chunk_size=0)


def test_simreg_ignored_positions_drop_out():
    h, labels = simreg_example(seed=2)
    h.requires_grad_()
    loss = simreg(h, labels, tau=0.1)
    (grad,) = torch.autograd.grad(loss, h)
    assert (grad[0, 2] == 0).all() and (grad[0, 5] == 0).all()
    moved = h.detach().clone()
    moved[0, 2] = randn(4, seed=7) * 10
    moved[0, 5] = -moved[0, 5]
    assert simreg(moved, labels, tau=0.1).item() == pytest.approx(loss.item(), rel=1e-14)
    # sequence 0 alone with its ignored positions deleted gives its loss unchanged
    keep = [t for t in range(7) if labels[0, t] != -1]
    alone_with_ignored = simreg(h[:1].detach(), labels[:1], tau=0.1)
    deleted = simreg(h[:1, keep].detach(), labels[:1, keep], tau=0.1)
    assert deleted.item() == pytest.approx(alone_with_ignored.item(), rel=1e-12)
    assert deleted.item() == pytest.approx(brute_simreg(h[:1, keep].detach(), labels[:1, keep], 0.1).item(), rel=1e-12)


def test_simreg_fully_ignored_sequence_drops_out_of_the_average():
    h, labels = simreg_example(seed=3)
    labels[1] = -1
    both = simreg(h[:2], labels[:2], tau=0.1)
    assert both.item() == pytest.approx(simreg(h[:1], labels[:1], tau=0.1).item(), rel=1e-14)
    nothing = simreg(h.requires_grad_(), torch.full_like(labels, -1))
    assert nothing.item() == 0
    (grad,) = torch.autograd.grad(nothing, h)
    assert (grad == 0).all()


def test_simreg_single_label_sequence_is_zero_with_zero_gradient():
    h = randn(2, 6, 3, seed=4).requires_grad_()
    labels = torch.full((2, 6), 5)
    loss = simreg(h, labels)
    assert loss.item() == 0
    (grad,) = torch.autograd.grad(loss, h)
    assert (grad == 0).all()


def test_simreg_gradcheck_float64():
    h, labels = simreg_example(seed=5, B=3, T=6, C=3)
    h.requires_grad_()
    for chunk_size in (None, 4):
        assert torch.autograd.gradcheck(lambda x: simreg(x, labels, tau=0.5, chunk_size=chunk_size), (h,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_simreg_tau_001_logits_near_100_are_finite(dtype):
    # different labels on almost parallel and on opposite states: s_ij close to +-100
    base = torch.tensor([1.0, 0.5, -0.3, 2.0], dtype=dtype)
    noise = randn(3, 8, 4, seed=6).to(dtype) * 1e-3
    h = base + noise
    h[:, 1::2] *= -1
    labels = torch.arange(8).repeat(3, 1) % 3
    labels[1] = 2          # N_i empty
    labels[2, :5] = -1     # mostly ignored
    h.requires_grad_()
    loss = simreg(h, labels, tau=0.01)
    (grad,) = torch.autograd.grad(loss, h)
    assert torch.isfinite(loss) and loss.item() > 0.1  # parallel negatives: far from 0
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    if dtype == torch.float64:
        assert loss.item() == pytest.approx(brute_simreg(h.detach(), labels, 0.01).item(), rel=1e-10)


def test_simreg_bf16_autocast_gives_float32_close_to_fp32():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 16, 8, generator=g)
    w = torch.randn(8, 8, generator=g)
    labels = torch.randint(0, 4, (2, 16), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        assert h.dtype == torch.bfloat16
        loss = simreg(h, labels, tau=0.1)
    assert loss.dtype == torch.float32
    # computed from the very same bf16 states in float32: equal to float32 rounding
    assert loss.item() == pytest.approx(simreg(h.float(), labels, tau=0.1).item(), rel=1e-5)
    # and close to the all-fp32 pipeline (bf16 only rounds the states)
    assert loss.item() == pytest.approx(simreg(x @ w, labels, tau=0.1).item(), rel=5e-2)


# ------------------------------------------------------------------------------------ dispersion

EPS = 1e-4


def angular_distance(a, b):
    a_hat, b_hat = a / (a.norm() + EPS), b / (b.norm() + EPS)
    return torch.arccos(torch.dot(a_hat, b_hat).clamp(-1 + EPS, 1 - EPS)) / math.pi


def brute_dispersion_layer(z, tau, variant):
    B, T, C = z.shape
    pairs = [(i, j) for i in range(T) for j in range(T) if i != j]
    per_sequence = []
    for b in range(B):
        if variant == "angular":
            terms = torch.stack([-angular_distance(z[b, i], z[b, j]) / tau for i, j in pairs])
            per_sequence.append(torch.logsumexp(terms, 0) - math.log(T * (T - 1)))
        elif variant == "orthogonalization":
            per_sequence.append(torch.stack([
                torch.clamp(0.5 - angular_distance(z[b, i], z[b, j]), min=0) ** 2 for i, j in pairs]).mean())
        elif variant == "decorrelation":
            z_c = [(z[b, t] - z[b, t].mean()) / z[b, t].std(unbiased=True) for t in range(T)]
            per_sequence.append(torch.stack([(torch.dot(z_c[m], z_c[n]) / (C - 1)) ** 2 for m, n in pairs]).mean())
        elif variant == "decorrelation_features":  # channel by channel, over the sequence's tokens
            z_c = [(z[b, :, c] - z[b, :, c].mean()) / z[b, :, c].std(unbiased=True) for c in range(C)]
            per_sequence.append(torch.stack([(torch.dot(z_c[m], z_c[n]) / (T - 1)) ** 2
                                             for m in range(C) for n in range(C) if m != n]).mean())
        elif variant == "l2_repel":  # every ordered pair, i = j included
            terms = torch.stack([-((z[b, i] - z[b, j]) ** 2).sum() / C / tau for i in range(T) for j in range(T)])
            per_sequence.append(torch.logsumexp(terms, 0) - math.log(T * T) + 0.1 * (z[b] ** 2).mean())
    return torch.stack(per_sequence).mean()


VARIANTS = ["angular", "decorrelation", "decorrelation_features", "l2_repel", "orthogonalization"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_dispersion_matches_brute_force(variant, tau):
    z = randn(2, 6, 4, seed=10)
    assert_same_value_and_grad(lambda x: dispersion(x, tau, variant),
                               lambda x: brute_dispersion_layer(x, tau, variant), z)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dispersion_gradcheck_float64(variant):
    z = randn(2, 5, 4, seed=11).requires_grad_()
    with torch.no_grad():  # off-diagonal cosines well inside the clamp, away from the hinge at D = 1/2
        z_hat = F.normalize(z, dim=-1)
        cosines = (z_hat @ z_hat.transpose(1, 2))[:, ~torch.eye(5, dtype=torch.bool)]
        assert cosines.abs().max() < 0.99 and (cosines.abs() > 1e-3).all()
    assert torch.autograd.gradcheck(lambda x: dispersion(x, 1.0, variant), (z,))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "decorrelation_features"])
def test_dispersion_spread_states_score_lower_than_collapsed_ones(variant):
    # three zero-mean, mutually orthogonal rows of equal norm: orthogonal directions and
    # uncorrelated tokens; collapsed: the same row three times
    spread = torch.tensor([[[1., -1., 1., -1.], [1., 1., -1., -1.], [1., -1., -1., 1.]]], dtype=torch.float64)
    collapsed = spread[:, :1].expand(1, 3, 4)
    assert dispersion(spread, variant=variant) < dispersion(collapsed, variant=variant)
    if variant == "decorrelation":  # the two extremes: 0 and 1
        assert dispersion(spread, variant=variant).item() == pytest.approx(0, abs=1e-12)
        assert dispersion(collapsed, variant=variant).item() == pytest.approx(1, rel=1e-12)
    if variant == "orthogonalization":  # orthogonal pairs are left alone
        assert dispersion(spread, variant=variant).item() == pytest.approx(0, abs=1e-12)
    if variant == "angular":  # opposite beats orthogonal
        opposite = torch.stack([spread[:, 0], -spread[:, 0]], 1)
        assert dispersion(opposite) < dispersion(spread[:, :2])


def test_dispersion_list_of_layers_is_the_mean_of_layers_and_bf16_is_computed_in_float32():
    layers = [randn(2, 5, 4, seed=s) for s in (20, 21, 22)]
    for variant in VARIANTS:
        per_layer = torch.stack([dispersion(z, variant=variant) for z in layers]).mean()
        assert dispersion(layers, variant=variant).item() == pytest.approx(per_layer.item(), rel=1e-14)
        assert dispersion(tuple(layers), variant=variant).item() == pytest.approx(per_layer.item(), rel=1e-14)
    z16 = layers[0].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = dispersion([z16, z16])
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(dispersion(z16.double()).item(), rel=1e-5)


def test_dispersion_decorrelation_features_scores_correlated_channels_one_and_independent_ones_zero():
    """The text's form looks at channels, not tokens: states that move along one direction (every
    channel a multiple of the same sequence a_t) score 1, channels that are orthogonal zero-mean
    sequences score 0; a sequence whose states are all one point has no variance to correlate and
    scores 0 (the token form scores it 1): this form does not see that collapse."""
    a = torch.tensor([1., -2., 0.5, 3., -1.], dtype=torch.float64)
    along_one_direction = (a[:, None] * torch.tensor([1., -3., 2.], dtype=torch.float64))[None]
    assert dispersion(along_one_direction, variant="decorrelation_features").item() == pytest.approx(1, rel=1e-12)
    independent = torch.tensor([[[1., 1.], [-1., 1.], [1., -1.], [-1., -1.]]], dtype=torch.float64)
    assert dispersion(independent, variant="decorrelation_features").item() == pytest.approx(0, abs=1e-12)
    one_point = torch.tensor([1., -1., 2.], dtype=torch.float64).expand(1, 4, 3)
    assert dispersion(one_point, variant="decorrelation_features").item() == 0
    assert dispersion(one_point, variant="decorrelation").item() == pytest.approx(1, rel=1e-12)


def test_dispersion_rejects_unknown_variant_and_bad_input():
    z = randn(1, 4, 3)
    with pytest.raises(ValueError, match="angular.*decorrelation.*l2_repel.*orthogonalization"):
        dispersion(z, variant="uniformity")
    with pytest.raises(ValueError):
        dispersion([])
    with pytest.raises(ValueError, match="T >= 2"):
        dispersion(randn(2, 1, 3))


def released_distance(a, b):
    """The authors' released angular distance of two states, one pair at a time: norms + 1e-2, the
    cosine clamped to [-0.75, 0.75] in value only. The clamp is a constant shift of the cosine
    (clamped value minus the value, a plain float), so the gradient is that of the unclamped cosine:
    straight-through, written without losses.py's detach."""
    cosine = torch.dot(a / (a.norm() + 1e-2), b / (b.norm() + 1e-2))
    clamped = min(0.75, max(-0.75, cosine.item()))
    return torch.arccos(cosine + (clamped - cosine.item())) / math.pi


def brute_dispersion_layer_authors(z, tau, variant):
    """The released code's formulas (ChenLiu-1996/LM-Dispersion, lm_dispersion/dispersion.py, as
    docs/fidelity.md states them), pair by pair, for T <= 256."""
    B, T, C = z.shape
    pairs = [(i, j) for i in range(T) for j in range(T) if i != j]
    per_sequence = []
    for b in range(B):
        if variant == "angular":  # log of the mean over i != j of exp(-D/tau + 1e-2)
            terms = [torch.exp(-released_distance(z[b, i], z[b, j]) / tau + 1e-2) for i, j in pairs]
            per_sequence.append(torch.log(torch.stack(terms).sum() / len(pairs)))
        elif variant == "orthogonalization":
            hinge = [torch.clamp(0.5 - released_distance(z[b, i], z[b, j]), min=0) ** 2 for i, j in pairs]
            per_sequence.append(torch.stack(hinge).mean())
        elif variant == "l2_repel":  # raw squared distances (not / C), all T^2 pairs, i = j included
            terms = [torch.exp(-((z[b, i] - z[b, j]) ** 2).sum() / tau + 1e-2) for i in range(T) for j in range(T)]
            per_sequence.append(torch.log(torch.stack(terms).sum() / T ** 2) + 0.1 * (z[b] ** 2).mean())
    return torch.stack(per_sequence).mean()


def condensed(B=2, T=8, C=16, spread=0.1, seed=13):
    """States of each sequence near one shared direction: pair cosines around 0.99."""
    return randn(C, seed=seed) + spread * randn(B, T, C, seed=seed + 1)


def pair_cosines(z):
    z_hat = F.normalize(z, dim=-1)
    T = z.size(1)
    return (z_hat @ z_hat.transpose(1, 2))[:, ~torch.eye(T, dtype=torch.bool)]


@pytest.mark.parametrize("variant", ["angular", "l2_repel", "orthogonalization"])
@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_dispersion_authors_form_matches_the_released_formulas(variant, tau):
    # half of the batch condensed (every cosine clamped), half random (some clamped, most not)
    z = torch.cat([condensed(B=1, T=6, C=4, spread=0.3), randn(1, 6, 4, seed=10)])
    clamped = pair_cosines(z).abs() > 0.75
    assert clamped.any() and not clamped.all(), "the example must exercise both sides of the clamp"
    assert_same_value_and_grad(lambda x: dispersion(x, tau, variant, form="authors"),
                               lambda x: brute_dispersion_layer_authors(x, tau, variant), z)
    # and it is another loss than the paper's form on the same states
    assert not torch.allclose(dispersion(z, tau, variant, form="authors"), dispersion(z, tau, variant))


@pytest.mark.parametrize("variant", ["angular", "l2_repel", "orthogonalization"])
def test_dispersion_authors_form_gradcheck_where_the_clamp_is_inactive(variant):
    z = randn(2, 5, 16, seed=14).requires_grad_()
    cosines = pair_cosines(z.detach())
    assert cosines.abs().max() < 0.75 and (cosines.abs() > 1e-3).all()  # no clamp, away from the hinge
    assert torch.autograd.gradcheck(lambda x: dispersion(x, 1.0, variant, form="authors"), (z,))


def test_dispersion_decorrelation_is_the_same_in_both_forms():
    z = torch.cat([condensed(B=1, T=6, C=4), randn(1, 6, 4, seed=15)])
    values, grads = [], []
    for form in ("paper", "authors"):
        x = z.clone().requires_grad_()
        values.append(dispersion(x, 1.0, "decorrelation", form=form))
        grads.append(torch.autograd.grad(values[-1], x)[0])
    assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1])


def test_dispersion_authors_form_uses_256_random_positions_when_t_is_longer():
    """T > 256: the loss of the 256 positions torch.randperm draws (per layer, the same for every
    sequence) under the generator's state at the call; T = 256 uses every position."""
    layers = [randn(2, 300, 4, seed=16), randn(2, 300, 4, seed=17)]
    torch.manual_seed(3)
    value = dispersion(layers, form="authors")
    torch.manual_seed(3)
    drawn = [z[:, torch.randperm(300)[:256]] for z in layers]
    expected = torch.stack([dispersion(z, form="authors") for z in drawn]).mean()
    assert value.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.manual_seed(4)
    assert dispersion(layers, form="authors").item() != pytest.approx(value.item(), rel=1e-9)  # another draw
    assert dispersion(layers).item() != pytest.approx(value.item(), rel=1e-3)  # the paper's form: all 300
    first = [z[:, :256] for z in layers]
    torch.manual_seed(3)
    at_256 = dispersion(first, form="authors")
    torch.manual_seed(4)
    assert torch.equal(at_256, dispersion(first, form="authors"))  # no draw at T = 256


def test_dispersion_paper_form_pushes_condensed_states_several_times_harder():
    """What the docstring claims: on condensed states (cosines ~0.99) the paper's clamp near 1 keeps
    arccos' steep slope, the released value clamp at 0.75 with straight-through does not."""
    z = condensed()
    assert pair_cosines(z).min() > 0.95
    ratios = {}
    for variant in ("angular", "orthogonalization"):
        norms = []
        for form in ("paper", "authors"):
            x = z.clone().requires_grad_()
            norms.append(torch.autograd.grad(dispersion(x, 1.0, variant, form=form), x)[0].norm().item())
        ratios[variant] = norms[0] / norms[1]
    assert ratios["angular"] > 3 and ratios["orthogonalization"] > 3, ratios  # measured 5.7 and 9.8
    # on random states (cosines spread around 0) the two forms point the same way
    x = [randn(2, 8, 16, seed=18).requires_grad_() for _ in range(2)]
    g = [torch.autograd.grad(dispersion(xi, 1.0, "angular", form=f), xi)[0].flatten()
         for xi, f in zip(x, ("paper", "authors"))]
    assert F.cosine_similarity(g[0], g[1], dim=0) > 0.99


def test_dispersion_form_is_checked_by_the_function_objective_and_configurator():
    from configurator import ConfigError, check_values, parse_config, train_defaults, train_rules
    from objective import Objective
    with pytest.raises(ValueError, match="unknown dispersion form 'released'; valid: paper, authors"):
        dispersion(randn(1, 4, 3), form="released")
    with pytest.raises(ValueError, match="key 'dispersion_form' must be one of paper, authors, got 'released'"):
        Objective(2, 8, dispersion_weight=0.1, dispersion_form="released")
    with pytest.raises(ConfigError, match="key 'dispersion_form' must be one of paper, authors, got 'released'"):
        check_values(parse_config(["--dispersion_form=released"], train_defaults()), train_rules())


# ------------------------------------------------------------------------------------------ NITP

def brute_nitp(pred, shallow):
    B, T, _ = pred.shape
    terms = [1 - cos(pred[b, t], shallow[b, t + 1].detach()) for b in range(B) for t in range(T - 1)]
    return torch.stack(terms).mean()


def test_nitp_matches_brute_force_and_gradchecks():
    pred, shallow = randn(2, 6, 4, seed=30), randn(2, 6, 4, seed=31)
    assert_same_value_and_grad(lambda p: nitp(p, shallow), lambda p: brute_nitp(p, shallow), pred)
    assert torch.autograd.gradcheck(lambda p: nitp(p, shallow), (pred.clone().requires_grad_(),))
    # pred equal to the next shallow state (up to scale) costs nothing
    aligned = torch.cat([shallow[:, 1:] * 3, randn(2, 1, 4)], 1)
    assert nitp(aligned, shallow).item() == pytest.approx(0, abs=1e-12)


def test_nitp_stops_gradient_to_shallow_and_last_position_gets_none():
    pred = randn(2, 5, 3, seed=32).requires_grad_()
    shallow = randn(2, 5, 3, seed=33).requires_grad_()
    pred_grad, shallow_grad = torch.autograd.grad(nitp(pred, shallow), [pred, shallow], allow_unused=True)
    assert shallow_grad is None
    assert (pred_grad[:, -1] == 0).all()
    assert (pred_grad[:, :-1].abs().sum(-1) > 0).all()
    with pytest.raises(ValueError, match="T >= 2"):
        nitp(pred[:, :1], shallow[:, :1])


# ------------------------------------------------------------------------------------------- CWT

def brute_cwt(h, targets, wte, ignore_index=-1, tau=1.0):
    """Loop over valid positions n: -log softmax_m(h_n . e_{y_m} / tau)[n], m over valid positions."""
    flat_h, flat_y = h.reshape(-1, h.size(-1)), targets.reshape(-1).tolist()
    valid = [n for n, y in enumerate(flat_y) if y != ignore_index]
    losses = []
    for n in valid:
        scores = torch.stack([torch.dot(flat_h[n], wte[flat_y[m]]) / tau for m in valid])
        losses.append(torch.logsumexp(scores, 0) - torch.dot(flat_h[n], wte[flat_y[n]]) / tau)
    return torch.stack(losses).mean()


def test_cwt_with_distinct_targets_is_cross_entropy_on_the_diagonal():
    h, wte = randn(2, 3, 4, seed=40), randn(10, 4, seed=41)
    targets = torch.randperm(10, generator=torch.Generator().manual_seed(42))[:6].reshape(2, 3)
    H, E = h.reshape(6, 4), wte[targets.reshape(-1)]
    expected = F.cross_entropy(H @ E.T, torch.arange(6))
    assert cwt(h, targets, wte).item() == pytest.approx(expected.item(), rel=1e-12)


def test_cwt_repeated_targets_stay_in_the_denominator():
    h, wte = randn(2, 5, 4, seed=43), randn(3, 4, seed=44)
    targets = torch.tensor([[0, 1, 0, 2, 0], [1, 1, 2, 0, 2]])
    assert_same_value_and_grad(lambda x, w: cwt(x, targets, w), lambda x, w: brute_cwt(x, targets, w), h, wte)
    # masking the same-token positions would give a different (smaller) loss
    H, E = h.reshape(10, 4), wte[targets.reshape(-1)]
    same = targets.reshape(-1, 1) == targets.reshape(1, -1)
    masked = (H @ E.T).masked_fill(same & ~torch.eye(10, dtype=torch.bool), float("-inf"))
    assert F.cross_entropy(masked, torch.arange(10)) < cwt(h, targets, wte)


def test_cwt_ignored_positions_drop_out():
    h, wte = randn(2, 4, 3, seed=45), randn(6, 3, seed=46)
    targets = torch.tensor([[0, -1, 5, 2], [-1, 3, 3, 1]])
    assert_same_value_and_grad(lambda x, w: cwt(x, targets, w), lambda x, w: brute_cwt(x, targets, w), h, wte)
    valid = targets != -1
    expected = F.cross_entropy(h[valid] @ wte[targets[valid]].T, torch.arange(int(valid.sum())))
    assert cwt(h, targets, wte).item() == pytest.approx(expected.item(), rel=1e-12)
    moved = h.clone()
    moved[~valid] = 100.0
    assert cwt(moved, targets, wte).item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.autograd.gradcheck(lambda x, w: cwt(x, targets, w),
                                    (h.clone().requires_grad_(), wte.clone().requires_grad_()))
    nothing = cwt(h, torch.full_like(targets, -1), wte)
    assert nothing.item() == 0


@pytest.mark.parametrize("tau", [0.1, 3.0])
def test_cwt_temperature_divides_the_logits(tau):
    """cwt_tau: the headless authors' released cwt_loss divides the dot products by a temperature."""
    h, wte = randn(2, 4, 3, seed=49), randn(5, 3, seed=50)
    targets = torch.tensor([[0, 1, 1, -1], [4, 0, 2, 3]])
    assert_same_value_and_grad(lambda x, w: cwt(x, targets, w, tau=tau),
                               lambda x, w: brute_cwt(x, targets, w, tau=tau), h, wte)
    assert cwt(h, targets, wte, tau=tau).item() != pytest.approx(cwt(h, targets, wte).item(), rel=1e-3)
    assert torch.autograd.gradcheck(lambda x: cwt(x, targets, wte, tau=tau), (h.clone().requires_grad_(),))
    from configurator import ConfigError, check_values, parse_config, train_defaults, train_rules
    from objective import Objective
    total, terms = Objective(1, 3, ce_weight=0.0, cwt_weight=1.0, cwt_tau=tau)(None, [h, h, h], targets, {"input": wte})
    assert torch.equal(terms["cwt"], cwt(h, targets, wte, tau=tau))
    assert train_defaults()["cwt_tau"] == 1.0
    with pytest.raises(ConfigError, match="key 'cwt_tau' must be a finite number > 0, got 0"):
        check_values(parse_config(["--cwt_tau=0"], train_defaults()), train_rules())


def test_cwt_bf16_autocast_gives_float32():
    h, wte = randn(2, 4, 8, seed=47).float(), randn(5, 8, seed=48).float()
    targets = torch.tensor([[0, 1, 2, 3], [4, 0, 1, -1]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cwt(h.bfloat16(), targets, wte)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(cwt(h.bfloat16().float(), targets, wte).item(), rel=1e-5)


def test_objective_is_the_weighted_sum_of_the_plain_functions():
    from losses import cross_entropy, dispersion, nitp, simreg
    from objective import Objective
    torch.manual_seed(0)
    B, T, C, V, L = 2, 6, 8, 11, 3
    hidden = [torch.randn(B, T, C, dtype=torch.float64) for _ in range(L + 2)]
    logits = torch.randn(B, T, V, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T))
    objective = Objective(L, C, ce_weight=1.0, margin=2.0, simreg_weight=3.0, dispersion_weight=0.5,
                          dispersion_layers="last", nitp_weight=2.0).double()
    total, terms = objective(logits, hidden, targets, embeddings={})
    expected = {"ce": cross_entropy(logits, targets, margin=2.0), "simreg": simreg(hidden[-1], targets),
                "dispersion": dispersion(hidden[L]),
                "nitp": nitp(objective.nitp_head(hidden[-1]), hidden[max(1, round(0.2 * L))])}
    assert terms.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(terms[name], expected[name], atol=1e-12), name
    assert torch.allclose(total, expected["ce"] + 3 * expected["simreg"] + 0.5 * expected["dispersion"]
                          + 2 * expected["nitp"], atol=1e-12)
    assert objective.needs_logits and not Objective(L, C, ce_weight=0.0, cwt_weight=1.0).needs_logits
    assert sum(p.numel() for p in objective.parameters()) == 3 * C * 4 * C  # the SwiGLU head C -> 4C -> C


def test_objective_adds_the_router_loss_of_a_mixture_of_experts():
    """Mixtral's load-balancing term comes into the total through Objective, with weight moe_aux_weight,
    only when the config has experts; a dense model's router_loss (None) changes nothing."""
    from losses import cross_entropy
    from objective import Objective
    torch.manual_seed(0)
    B, T, C, V, L = 2, 5, 8, 11, 2
    hidden = [torch.randn(B, T, C, dtype=torch.float64) for _ in range(L + 2)]
    logits, targets = torch.randn(B, T, V, dtype=torch.float64), torch.randint(0, V, (B, T))
    router_loss = torch.tensor(1.7, dtype=torch.float64)
    ce = cross_entropy(logits, targets)
    total, terms = Objective(L, C, moe_aux_weight=0.02)(logits, hidden, targets, {}, router_loss=router_loss)
    assert terms.keys() == {"ce", "moe_aux"} and torch.equal(total, ce + 0.02 * router_loss)
    assert Objective(L, C, moe_aux_weight=0.02)(logits, hidden, targets, {})[1].keys() == {"ce"}
    switched_off = Objective(L, C, moe_aux_weight=0.0)
    assert switched_off(logits, hidden, targets, {}, router_loss=router_loss)[1].keys() == {"ce"}
    config = dict(n_layer=L, n_embd=C, moe_aux_weight=0.02)
    assert Objective.from_config({**config, "n_expert": 8}).config.moe_aux_weight == 0.02
    assert Objective.from_config({**config, "n_expert": 1}).config.moe_aux_weight == 0.0


def test_l2_repel_is_bounded_below_as_states_grow_apart():
    """With the diagonal in the log-mean-exp the repulsion cannot fall below -log T: states
    scaled up (further apart) approach that floor, and the norm term then makes the loss rise,
    so growing the states is not a way to drive the loss to minus infinity."""
    T = 6
    z = randn(1, T, 4, seed=12)
    repulsion = [dispersion(z * s, 1.0, "l2_repel").item() - 0.1 * (z * s).square().mean().item()
                 for s in (1.0, 10.0, 100.0)]
    assert all(r >= -math.log(T) - 1e-9 for r in repulsion)
    assert abs(repulsion[-1] + math.log(T)) < 1e-6                 # at the floor
    losses = [dispersion(z * s, 1.0, "l2_repel").item() for s in (10.0, 100.0, 1000.0)]
    assert losses[0] < losses[1] < losses[2]


def test_released_l2_repel_self_distance_adds_no_rounding_noise_to_the_gradient():
    """Without the /C the released l2_repel's repulsion is exp(-2C)-small on spread states, so its gradient
    is the norm term's alone. A state's distance to itself is set to 0, not computed as |a|^2 + |a|^2 - 2a.a:
    the computed one left float32 rounding noise in the gradient 1e-4 of its size (5 times the whole gradient
    in a TF32 backward on CUDA, tools/gpu_check.py), now float32's own rounding."""
    torch.manual_seed(0)
    z = torch.randn(4, 256, 256, dtype=torch.float64)
    exact = 0.1 * 2 * z / z.numel()  # d/dz of 0.1 mean(z^2); the repulsion adds ~exp(-512)
    z32 = z.float().requires_grad_()
    dispersion([z32], 1.0, "l2_repel", form="authors").backward()
    assert ((z32.grad.double() - exact).norm() / exact.norm()).item() < 1e-6


def brute_l2_repel_norm(layers):
    """l2_repel's norm term alone: 0.1 times the mean of z^2 over sequences, positions and
    channels, a loop over every entry; then the mean over layers."""
    per_layer = []
    for z in layers:
        B, T, C = z.shape
        total = sum(z[b, t, c] ** 2 for b in range(B) for t in range(T) for c in range(C))
        per_layer.append(0.1 * total / (B * T * C))
    return torch.stack(per_layer).mean()


@pytest.mark.parametrize("form", ["paper", "authors"])
def test_l2_repel_norm_is_the_norm_term_alone_in_both_forms(form):
    layers = [randn(2, 5, 4, seed=s) for s in (40, 41)]
    assert_same_value_and_grad(lambda *x: dispersion(list(x), 1.0, "l2_repel_norm", form),
                               lambda *x: brute_l2_repel_norm(x), *layers)


def test_released_l2_repel_on_states_far_apart_is_its_norm_term_plus_a_constant():
    """Issue 40's question, on states whose pairwise squared distances are in the thousands: in
    float32 every exp(-|z_i - z_j|^2) underflows to 0, so the released l2_repel is its norm term
    plus log(T e^0.01 / T^2) (the T diagonal terms), and its gradient is the norm term's (to float32
    rounding; the diagonal's distances are set to exactly 0)."""
    T = 6
    z = (10 * randn(2, T, 16, seed=42)).float()
    with torch.no_grad():
        gaps = torch.cdist(z, z).square()[:, ~torch.eye(T, dtype=torch.bool)]
        assert gaps.min() > 200  # exp(-200) is far below float32's smallest number
    full, norm = z.clone().requires_grad_(), z.clone().requires_grad_()
    value_full = dispersion(full, 1.0, "l2_repel", "authors")
    value_norm = dispersion(norm, 1.0, "l2_repel_norm", "authors")
    assert value_full.item() == pytest.approx(value_norm.item() + 1e-2 - math.log(T), rel=1e-4)
    value_full.backward(), value_norm.backward()
    assert torch.allclose(full.grad, norm.grad, rtol=1e-4, atol=1e-6)
    # against states close together, where the repulsion does act: the gradients differ
    near = (0.1 * randn(2, T, 16, seed=42)).float()
    full, norm = near.clone().requires_grad_(), near.clone().requires_grad_()
    dispersion(full, 1.0, "l2_repel", "authors").backward(), dispersion(norm, 1.0, "l2_repel_norm", "authors").backward()
    assert not torch.allclose(full.grad, norm.grad, rtol=1e-2)


def test_repulsion_measure_against_a_loop_over_the_released_formula():
    """tools.repulsion (issue 40, T6): |gradient of the released l2_repel's repulsion| / |gradient of
    its norm term|, against autograd through a float64 loop over the pairs of each sequence; 0 on
    states as far apart as unit-variance ones, large where two states of a sequence nearly meet."""
    from tools.repulsion import repulsion_to_norm

    def brute(z):
        z = z.double().detach().requires_grad_()
        B, T, C = z.shape
        repulsion = sum(torch.logsumexp(torch.stack([-(z[b, i] - z[b, j]).square().sum() + 1e-2
                                                     for i in range(T) for j in range(T)]), 0)
                        - 2 * math.log(T) for b in range(B)) / B
        norm = 0.1 * sum(z[b, t, c] ** 2 for b in range(B) for t in range(T) for c in range(C)) / z.numel()
        g_rep, = torch.autograd.grad(repulsion, z)
        g_norm, = torch.autograd.grad(norm, z)
        return (g_rep.norm() / g_norm.norm()).item()

    far = 10 * randn(2, 5, 8, seed=3)
    assert repulsion_to_norm(far) == 0.0 and brute(far) < 1e-30
    near = randn(2, 5, 8, seed=4)
    near[:, 1] = near[:, 0] + 0.1 * randn(2, 8, seed=5)  # one pair almost meets in each sequence
    assert repulsion_to_norm(near) == pytest.approx(brute(near), rel=1e-4) and brute(near) > 1
