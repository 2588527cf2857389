"""
Evaluation metrics for representation-level language-model losses.

Every function here is a pure function of tensors: no model, no file I/O.
They are kept small and vectorised so that each one can be read next to the
formula in its docstring (and checked against a slow Python loop in
tests/test_metrics.py). "float64" below means: on the input's device, or in float32 where
that device has no float64 (Apple MPS: utils.widest_float; tests/test_float32_stats.py bounds the
difference) -- except for the embedding matrix's geometry, always computed on the CPU.

Contents
    target_ranks                  the rank of each target among the logits
    rank_metrics                  accuracy, recall@5 and mean reciprocal rank
    perplexity                    exp(mean negative log-likelihood)
    best_temperature_perplexity   perplexity after the best single temperature
    temperature_nll_sums,         its pieces, shared with evaluate.py's streamed
    best_inverse_temperature        evaluation: per-block sums and Newton on 1/T
    isotropy                      I(W) of Mu & Viswanath (2018), both signs of each eigenvector
    isotropy_authors              I(W) as the Stop Jostling paper computed it (for comparisons with it)
    translation_metrics           twin / 12-case neighbour counts of an embedding
    twin_alignment                twin cosine and twin-in-top-3 (logged at every evaluation)
    embedding_gradient_part_vectors
                                  the three pieces of a tied embedding's gradient
    marginalization_ratios        "Stop Jostling" ratios of those pieces
    pairwise_cosine_stats         mean pairwise cosine per sequence and its histogram (condensation)
    spearman, kendall             rank correlations (no scipy)
"""

import math
import string

import torch
import torch.nn.functional as F

from model import at_least_fp32
from utils import widest_float

# -----------------------------------------------------------------------------
# next-token prediction quality


def target_ranks(logits, targets):
    """
    rank_t = 1 + #{v : logits[t, v] > logits[t, targets_t]}     (N,) long

    logits (N, V), targets (N,) long. Only STRICTLY larger logits push the
    target down, so a tie with another token counts in the target's favour
    (rank 1 if it ties for the maximum). Every rank-based score in this
    repository (rank_metrics, evaluate.tail_sums) starts from this function.
    """
    target_logit = logits.gather(1, targets.view(-1, 1))          # (N, 1)
    return 1 + (logits > target_logit).sum(dim=1)


def rank_metrics(logits, targets):
    """
    Rank-based scores of next-token predictions, from rank_t = target_ranks:
        accuracy    = mean_t [rank_t == 1]
        recall_at_5 = mean_t [rank_t <= 5]
        mrr         = mean_t 1 / rank_t        (mean reciprocal rank)
    Unlike perplexity these only look at the ORDER of the logits, so they are
    blind to calibration (multiplying all logits by a constant > 0 changes
    nothing) - a useful second opinion when a loss changes the logit scale.
    Returns python floats.
    """
    rank = target_ranks(logits, targets).to(widest_float(logits.device))
    return {
        "accuracy": (rank == 1).to(rank.dtype).mean().item(),
        "recall_at_5": (rank <= 5).to(rank.dtype).mean().item(),
        "mrr": (1.0 / rank).mean().item(),
    }


def perplexity(logits, targets):
    """
    Perplexity = exp( -1/N sum_t log softmax(logits_t)[targets_t] ).

    The exponential of the mean cross-entropy (in nats): the effective number
    of tokens the model is "choosing between" at each step. Computed in
    float64 so that the mean over many tokens does not lose digits.
    """
    logp = F.log_softmax(logits.to(widest_float(logits.device)), dim=-1)
    nll = -logp.gather(1, targets.view(-1, 1)).mean()
    return math.exp(nll.item())


T_MIN, T_MAX = 0.01, 10.0  # the temperatures best_inverse_temperature may return


