"""optim.AdaGC (the SimReg paper's clipping, App. A.1) against a plain loop over its definition,
tensor by tensor, on hand-made gradients: the global warm-up phase, the per-tensor phase, a spike
in one tensor, a tensor without a gradient, and a state round trip."""

import math

import pytest
import torch

from optim import AdaGC  # noqa: E402

SHAPES = [(3, 4), (5,), (2, 2, 2)]


def brute_force(steps, max_norm, beta, rel, warmup):
    """The definition with Python floats, one tensor at a time. steps: per step a list of
    gradients (None = no gradient). Returns the clipped gradients and the EMAs after each step."""
    ema = [math.inf] * len(steps[0])
    clipped_steps, emas = [], []
    for t, grads in enumerate(steps):
        norms = [None if g is None else math.sqrt(sum(v * v for v in g.flatten().tolist())) for g in grads]
        clipped = []
        if t < warmup:  # global clipping; the EMA is the running minimum of the clipped norms
            total = math.sqrt(sum(n * n for n in norms if n is not None))
            coef = min(1.0, max_norm / (total + 1e-6))
            for i, (g, n) in enumerate(zip(grads, norms)):
                clipped.append(None if g is None else g * coef)
                if g is not None:
                    ema[i] = min(ema[i], n * coef)
        else:  # each tensor against rel x its own EMA, which then takes in the clipped norm
            for i, (g, n) in enumerate(zip(grads, norms)):
                if g is None:
                    clipped.append(None)
                    continue
                scale = rel * ema[i] / n if n > rel * ema[i] else 1.0
                clipped.append(g * scale)
                ema[i] = beta * ema[i] + (1 - beta) * n * scale
        clipped_steps.append(clipped)
        emas.append(list(ema))
    return clipped_steps, emas


BASE = [0.3, 0.2, 0.4]                        # each tensor's gradient norm at factor 1 (total 0.539)
FACTOR = [1.0, 0.8, 0.9, 0.8, 0.82, 0.8, 0.8, 1.2]  # per step; warm-up = steps 0-2, its minimum 0.8


def hand_made_steps():
    """Fixed random directions, norms BASE x FACTOR: after the warm-up each EMA is 0.8 BASE, steps
    3-6 stay under 1.04 x that, step 7 is above it everywhere; at step 5 tensor 0 spikes 20x and
    at step 6 tensor 2 has no gradient."""
    generator = torch.Generator().manual_seed(0)
    directions = [torch.randn(shape, generator=generator) for shape in SHAPES]
    directions = [d / d.norm() for d in directions]
    steps = []
    for t, factor in enumerate(FACTOR):
        grads = [d * base * factor for d, base in zip(directions, BASE)]
        if t == 5:
            grads[0] = grads[0] * 20
        if t == 6:
            grads[2] = None
        steps.append(grads)
    return steps


def run_adagc(clipper, params, steps):
    out, emas = [], []
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        clipper.clip_()
        out.append([None if p.grad is None else p.grad.clone() for p in params])
        emas.append(clipper.ema.tolist())
    return out, emas


@pytest.mark.parametrize("max_norm", [1.0, 0.5])
def test_adagc_matches_the_definition_through_warmup_and_after(max_norm):
    steps = hand_made_steps()
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    got, got_emas = run_adagc(AdaGC(params, max_norm=max_norm, beta=0.99, rel=1.04, warmup=3), params, steps)
    want, want_emas = brute_force(steps, max_norm, 0.99, 1.04, 3)
    for t in range(len(steps)):
        for g, w in zip(got[t], want[t]):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert got_emas[t] == pytest.approx(want_emas[t], rel=1e-6)
    # the warm-up clips the global norm (sqrt(0.29) = 0.539 at step 0) at max_norm
    assert sum(g.norm() ** 2 for g in got[0]).sqrt().item() == pytest.approx(min(math.sqrt(0.29), max_norm), rel=1e-5)
    assert got_emas[2] == pytest.approx([0.8 * b for b in BASE], rel=1e-6)
    # the spike at step 5 is cut back to 1.04 x tensor 0's EMA; the other tensors pass unchanged
    assert got[5][0].norm().item() == pytest.approx(1.04 * want_emas[4][0], rel=1e-6)
    assert torch.equal(got[5][1], steps[5][1]) and torch.equal(got[5][2], steps[5][2])
    assert got_emas[6][2] == got_emas[5][2]  # no gradient, no update
    assert all(g.norm().item() == pytest.approx(1.04 * e, rel=1e-6) for g, e in zip(got[7], got_emas[6]))


def test_warmup_is_global_norm_clipping():
    steps = hand_made_steps()[:2]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    reference = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    got, _ = run_adagc(AdaGC(params, max_norm=1.0, warmup=100), params, steps)
    for p, g in zip(reference, steps[1]):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(reference, 1.0)
    for g, p in zip(got[1], reference):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0)


def test_without_warmup_the_first_norm_starts_the_ema():
    steps = hand_made_steps()[:3]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    got, emas = run_adagc(AdaGC(params, warmup=0), params, steps)
    assert all(torch.equal(g, s) for g, s in zip(got[0], steps[0]))  # nothing to compare against yet
    assert emas[0] == pytest.approx([s.norm().item() for s in steps[0]], rel=1e-6)


def test_state_round_trip_continues_exactly():
    steps = hand_made_steps()
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    whole, _ = run_adagc(AdaGC(params, warmup=3), params, steps)
    first = AdaGC(params, warmup=3)
    run_adagc(first, params, steps[:4])
    state = first.state_dict()
    assert state["step"] == 4 and state["ema"].shape == (len(SHAPES),)
    second = AdaGC(params, warmup=3)
    second.load_state_dict(state)
    rest, _ = run_adagc(second, params, steps[4:])
    for t, grads in enumerate(rest):
        for g, w in zip(grads, whole[4 + t]):
            assert (g is None and w is None) or torch.equal(g, w)
    with pytest.raises(ValueError, match="tensors"):
        AdaGC(params[:2]).load_state_dict(state)
