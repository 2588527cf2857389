"""
Evaluation metrics: pure functions of tensors (no model, no file I/O).
"float64": the device's widest float (utils.widest_float).
Design notes: docs/metrics.md
"""

import math
import string

import torch
import torch.nn.functional as F

from model import at_least_fp32
from utils import widest_float

# next-token prediction quality


def target_ranks(logits, targets):
    """
    rank_t = 1 + #{v : logits[t, v] > logits[t, targets_t]}   (N,) long

    logits (N, V), targets (N,) long. A tie counts in the target's
    favour.
    """
    target_logit = logits.gather(1, targets.view(-1, 1))
    return 1 + (logits > target_logit).sum(dim=1)


def rank_metrics(logits, targets):
    """
    Rank scores, rank_t = target_ranks:
        accuracy    = mean_t [rank_t == 1]
        recall_at_5 = mean_t [rank_t <= 5]
        mrr         = mean_t 1 / rank_t        (mean reciprocal rank)
    Python floats.
    """
    rank = target_ranks(logits, targets).to(widest_float(logits.device))
    return {
        "accuracy": (rank == 1).to(rank.dtype).mean().item(),
        "recall_at_5": (rank <= 5).to(rank.dtype).mean().item(),
        "mrr": (1.0 / rank).mean().item(),
    }


def perplexity(logits, targets):
    """
    Perplexity = exp( -1/N sum_t log softmax(logits_t)[targets_t] ),
    in float64.
    """
    wide = logits.to(widest_float(logits.device))
    logp = F.log_softmax(wide, dim=-1)
    nll = -logp.gather(1, targets.view(-1, 1)).mean()
    return math.exp(nll.item())


T_MIN, T_MAX = 0.01, 10.0  # what best_inverse_temperature may return


@torch.no_grad()
def temperature_nll_sums(logits, targets, b, overwrite=False):
    """
    For a block of logits (n, V) and b = 1/T, the sums over its rows of
        f_t   = logsumexp_v(b z_tv) - b z_ty     (NLL of softmax(z_t / T))
        f'_t  = E[d_t] - d_ty                    (its derivative in b)
        f''_t = Var[d_t] = E[d_t^2] - E[d_t]^2   (its second derivative)
    with d_t = z_t - max_v z_tv <= 0 (no overflow) and E, Var under
    softmax(b z_t); f'' >= 0: f is convex in b. Totals in float64.
    overwrite=True: d may take the logits' memory (they are lost).
    """
    wide = widest_float(logits.device)
    z = at_least_fp32(logits)
    row_max = z.amax(dim=1, keepdim=True)
    d = z.sub_(row_max) if overwrite or z is not logits else z - row_max
    d_y = d.gather(1, targets.view(-1, 1)).squeeze(1).to(wide)
    e = torch.mul(d, b).exp_()  # exp(b d), in (0, 1]
    s0 = e.sum(dim=1).to(wide)
    e.mul_(d)
    s1 = e.sum(dim=1).to(wide)
    s2 = torch.einsum("nv,nv->n", e, d).to(wide)  # no (n, V) temporary
    mean_d = s1 / s0
    return torch.stack([
        (s0.log() - b * d_y).sum(),
        (mean_d - d_y).sum(),
        (s2 / s0 - mean_d ** 2).clamp(min=0).sum(),
    ])


def best_inverse_temperature(means_at, b=1.0, max_steps=20):
    """
    Newton's method for b* = argmin_b f(b), f(b) = mean_t NLL_t(T = 1/b);
    means_at(b) -> (f, f', f'') at b over all tokens, first at b (1:
    plain perplexity); safeguarded (docs/metrics.md). Returns (f at the
    best b visited, that b, number of passes).
    """
    f, g, h = means_at(b)
    best = (f, b)
    passes = 1
    for _ in range(max_steps):
        # f'' = 0 (all rows flat): grow b if f falls, else shrink it
        step = -g / h if h > 0 else (1.0 if g < 0 else -0.5) * b
        new_b = min(max(b + step, b / 2, 1 / T_MAX), 2 * b, 1 / T_MIN)
        if abs(new_b - b) < 1e-7 * b:
            break
        b = new_b
        f, g, h = means_at(b)
        passes += 1
        best = min(best, (f, b))
    return best[0], best[1], passes