@torch.no_grad()
def temperature_nll_sums(logits, targets, b, overwrite=False):
    """
    For a block of logits (n, V) and b = 1/T: the sums over its rows of
        f_t   = logsumexp_v(b z_tv) - b z_ty          (NLL of softmax(z_t / T))
        f'_t  = E[d_t] - d_ty                         (its derivative in b)
        f''_t = Var[d_t] = E[d_t^2] - E[d_t]^2        (its second derivative)
    with d_t = z_t - max_v z_tv <= 0 and E, Var under softmax(b z_t).
    Subtracting the row max changes none of these (the max's terms cancel)
    and makes exp(b d) <= 1 with a largest term of 1, so no b overflows or
    underflows the row sum. f'' >= 0: f is convex in b, which is what makes
    Newton's method safe (best_inverse_temperature).

    Exponentials and row sums in the logits' precision (at least float32),
    per-row results added up in float64. overwrite=True lets the function
    use the logits' memory for d (the caller's block is then lost): the
    streamed evaluation saves one (n, V) buffer that way.
    Returns a float64 tensor (3,): [sum f_t, sum f'_t, sum f''_t].
    """
    wide = widest_float(logits.device)
    z = at_least_fp32(logits)
    row_max = z.amax(dim=1, keepdim=True)
    d = z.sub_(row_max) if overwrite or z is not logits else z - row_max
    d_y = d.gather(1, targets.view(-1, 1)).squeeze(1).to(wide)
    e = torch.mul(d, b).exp_()                                     # exp(b d), in (0, 1]
    s0 = e.sum(dim=1).to(wide)
    e.mul_(d)                                                      # e d
    s1 = e.sum(dim=1).to(wide)
    s2 = torch.einsum("nv,nv->n", e, d).to(wide)                    # sum(e d^2), no temporary
    mean_d = s1 / s0
    return torch.stack([(s0.log() - b * d_y).sum(), (mean_d - d_y).sum(),
                        (s2 / s0 - mean_d ** 2).clamp(min=0).sum()])


def best_inverse_temperature(means_at, b=1.0, max_steps=20):
    """
    Newton's method for b* = argmin_b f(b), f(b) = mean_t NLL_t(T = 1/b).

    means_at(b) -> (f, f', f'') at b, the means over all tokens (one pass over
    the logits: temperature_nll_sums added up over blocks, divided by N).
    f is convex in b (f'' is a mean of variances), so the minimum is unique
    and Newton's step -f'/f'' heads for it; the safeguards keep a step from
    overshooting where f is far from quadratic: a step changes b by at most
    a factor 2, b stays in [1/T_MAX, 1/T_MIN] (T in [0.01, 10]), and the
    answer is the best b visited. Stops when a step changes b by less than
    1e-7 relative, or after max_steps steps; a minimum beyond the range ends
    at its edge. The first pass is at b (default 1: T = 1, plain perplexity).
    Returns (f at the best b, the best b, number of passes over the logits).
    """
    f, g, h = means_at(b)
    best, passes = (f, b), 1
    for _ in range(max_steps):
        step = -g / h if h > 0 else (1.0 if g < 0 else -0.5) * b   # f'' = 0: all rows flat
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
    A loss that only trains the representation (not the logit scale) may
    leave a model whose ranking is fine but whose logits are badly scaled;
    rescaling by 1/T removes that calibration error, so PPL_best compares the
    information in the logits rather than their temperature.

    t_best is the exact minimiser (Newton on b = 1/T, best_inverse_temperature,
    the same code as evaluate.streamed_prediction_metrics), within T in
    [0.01, 10]. Archived char runs were scored on the grid T in {0.01, ...,
    2.00}: inside that range both agree within the grid step (tests/test_metrics.py);
    a grid value of 2.00 was the grid's edge, not a minimum.
    Each pass goes over the logits in blocks of at most `max_block_elems`
    numbers, so memory stays bounded whatever N is.
    Returns (ppl_best, t_best) as python floats.
    """
    N, V = logits.shape
    rows = max(1, max_block_elems // V)

    def means_at(b):
        total = sum(temperature_nll_sums(logits[i:i + rows], targets[i:i + rows], b)
                    for i in range(0, N, rows))
        return (total / N).tolist()

    f, b, _ = best_inverse_temperature(means_at)
    return math.exp(f), 1.0 / b


# -----------------------------------------------------------------------------
# geometry of the embedding matrix


def _on_host(x):
    """x on the CPU in float64, wherever it is: LAPACK's eigh and eig are there, and MPS has no float64."""
    return x.detach().to("cpu", widest_float("cpu"))


