"""float32 against float64 for every statistic that a device without float64 (Apple MPS) computes in
float32 (utils.widest_float), each on realistic tensors and held to a stated bound.

Each function runs twice on the same tensors: as on CPU/CUDA (float64), and with utils.has_float64
patched to say the CPU has none (float32, what an MPS tensor gets). U = 2^-24 is float32's unit
roundoff; a bound of the form (number of roundings) * U * (size of the quantity) is a first-order
rounding analysis that assumes the worst, that every rounding errs the same way. The embedding
matrix's geometry (isotropy, translation_metrics) is not here: it is always computed on the CPU,
in float64 on a real Mac (float32 would move log I(W) by up to 2e-3 where W^T W has close
eigenvalues, measured on 130 x 128 rows)."""

import math

import pytest
import torch

import metrics
import scoring
import utils
from optim import SeparatedRowsAdamW

U = 2.0 ** -24


@pytest.fixture
def both(monkeypatch):
    """both(fn, *args) -> (fn's result in float64, fn's result in float32)."""
    def run(fn, *args):
        wide = fn(*args)
        with monkeypatch.context() as patch:
            patch.setattr(utils, "has_float64", lambda device: False)
            narrow = fn(*args)
        return wide, narrow
    return run


def model_like_logits(n, vocab, scale, seed):
    """Logits of a model 1.5x overconfident: targets drawn from softmax(z / 1.5), so the best
    temperature is inside (0.01, 10) and near 1.5. scale 30 is a SimReg-sized logit range."""
    generator = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(n, vocab, generator=generator)
    targets = torch.multinomial(torch.softmax(z / 1.5, dim=1), 1, generator=generator).squeeze(1)
    return z, targets


@pytest.mark.parametrize("n, vocab, scale", [(4096, 65, 1.0), (4096, 65, 4.0), (4096, 65, 30.0), (256, 50257, 4.0)])
def test_prediction_metrics(both, n, vocab, scale):
    z, targets = model_like_logits(n, vocab, scale, seed=vocab + int(scale))
    (ppl, ranks, (ppl_best, t_best)), (ppl32, ranks32, (ppl_best32, t_best32)) = both(
        lambda: (metrics.perplexity(z, targets), metrics.rank_metrics(z, targets),
                 metrics.best_temperature_perplexity(z, targets)))
    # log PPL = mean_t NLL_t: each NLL_t (a log-softmax) takes about log2(V) + 4 roundings of numbers
    # of its size, the mean log2(N) more: measured <= 4.6e-6 (V 50257), bound 1.25e-5 there
    eps = (math.log2(vocab) + math.log2(n) + 4) * U * max(1.0, math.log(ppl))
    assert abs(math.log(ppl32) - math.log(ppl)) <= eps
    assert abs(math.log(ppl_best32) - math.log(ppl_best)) <= eps
    # t_best minimises f(b) = log PPL at T = 1/b, which is flat at its minimum: b's whose f differ by
    # less than f's error 2 eps cannot be told apart, so b* moves by up to sqrt(4 eps / f''(b*))
    # (relative 2e-3 to 7e-3 here; measured <= 1e-5, and 2e-4 on other draws)
    f2 = (metrics.temperature_nll_sums(z, targets, 1 / t_best)[2] / n).item()
    assert abs(t_best32 - t_best) / t_best <= math.sqrt(4 * eps / f2) * t_best + 1e-6
    # accuracy and recall@5 count 0/1 values: exact in float32 up to 2^24 tokens, then one division
    for key in ("accuracy", "recall_at_5"):
        assert abs(ranks32[key] - ranks[key]) <= U * ranks[key]
    # mrr: a mean of N numbers in (0, 1]: one rounding each and log2(N) in the sum
    assert abs(ranks32["mrr"] - ranks["mrr"]) <= (math.log2(n) + 2) * U * ranks["mrr"]


def test_streamed_metrics_and_rare_targets(both):
    """The streamed evaluation (GPT-2 BPE) adds its chunks' sums up on the CPU: in float32 there, with
    the same bounds as the in-memory metrics; the rare-target counts stay exact."""
    n, vocab = 1024, 65
    z, targets = model_like_logits(n, vocab, 4.0, seed=1)
    rare = torch.rand(n, generator=torch.Generator().manual_seed(2)) < 0.1
    wide, narrow = both(scoring.streamed_prediction_metrics, lambda h: h.clone(), z, targets, 128, rare)
    eps = (math.log2(vocab) + math.log2(n) + 4) * U * max(1.0, math.log(wide["ppl"]))
    for key in ("ppl", "ppl_best"):
        assert abs(math.log(narrow[key]) - math.log(wide[key])) <= eps
    assert narrow["rare"]["tokens"] == wide["rare"]["tokens"] == int(rare.sum())
    assert abs(narrow["rare"]["accuracy"] - wide["rare"]["accuracy"]) <= U * wide["rare"]["accuracy"]
    assert abs(math.log(narrow["rare"]["ppl"]) - math.log(wide["rare"]["ppl"])) <= eps
    assert abs(narrow["rare"]["mrr"] - wide["rare"]["mrr"]) <= (math.log2(n) + 2) * U * wide["rare"]["mrr"]