@torch.no_grad()
def best_temperature_perplexity(logits, targets, max_block_elems=2**22):
    """
    Perplexity after the best single temperature:
        PPL_best = min_T exp( mean_t NLL_t(T) ),
        NLL_t(T) = logsumexp_v(z_tv / T) - z_t,y / T.
    t_best: the exact minimiser in [0.01, 10]. A pass reads blocks of
    at most `max_block_elems` logits. Returns (ppl_best, t_best).
    """
    N, V = logits.shape
    rows = max(1, max_block_elems // V)

    def means_at(b):
        total = sum(
            temperature_nll_sums(logits[i:i + rows], targets[i:i + rows], b)
            for i in range(0, N, rows))
        return (total / N).tolist()

    f, b, _ = best_inverse_temperature(means_at)
    return math.exp(f), 1.0 / b


# geometry of the embedding matrix


def _on_host(x):
    """x on the CPU in float64 (LAPACK is there; MPS has no float64)."""
    return x.detach().to("cpu", widest_float("cpu"))


def _gram_eigenvectors(W, solve=None):
    """W on the host, and W^T W's eigenvectors (columns)."""
    W = _on_host(W)
    if solve is None:
        return W, torch.linalg.eigh(W.T @ W).eigenvectors
    return W, torch.as_tensor(solve(W.T @ W), dtype=W.dtype).real


def _z_ratio(W, A):
    """min_a Z(a) / max_a Z(a) over the columns a of A, in log space."""
    log_z = torch.logsumexp(W @ A, dim=0)
    return math.exp((log_z.min() - log_z.max()).item())


def isotropy(W):
    """
    Isotropy I(W) of Mu & Viswanath (2018), "All-but-the-top".

    Rows w of W (n, C) are (output) embeddings; with
        Z(a) = sum_w exp(w^T a),
        I(W) = min_a Z(a) / max_a Z(a)  in (0, 1],
    1 for an isotropic set, near 0 for vectors in a narrow cone. As in
    the paper a ranges over the eigenvectors u of W^T W, here both u
    and -u (Z(a) != Z(-a)). log Z(a) = logsumexp_w(w^T a), in float64.
    """
    W, U = _gram_eigenvectors(W)
    return _z_ratio(W, torch.cat([U, -U], dim=1))


def isotropy_authors(W, eigenvectors=None):
    """
    I(W) as Stop Jostling's table computed it: a over the eigenvectors
    of W^T W, one sign each, set by sign_eigenvectors. eigenvectors: a
    solver, (C, C) matrix -> eigenvector columns (default eigh).
    """
    W, U = _gram_eigenvectors(W, eigenvectors)
    return _z_ratio(W, sign_eigenvectors(U))


def sign_eigenvectors(U):
    """U's columns, each times the sign of its largest-magnitude entry
    (two largest entries tied in magnitude: left to the solver)."""
    rows = U.abs().argmax(dim=0)
    return U * torch.sign(U[rows, torch.arange(U.shape[1])])


def isotropy_sign_range(W):
    """
    (lowest, highest) isotropy_authors over all 2^C sign choices. With
    lo_j, hi_j the smaller and larger Z of u_j and -u_j: lowest = min
    over j != k of lo_j / hi_k; highest: for each candidate minimum L
    of the 2C values, every j takes its smallest Z >= L; best L / max.
    """
    W, U = _gram_eigenvectors(W)
    z = torch.stack([torch.logsumexp(W @ U, dim=0),
                     torch.logsumexp(-W @ U, dim=0)], dim=1)
    gap = z.min(dim=1).values[:, None] - z.max(dim=1).values[None, :]
    gap.fill_diagonal_(float("inf"))
    highest = -float("inf")
    inf = torch.full_like(z, float("inf"))
    for floor in z.flatten().tolist():
        allowed = torch.where(z >= floor, z, inf).min(dim=1).values
        if torch.isfinite(allowed).all():
            highest = max(highest, floor - allowed.max().item())
    return math.exp(gap.min().item()), math.exp(highest)


def _twin_neighbours(E, shift):
    """(each row's top-3 neighbours, the fraction with their twin
    among them, mean twin cosine) of the (2*shift, C) rows E."""
    En = F.normalize(E, dim=1)
    cos = En @ En.T
    twin_cos = cos.diagonal(offset=shift).mean().item()
    cos.fill_diagonal_(float("-inf"))  # exclude self
    top3 = torch.topk(cos, 3, dim=1).indices
    twins = (torch.arange(2 * shift) + shift) % (2 * shift)
    hit = (top3 == twins.view(-1, 1)).any(dim=1)
    return top3, hit.to(E.dtype).mean().item(), twin_cos


def twin_alignment(E, shift):
    """How far the LR rows moved onto their HR twins (Stop Jostling
    Sec. 4.1), in the first 2*shift rows of E: twin_cos, the mean
    cosine of row i with row i + shift, and twin_top3, the fraction of
    rows whose twin is among their 3 nearest other rows."""
    E = _on_host(E[:2 * shift])
    _, twin_frac, twin_cos = _twin_neighbours(E, shift)
    return {"twin_cos": twin_cos, "twin_top3": twin_frac}


def translation_metrics(E, itos, shift):
    """
    Whether an embedding E (2*shift, C) aligns two languages: row
    i < shift is character itos[i] in the high-resource (HR) language,
    row i + shift its low-resource (LR) twin. A row's top-3: the 3 most
    cosine-similar OTHER rows. Returns twin_top3_fraction, the fraction
    of rows whose twin is in their top-3; cases_12, Stop Jostling's
    12-case count for the letter A: for each of A_HR, a_HR, A_LR, a_LR,
    how many of its 3 partners (capitalisation, translation, both) are
    in its top-3 (0..12; None without 'A' and 'a' in itos);
    cases_letters, that count summed over the letters with both cases
    in itos, out of cases_letters_total.
    """
    E = _on_host(E)
    assert E.shape[0] == 2 * shift, "E must have 2*shift rows"
    top3, twin_frac, _ = _twin_neighbours(E, shift)
    # itos: a list, a str or a dict {index: char}; the HR rows only
    pairs = itos.items() if isinstance(itos, dict) else enumerate(itos)
    index = {ch: i for i, ch in pairs}
    stoi = {ch: i for ch, i in index.items() if 0 <= i < shift}
    letters = [up for up in string.ascii_uppercase
               if up in stoi and up.lower() in stoi]

    def count(up):  # the 12-case count of one letter
        hr = [stoi[up], stoi[up.lower()]]
        rows = hr + [i + shift for i in hr]
        return sum(p in top3[r].tolist()
                   for r in rows for p in rows if p != r)

    return {
        "twin_top3_fraction": twin_frac,
        "cases_12": count("A") if "A" in letters else None,
        "cases_letters": sum(count(up) for up in letters),
        "cases_letters_total": 12 * len(letters),
    }


# Stop Jostling's marginalization analysis of a tied embedding's gradient


@torch.no_grad()
def embedding_gradient_part_vectors(idx, targets, hidden, grad_logits,
                                    grad_embedding, vocab_size):
    """
    The three parts of a weight-tied embedding W's (V, C) gradient:
    row W_i is token i's input embedding and its output vector in
    logits_t = hidden_t @ W^T, so for every row i
        dL/dW_i =  sum_{t: idx_t = i}      dL/demb_t        (1) input
                 + sum_{t: targets_t = i}  g_ti * hidden_t  (2) target
                 + sum_{t: targets_t != i} g_ti * hidden_t  (3) non-target
    with g_ti = dL/dlogits[t, i]; (3) is the "marginalization".

    idx, targets (N,); hidden (N, C): the final normed states;
    grad_logits (N, V); grad_embedding (N, C). Targets -1 count in
    neither (2) nor (3). Returns the three parts, each (V, C).
    """
    dtype = torch.promote_types(grad_logits.dtype, hidden.dtype)
    dtype = torch.promote_types(dtype, grad_embedding.dtype)
    hidden = hidden.to(dtype)
    grad_logits = grad_logits.to(dtype)
    V = vocab_size
    C = hidden.size(1)

    g_input = hidden.new_zeros(V, C).index_add_(
        0, idx, grad_embedding.to(dtype))

    valid = targets >= 0
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    coef = grad_logits.gather(1, safe_t.view(-1, 1)).squeeze(1)
    coef = coef * valid.to(dtype)
    g_target = hidden.new_zeros(V, C).index_add_(
        0, safe_t, coef.view(-1, 1) * hidden)

    # G^T @ hidden, G without the target column and ignored rows
    vocab = torch.arange(V, device=targets.device).view(1, -1)
    keep = valid.view(-1, 1) & (vocab != safe_t.view(-1, 1))
    g_nontarget = (grad_logits * keep.to(dtype)).T @ hidden
    return g_input, g_target, g_nontarget


class EmbeddingGradientRecorder:
    """log_marginalization: per optimizer step, the norms of each
    embedding row's raw gradient parts, a (3, V) tensor in `steps`.
    watch() after the forward, add() after each backward, end_step()
    after the optimizer. One process only."""

    def __init__(self, enabled, vocab_size):
        self.enabled = enabled
        self.vocab_size = vocab_size
        self.steps = []
        self.parts = 0

    def watch(self, logits, hidden_states):
        if self.enabled:  # backward then keeps their gradients
            logits.retain_grad()
            hidden_states[0].retain_grad()

    def add(self, idx, targets, logits, hidden_states, scaler):
        """Add a micro-step's parts, float16's loss scale divided out."""
        if self.enabled:
            C = hidden_states[0].size(-1)
            final = hidden_states[-1].detach().reshape(-1, C).float()
            parts = embedding_gradient_part_vectors(
                idx.reshape(-1), targets.reshape(-1), final,
                logits.grad.reshape(-1, self.vocab_size).float(),
                hidden_states[0].grad.reshape(-1, C).float(),
                self.vocab_size)
            scaled = torch.stack(parts) / scaler.get_scale()
            self.parts = self.parts + scaled

    def end_step(self, stepped):
        """Keep the step's norms if the optimizer stepped."""
        if self.enabled:
            if stepped:
                self.steps.append(self.parts.norm(dim=-1).cpu())
            self.parts = 0


def marginalization_ratios(g_input, g_target, g_nontarget):
    """
    How strongly the non-target push dominates each embedding row.
    Inputs (S, V): norms g1, g2, g3 of each row's three gradient parts
    over S steps. Per row (V,):
        ratio_of_average = avg_s(g1 + g2) / avg_s(g3)
        average_of_ratio = avg_s( (g1 + g2) / g3' ),
            g3' = g3 if g3 > 0 else avg_s(g3) of that row
    (the paper's footnote); nan where avg_s(g3) = 0. Values << 1: the
    row moves mostly as a wrong answer.
    """
    g1, g2, g3 = (g.to(widest_float(g.device))
                  for g in (g_input, g_target, g_nontarget))
    num = g1 + g2
    g3_avg = g3.mean(dim=0)
    undefined = g3_avg == 0
    g3p = torch.where(g3 > 0, g3, g3_avg.expand_as(g3))
    return {
        "ratio_of_average": torch.where(
            undefined, math.nan, num.mean(dim=0) / g3_avg),
        "average_of_ratio": torch.where(
            undefined, math.nan, (num / g3p).mean(dim=0)),
    }


# geometry of the hidden states (dispersion paper, Sec. 3 and Fig. 2)


def pairwise_cosine_stats(z, bins=40):
    """The dispersion paper's "embedding condensation" of z (B, T, C):
        mu = mean_{b, i, j} cos(z_bi, z_bj)   (all T^2 pairs),
    near 1 when a sequence's states all point the same way. Returns
    (mu, the cosines' histogram: `bins` fractions over [-1, 1])."""
    e = F.normalize(z.to(widest_float(z.device)), dim=-1)
    cos = e @ e.transpose(1, 2)
    hist = torch.histc(cos.clamp(-1, 1).float(), bins=bins,
                       min=-1.0, max=1.0)
    return cos.mean().item(), (hist / hist.sum()).tolist()


def _wide_tensor(x):
    device = x.device if torch.is_tensor(x) else "cpu"
    return torch.as_tensor(x, dtype=widest_float(device), device=device)


def _average_ranks(x):
    """Ranks 1..n of x, ties given the average of the ranks they span."""
    x = _wide_tensor(x)
    ranks = torch.empty_like(x)
    ranks[torch.argsort(x)] = torch.arange(
        1, len(x) + 1, dtype=x.dtype, device=x.device)
    for value in torch.unique(x):  # n: the number of layers
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x, y):
    """Spearman's rho: the Pearson correlation of the (tie-averaged)
    ranks of x and y. nan when either side is constant."""
    rx = _average_ranks(x)
    ry = _average_ranks(y)
    rx = rx - rx.mean()
    ry = ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    if denominator > 0:
        return (rx * ry).sum().div(denominator).item()
    return math.nan


def kendall(x, y):
    """Kendall's tau-b over all n0 = n(n-1)/2 pairs:
        (concordant - discordant) / sqrt((n0 - ties_x)(n0 - ties_y));
    a pair tied in x or y is neither concordant nor discordant."""
    x = _wide_tensor(x)
    y = _wide_tensor(y)
    i, j = torch.triu_indices(len(x), len(x), offset=1)
    sx = torch.sign(x[i] - x[j])
    sy = torch.sign(y[i] - y[j])
    ties_x = (sx == 0).sum().item()
    ties_y = (sy == 0).sum().item()
    denominator = math.sqrt((len(i) - ties_x) * (len(i) - ties_y))
    if denominator > 0:
        return (sx * sy).sum().item() / denominator
    return math.nan