def isotropy(W):
    """
    Isotropy I(W) of Mu & Viswanath (2018), "All-but-the-top".

    W (n, C): rows w are (output) embedding vectors. With the partition function
        Z(a) = sum_w exp(w^T a)
    a perfectly isotropic set of vectors has Z(a) constant over unit vectors a,
    so I(W) = min_a Z(a) / max_a Z(a) is 1, and it tends to 0 when the vectors
    crowd into a narrow cone (the "representation degeneration" of
    tied-embedding LMs). As in the paper, a ranges over the eigenvectors of
    W^T W - but an eigenvector's sign is arbitrary and Z(a) != Z(-a), so we
    use both u and -u to make the value well defined.
    Computed in float64 via log Z(a) = logsumexp_w(w^T a), so large norms do
    not overflow:   I = exp( min_a log Z(a) - max_a log Z(a) )   in (0, 1].
    """
    W = _on_host(W)
    _, U = torch.linalg.eigh(W.T @ W)                              # columns = eigenvectors
    A = torch.cat([U, -U], dim=1)                                  # (C, 2C)
    log_z = torch.logsumexp(W @ A, dim=0)                          # (2C,)
    return math.exp((log_z.min() - log_z.max()).item())


def isotropy_authors(W, eigenvectors=None):
    """
    I(W) the way the Stop Jostling authors computed the paper's I(W) column: a over the eigenvectors
    of W^T W, one sign each and no negatives. Since Z(a) != Z(-a) the value depends on the signs:
    the authors took whatever torch.linalg.eig returned, which changes with the solver and the
    LAPACK build (numpy.linalg.eig moved single runs by up to 0.19). Here each eigenvector is signed
    by a stated rule, its largest-magnitude component positive (sign_eigenvectors), so any solver
    gives the same value; isotropy_sign_range gives the spread over all sign choices, and isotropy()
    (both signs) the well-defined value, never above this one. eigenvectors: a function of the
    (C, C) float64 matrix returning its eigenvectors as columns (torch.linalg.eigh's by default).
    """
    W = _on_host(W)
    U = torch.linalg.eigh(W.T @ W).eigenvectors if eigenvectors is None else eigenvectors(W.T @ W)
    log_z = torch.logsumexp(W @ sign_eigenvectors(torch.as_tensor(U, dtype=W.dtype).real), dim=0)
    return math.exp((log_z.min() - log_z.max()).item())


def sign_eigenvectors(U):
    """U's columns, each multiplied by the sign of its largest-magnitude entry (a column whose two
    largest entries tie in magnitude is the one case the rule leaves to the solver)."""
    rows = U.abs().argmax(dim=0)
    return U * torch.sign(U[rows, torch.arange(U.shape[1])])


def isotropy_sign_range(W):
    """(lowest, highest) I(W) of isotropy_authors over all 2^C sign choices of the C eigenvectors.
    With lo_j, hi_j the smaller and larger Z of u_j and -u_j: the lowest is min over j != k of
    lo_j / hi_k; the highest, over each candidate minimum L among the 2C values, takes for every j
    the smallest of its two Z at or above L, and keeps the best L / max."""
    W = _on_host(W)
    U = torch.linalg.eigh(W.T @ W).eigenvectors
    z = torch.stack([torch.logsumexp(W @ U, dim=0), torch.logsumexp(-W @ U, dim=0)], dim=1)  # (C, 2) log Z
    lo, hi = z.min(dim=1).values, z.max(dim=1).values
    gap = lo[:, None] - hi[None, :]
    gap.fill_diagonal_(float("inf"))
    lowest = gap.min().item()
    highest = -float("inf")
    for floor in z.flatten().tolist():
        allowed = torch.where(z >= floor, z, torch.full_like(z, float("inf"))).min(dim=1).values
        if torch.isfinite(allowed).all():
            highest = max(highest, floor - allowed.max().item())
    return math.exp(lowest), math.exp(highest)