@pytest.mark.parametrize("batch, length, dim", [(64, 256, 384), (256, 64, 128)])
def test_pairwise_cosine_stats(both, batch, length, dim):
    """What the final evaluation computes on the device, per batch and depth (scoring.forward_val)."""
    generator = torch.Generator().manual_seed(dim)
    for condensed in (0.0, 1.0, 5.0):  # mu from ~0 to ~0.96
        z = torch.randn(batch, length, dim, generator=generator) + condensed * torch.randn(dim, generator=generator)
        (mu, hist), (mu32, hist32) = both(metrics.pairwise_cosine_stats, z)
        # a cosine is a C-term dot product of unit vectors (error ~ sqrt(C) U), mu their mean over
        # B T^2 pairs (log2 of that in the sum): 1e-5 here, measured <= 6e-8
        assert abs(mu32 - mu) <= (math.sqrt(dim) + math.log2(batch * length ** 2)) * U * 4
        # the histogram bins float32 cosines either way; a cosine within a few U of one of the 41
        # bin edges may change bin: bound 1e-4 per fraction, measured <= 2e-6
        assert max(abs(a - b) for a, b in zip(hist, hist32)) <= 1e-4


def test_rank_correlations(both):
    """Ranks of a few dozen values and their sums of products are integers: exact in float32, so
    only the final square root and division round."""
    generator = torch.Generator().manual_seed(0)
    for n in (12, 48):
        x = torch.randn(n, generator=generator)
        y = (x + torch.randn(n, generator=generator)).tolist()
        for fn in (metrics.spearman, metrics.kendall):
            wide, narrow = both(fn, x.tolist(), y)
            assert abs(narrow - wide) <= 4 * U * abs(wide), fn.__name__


def test_marginalization_ratios(both):
    """Means over S steps of positive norms, one division each: (log2 S + 3) U relative."""
    generator = torch.Generator().manual_seed(0)
    steps, vocab = 2000, 130
    parts = torch.rand(steps, 3, vocab, generator=generator) * torch.logspace(-3, 1, vocab)
    parts[:, 2] *= torch.rand(steps, vocab, generator=generator) > 0.3  # steps without a non-target push
    wide, narrow = both(metrics.marginalization_ratios, parts[:, 0], parts[:, 1], parts[:, 2])
    for key, value in wide.items():
        assert ((narrow[key] - value).abs() <= (math.log2(steps) + 3) * U * value.abs()).all(), key


def adamw_rows(p, grad, state, lr, betas, eps, weight_decay):
    """One step of the SeparatedRowsAdamW formula, written out, every row active: the textbook bias
    corrections 1 - beta^k in float64, as torch.optim.AdamW computes them."""
    (beta1, beta2), k = betas, state["step"].double() + 1
    exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
    denom = exp_avg_sq.sqrt() / (1 - beta2 ** k).sqrt().float() + eps
    return p * (1 - lr * weight_decay) - (lr / (1 - beta1 ** k).float()) * exp_avg / denom


@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.9, 0.95), (0.9, 0.999), (0.0, 0.99)])
def test_separated_rows_adamw_bias_correction(monkeypatch, betas):
    """Rows at step counts from 0 to 2e6. With float64 the optimizer gives the very bits of the
    textbook formula (its -expm1(k log beta) rounds to the same float32 as 1 - beta^k). In float32
    -expm1 is within 2e-7 of the exact bias corrections, so each update is within ~1e-6 of the
    textbook one; the float32 1 - beta2^k would lose up to 2e-5 to cancellation at beta2 0.999."""
    hp = dict(lr=1e-2, betas=betas, eps=1e-8, weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    rows = 4096
    p0 = torch.randn(rows, 8, generator=generator)
    grad = torch.randn(rows, 8, generator=generator)
    state = {"step": torch.cat([torch.arange(64.0), torch.randint(64, 2_000_000, (rows - 64,), generator=generator)
                                .float()]).view(-1, 1),
             "exp_avg": 0.1 * torch.randn(rows, 8, generator=generator),
             "exp_avg_sq": 0.01 * torch.rand(rows, 8, generator=generator)}
    expected = adamw_rows(p0, grad, state, **hp)

    def step():
        p = torch.nn.Parameter(p0.clone())
        optimizer = SeparatedRowsAdamW([p], **hp)
        optimizer.state[p] = {k: v.clone() for k, v in state.items()}
        p.grad = grad.clone()
        optimizer.step()
        return p.detach()

    assert torch.equal(step(), expected)
    monkeypatch.setattr(utils, "has_float64", lambda device: False)
    update, update32 = expected - p0, step() - p0
    assert ((update32 - update).abs() <= 1e-6 * update.abs() + 4 * U * p0.abs()).all()