def _case_count(top3, i_upper, i_lower, shift):
    """
    12-case count for one letter. The four rows A_HR, a_HR, A_LR, a_LR each
    have three partners (the other three rows: capitalisation, translation,
    both); count how many partners appear in the row's top-3 neighbours.
    """
    rows = [i_upper, i_lower, i_upper + shift, i_lower + shift]
    count = 0
    for r in rows:
        neighbours = set(top3[r].tolist())
        count += sum(p in neighbours for p in rows if p != r)
    return count


def _twin_neighbours(E, shift):
    """(top-3 neighbour ids of every row, fraction of rows whose twin is among them, mean cosine
    of each HR row i < shift with its LR twin i + shift) of the (2*shift, C) rows E."""
    En = F.normalize(E, dim=1)
    cos = En @ En.T
    twin_cos = cos.diagonal(offset=shift).mean().item()           # cos(E_i, E_{i+shift}), i < shift
    cos.fill_diagonal_(float("-inf"))                              # exclude self
    top3 = torch.topk(cos, 3, dim=1).indices                       # (2*shift, 3)
    twins = (torch.arange(2 * shift) + shift) % (2 * shift)        # i +- shift
    twin_frac = (top3 == twins.view(-1, 1)).any(dim=1).to(E.dtype).mean().item()
    return top3, twin_frac, twin_cos


def twin_alignment(E, shift):
    """How far the low-resource rows have moved onto their high-resource twins (watched at every
    evaluation of a two-language run, Stop Jostling Sec. 4.1): the first 2*shift rows of E give
    twin_cos, the mean cosine between each HR row i and its LR twin i + shift, and twin_top3, the
    fraction of the 2*shift rows whose twin is among their 3 nearest other rows (cosine)."""
    _, twin_frac, twin_cos = _twin_neighbours(_on_host(E[:2 * shift]), shift)
    return {"twin_cos": twin_cos, "twin_top3": twin_frac}


def translation_metrics(E, itos, shift):
    """
    Does an embedding of a two-language character vocabulary align the languages?

    E (2*shift, C): row i < shift is character itos[i] in the high-resource
    (HR) language and row i + shift is the same character in the low-resource
    (LR) language - its "twin". Similarity is cosine; the top-3 neighbours of
    a row are the 3 most similar OTHER rows (self is set to -inf and we take
    torch.topk(cos, 3); exact ties are broken by torch.topk's internal order,
    which is unspecified - with real, continuous embeddings ties do not occur).

    Returns
      twin_top3_fraction : fraction of all 2*shift rows whose twin (i +- shift)
                           is among their top-3 neighbours.
      cases_12           : the "Stop Jostling" 12-case count for the letter A:
                           for each of A_HR, a_HR, A_LR, a_LR count how many of
                           its 3 partners (capitalisation, translation, both)
                           are among its top-3 neighbours -> integer 0..12.
                           None if 'A' or 'a' is not in itos.
      cases_letters      : the same count summed over every letter that has
      cases_letters_total  both cases in itos; total = 12 * #letters (312 for 26).
    A model that learned "same character in the other language" and "same
    letter in the other case" scores near 1.0 / 12 / the total.
    """
    E = _on_host(E)
    assert E.shape[0] == 2 * shift, "E must have 2*shift rows"
    top3, twin_frac, _ = _twin_neighbours(E, shift)

    # char -> index, for itos given as a list/str or as a dict {index: char}; then the HR rows only
    index = {ch: i for i, ch in (itos.items() if isinstance(itos, dict) else enumerate(itos))}
    stoi = {ch: i for ch, i in index.items() if 0 <= i < shift}
    letters = [up for up in string.ascii_uppercase if up in stoi and up.lower() in stoi]
    return {
        "twin_top3_fraction": twin_frac,
        "cases_12": _case_count(top3, stoi["A"], stoi["a"], shift) if "A" in letters else None,
        "cases_letters": sum(_case_count(top3, stoi[up], stoi[up.lower()], shift) for up in letters),
        "cases_letters_total": 12 * len(letters),
    }


# -----------------------------------------------------------------------------
# "Stop Jostling" marginalization analysis of a tied embedding's gradient


@torch.no_grad()
def embedding_gradient_part_vectors(idx, targets, hidden, grad_logits, grad_embedding, vocab_size):
    """
    Split the gradient of a weight-tied embedding W (V, C) into three parts.

    With tying, row W_i is used twice: as the input embedding of token i and
    as the output vector in logits_t = hidden_t @ W^T. Hence, for every row i,
        dL/dW_i =  sum_{t: idx_t = i}       dL/demb_t                  (1) input use
                 + sum_{t: targets_t = i}   dL/dlogits[t,i] * hidden_t (2) target
                 + sum_{t: targets_t != i}  dL/dlogits[t,i] * hidden_t (3) non-target
    Under cross-entropy, (2) pulls W_i toward contexts where i is the answer,
    while (3) pushes every token that is NOT the answer away - for rare tokens
    that is almost every step, which is the "marginalization" that drives
    embeddings of rare tokens into one direction.

    idx, targets (N,) long (flattened batch x time); hidden (N, C) final
    normed state feeding the head; grad_logits (N, V); grad_embedding (N, C).
    Positions with target == -1 (ignored by the loss) are masked out of (2)
    and (3). Returns three (V, C) tensors; (1)+(2)+(3) equals W.grad when
    W.grad comes only from the embedding lookup and the tied head.
    """
    dtype = torch.promote_types(grad_logits.dtype, hidden.dtype)
    dtype = torch.promote_types(dtype, grad_embedding.dtype)
    hidden, grad_logits = hidden.to(dtype), grad_logits.to(dtype)
    N, C = hidden.shape
    V = vocab_size

    # (1) input use: scatter-add each position's embedding gradient into its row
    g_input = hidden.new_zeros(V, C).index_add_(0, idx, grad_embedding.to(dtype))

    valid = targets >= 0                                           # mask ignore (-1)
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    # (2) target: coefficient dL/dlogits[t, y_t] times hidden_t, added to row y_t
    coef = grad_logits.gather(1, safe_t.view(-1, 1)).squeeze(1) * valid.to(dtype)
    g_target = hidden.new_zeros(V, C).index_add_(0, safe_t, coef.view(-1, 1) * hidden)

    # (3) non-target: all entries of grad_logits except the target column and
    # except ignored rows, then the head's usual weight gradient G^T @ hidden
    not_target = torch.arange(V, device=targets.device).view(1, -1) != safe_t.view(-1, 1)
    keep = valid.view(-1, 1) & not_target                          # (N, V)
    g_nontarget = (grad_logits * keep.to(dtype)).T @ hidden
    return g_input, g_target, g_nontarget


class EmbeddingGradientRecorder:
    """Stop Jostling's marginalization record (log_marginalization): for every optimizer step the
    norms of each embedding row's raw gradient (before clipping) split into its three parts,
    a (3, V) tensor in `steps`. The training step calls watch() after the forward, add() after each
    backward and end_step() after the optimizer; a disabled recorder does nothing. One process only
    (the parts are summed over this process's micro-steps)."""

    def __init__(self, enabled, vocab_size, steps=()):
        self.enabled, self.vocab_size, self.steps = enabled, vocab_size, list(steps)
        self.parts = 0

    def watch(self, logits, hidden_states):
        if self.enabled:  # keep the gradients that backward computes for the logits and the embedding output
            logits.retain_grad()
            hidden_states[0].retain_grad()

    def add(self, idx, targets, logits, hidden_states, scaler):
        """One micro-step's parts, summed into the step's before norms are taken; float16's loss
        scale divided out (the same for every micro-step of a step)."""
        if self.enabled:
            C = hidden_states[0].size(-1)
            parts = embedding_gradient_part_vectors(
                idx.reshape(-1), targets.reshape(-1), hidden_states[-1].detach().reshape(-1, C).float(),
                logits.grad.reshape(-1, self.vocab_size).float(),
                hidden_states[0].grad.reshape(-1, C).float(), self.vocab_size)
            self.parts = self.parts + torch.stack(parts) / scaler.get_scale()

    def end_step(self, stepped):
        """Keep the step's norms if the optimizer stepped (float16 skips steps with inf/NaN gradients)."""
        if self.enabled:
            if stepped:
                self.steps.append(self.parts.norm(dim=-1).cpu())
            self.parts = 0


def marginalization_ratios(g_input, g_target, g_nontarget):
    """
    How strongly does the non-target push dominate each embedding row?

    Inputs (S, V): norms g1, g2, g3 of the three gradient parts of each row i
    over S training steps. Per row (V,):
        ratio_of_average = avg_s(g1 + g2) / avg_s(g3)
        average_of_ratio = avg_s( (g1 + g2) / g3' ),
            g3' = g3 if g3 > 0 else avg_s(g3) of that row
    The substitution (the paper's footnote) keeps steps where a row got no
    non-target gradient from dividing by zero. Values << 1 mean the row is
    moved mostly by being a wrong answer. A row whose avg_s(g3) is 0 (never
    received a non-target gradient) has no defined ratio: both entries are nan.
    """
    g1, g2, g3 = (g.to(widest_float(g.device)) for g in (g_input, g_target, g_nontarget))
    num = g1 + g2                                                  # (S, V)
    g3_avg = g3.mean(dim=0)                                        # (V,)
    undefined = g3_avg == 0
    nan = float("nan")

    ratio_of_average = torch.where(undefined, nan, num.mean(dim=0) / g3_avg)
    g3p = torch.where(g3 > 0, g3, g3_avg.expand_as(g3))
    average_of_ratio = torch.where(undefined, nan, (num / g3p).mean(dim=0))
    return {"ratio_of_average": ratio_of_average, "average_of_ratio": average_of_ratio}


# -----------------------------------------------------------------------------
# geometry of the hidden states (dispersion paper, Sec. 3 and Fig. 2)


def pairwise_cosine_stats(z, bins=40):
    """Mean pairwise cosine similarity of the states of each sequence, and the histogram of those
    cosines -- the dispersion paper's "embedding condensation" measure.

        mu = mean over sequences b and all T^2 pairs (i, j), diagonal included, of cos(z_bi, z_bj)

    z (B,T,C). Returns (mu as a float, histogram as a list of `bins` fractions over [-1, 1]).
    mu near 1 means the states of a sequence all point the same way (condensed)."""
    e = F.normalize(z.to(widest_float(z.device)), dim=-1)
    cos = e @ e.transpose(1, 2)                                      # (B, T, T)
    hist = torch.histc(cos.clamp(-1, 1).float(), bins=bins, min=-1.0, max=1.0)
    return cos.mean().item(), (hist / hist.sum()).tolist()


def _wide_tensor(x):
    """x (a tensor or a list of numbers) as a tensor in the widest float of its device."""
    device = x.device if torch.is_tensor(x) else "cpu"
    return torch.as_tensor(x, dtype=widest_float(device), device=device)


def _average_ranks(x):
    """Ranks 1..n of x with ties given the average of the ranks they span."""
    x = _wide_tensor(x)
    order = torch.argsort(x)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, len(x) + 1, dtype=x.dtype, device=x.device)
    for value in torch.unique(x):  # n is small (number of layers): a loop over distinct values
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x, y):
    """Spearman's rho: the Pearson correlation of the (tie-averaged) ranks of x and y.
    nan when either side is constant."""
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    return (rx * ry).sum().div(denominator).item() if denominator > 0 else float("nan")


def kendall(x, y):
    """Kendall's tau-b: (concordant - discordant) / sqrt((n0 - ties_x)(n0 - ties_y)) over all
    n0 = n(n-1)/2 pairs; a pair tied in x or y is neither concordant nor discordant."""
    x, y = _wide_tensor(x), _wide_tensor(y)
    i, j = torch.triu_indices(len(x), len(x), offset=1)
    sx, sy = torch.sign(x[i] - x[j]), torch.sign(y[i] - y[j])
    n0 = len(i)
    denominator = math.sqrt((n0 - (sx == 0).sum().item()) * (n0 - (sy == 0).sum().item()))
    return (sx * sy).sum().item() / denominator if denominator > 0 else float("nan")
