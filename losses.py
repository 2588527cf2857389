"""
Every training loss, each a plain function: tensors in, a scalar out.

A loss never reaches into the model: the model returns logits and
hidden states (model.py), and objective.Objective adds up the losses
a config names. Each docstring gives the formula, paper, equation and
defaults. Design notes: docs/losses.md; paper versus released code:
docs/fidelity.md.
"""

import functools
import math

import torch
from torch.nn import functional as F

from model import at_least_fp32, full_fp32


def _check_margin(margin):
    if margin is not None and margin < 0:
        raise ValueError(
            "margin must be >= 0 (a negative margin would remove "
            f"the target), got {margin}")


def threshold_logits(logits, targets, margin, ignore_index=-1):
    """Stop Jostling's logit thresholding (Turumtaev 2024, Sec. 3).

        threshold_t = z_t[y_t] - margin
        z_t[i] -> -inf   wherever z_t[i] < threshold_t

    A non-target already below p(target) * e^-margin leaves the
    softmax and gets zero gradient from this position ("non-target
    marginalization"); the target always stays (margin >= 0).
    Training only. logits (..., V); targets (...), where ignore_index
    leaves a position untouched.
    """
    _check_margin(margin)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0)
    target_logit = logits.gather(-1, safe_targets.unsqueeze(-1))
    below = (logits < target_logit - margin) & valid.unsqueeze(-1)
    return logits.masked_fill(below, float("-inf"))


def cross_entropy(logits, targets, ignore_index=-1, margin=None):
    """Mean next-token cross-entropy over positions whose target is
    not ignore_index:

        L = mean_t [ logsumexp_i z_t[i] - z_t[y_t] ]

    margin (>= 0; default None, plain CE): threshold_logits first
    (Stop Jostling's margins 8, 4, 2, 1, 0.6). Half precision is
    upcast to float32. logits (..., V), targets (...).
    """
    logits = at_least_fp32(logits)
    if margin is not None:
        logits = threshold_logits(logits, targets, margin, ignore_index)
    flat_logits = logits.reshape(-1, logits.size(-1))
    return F.cross_entropy(flat_logits, targets.reshape(-1),
                           ignore_index=ignore_index)


def _head_chunk(logits, targets, ignore_index, margin):
    """A chunk of the LM head's logits (n, V) -> (token losses (n,) in
    float32, d loss / d logits (n, V) in the logits' dtype: softmax
    minus one-hot target, 0 on ignored rows)."""
    z = at_least_fp32(logits)
    if margin is not None:
        z = threshold_logits(z, targets, margin, ignore_index)
    valid = (targets != ignore_index).unsqueeze(-1)
    target = torch.where(valid, targets.unsqueeze(-1), 0)
    lse = torch.logsumexp(z, -1, keepdim=True)
    token_loss = torch.where(valid, lse - z.gather(-1, target), 0.0)
    vocabulary = torch.arange(z.size(-1), device=z.device)
    one_hot = (vocabulary == target).to(z.dtype)
    gradient = torch.where(valid, torch.exp(z - lse) - one_hot, 0.0)
    return token_loss.squeeze(-1), gradient.to(logits.dtype)


@functools.cache
def _head_chunk_kernel(device_type):
    if device_type == "cuda":
        return torch.compile(_head_chunk, dynamic=False)
    return _head_chunk


def _in_matmul_dtype(*tensors):
    """The tensors in the dtype autocast would run their matmul in,
    cast here: autocast's cached cast of a weight may lack its grad."""
    device_type = tensors[0].device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """cross_entropy(h @ weight^T, targets), chunk_size rows of h at a
    time; the forward also computes the gradients, backward scales."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, margin, chunk_size):
        ctx.dtypes = (h.dtype, weight.dtype)
        want_h, want_weight = ctx.needs_input_grad[:2]
        fp32 = at_least_fp32(weight).dtype
        grad_weight = (torch.zeros_like(weight, dtype=fp32)
                       if want_weight else None)
        h, weight = _in_matmul_dtype(h, weight)
        grad_h = torch.empty_like(h) if want_h else None
        head_chunk = _head_chunk_kernel(h.device.type)
        total = 0.0
        for start in range(0, h.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(h[rows], weight)
            token_loss, g = head_chunk(logits, targets[rows], ignore_index,
                                       margin)
            total = total + token_loss.sum()
            if want_h:
                grad_h[rows] = g @ weight
            if want_weight:
                grad_weight += g.t() @ h[rows]
        count = (targets != ignore_index).sum()
        ctx.save_for_backward(grad_h, grad_weight, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        *grads, count = ctx.saved_tensors  # of h and of weight
        scale = grad_loss / count
        grads = [None if g is None else (g * scale).to(dtype)
                 for g, dtype in zip(grads, ctx.dtypes)]
        return (*grads, None, None, None, None)


def linear_cross_entropy(h, weight, targets, ignore_index=-1,
                         margin=None, chunk_size=4096,
                         reduction="mean"):
    """cross_entropy(h @ weight^T, targets, ignore_index, margin): the
    LM head and its loss in one, chunk_size rows of h at a time, never
    holding the whole (N, V) float32 logits. Same values and gradients
    (NaN with no valid position, as there). reduction="none": each
    position's loss (0 where ignored), without gradient.
    h (..., C), weight (V, C), targets (...).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    _check_margin(margin)
    h = h.reshape(-1, h.size(-1))
    targets = targets.reshape(-1)
    if reduction == "none":
        with torch.no_grad():
            h, weight = _in_matmul_dtype(h, weight)
            chunks = zip(h.split(chunk_size), targets.split(chunk_size))
            return torch.cat([
                _head_chunk(F.linear(x, weight), y, ignore_index, margin)[0]
                for x, y in chunks])
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    return _ChunkedHeadCrossEntropy.apply(
        h, weight, targets, ignore_index, margin, chunk_size)


def _mask_out(x, keep):
    """x where `keep`, else a quarter of the dtype's minimum: weightless
    in a logsumexp, without gradient, and finite."""
    return x.masked_fill(~keep, torch.finfo(x.dtype).min / 4)


def simreg(h, labels, tau=0.01, chunk_size=None, ignore_index=-1):
    """SimReg, embedding similarity regularization (Sun et al. 2026,
    Sec. 3, Eq. 3).

    Within one sequence, for anchor i with label y_i (the next-token
    target of position i):
        P_i = {j : y_j = y_i}  (i included: never empty)
        N_i = {j : y_j != y_i}
        s_ij = cos(e_i, e_j) / tau
        L_i = logsumexp_{j in N_i} s_ij - logsumexp_{j in P_i} s_ij
        token loss = softplus(L_i)                         (Eq. 3)
                   = -log(sum_P e^s / sum_{P u N} e^s)
    a multi-positive InfoNCE: states predicting the same token are
    pulled together, the others pushed apart. N_i empty: 0.

    Token losses are averaged within each label, then over the
    sequence's labels, then over sequences. ignore_index positions
    leave anchors, P and N; a sequence with none valid drops out
    (none in the batch: 0, with zero gradient).

    chunk_size c (default None): each sequence is cut into ceil(T/c)
    consecutive chunks, each a sequence of its own, weighted equally
    (the paper gives no formula). c >= T: the full loss.

    h (B,T,C) (by default the LM head's input), labels (B,T).
    Defaults: tau = 0.01 (the paper's); the weight
    lambda = 10 sqrt(C/1024) is the caller's. Float32 (float64 kept)
    even under autocast. Cost O(T^2 C) time and O(T^2) memory per
    sequence; O(T c C) and O(T c) with chunks.
    """
    B, T, C = h.shape
    if chunk_size is not None and chunk_size < 1:
        raise ValueError("chunk_size must be a positive integer or "
                         f"None, got {chunk_size}")
    if chunk_size is not None and chunk_size < T:
        # chunks become sequences; the last is padded with ignored
        n_chunks = -(-T // chunk_size)
        pad = n_chunks * chunk_size - T
        h = F.pad(h, (0, 0, 0, pad))
        h = h.reshape(B * n_chunks, chunk_size, C)
        labels = F.pad(labels, (0, pad), value=ignore_index)
        labels = labels.reshape(B * n_chunks, chunk_size)

    with full_fp32(h.device.type):
        e = F.normalize(at_least_fp32(h), dim=-1)
        sim = e @ e.transpose(1, 2) / tau  # (S, t, t): s_ij
        valid = labels != ignore_index
        pair = valid.unsqueeze(2) & valid.unsqueeze(1)
        same = labels.unsqueeze(2) == labels.unsqueeze(1)
        positive = pair & same
        negative = pair & ~same
        contrast = (torch.logsumexp(_mask_out(sim, negative), -1)
                    - torch.logsumexp(_mask_out(sim, positive), -1))
        # N_i empty: softplus of an (almost) -inf L_i is exactly 0
        token_loss = F.softplus(contrast)

        # weights 1/|P_i| sum to one per label: a mean per label
        group_size = positive.sum(-1).to(token_loss.dtype)
        weight = torch.where(valid, 1.0 / group_size.clamp_min(1), 0.0)
        n_labels = weight.sum(-1)
        has_valid = valid.any(-1)
        label_sum = (weight * token_loss).sum(-1)
        per_sequence = label_sum / torch.where(has_valid, n_labels, 1.0)
        n_sequences = has_valid.sum().clamp_min(1)
        return (per_sequence * has_valid).sum() / n_sequences


def _angular_distance(z, form):
    """D = arccos(cos) / pi (B,T,T), each form's eps and clamp."""
    eps = 1e-4 if form == "paper" else 1e-2
    z_hat = z / (z.norm(dim=-1, keepdim=True) + eps)
    cos = z_hat @ z_hat.transpose(1, 2)
    if form == "paper":
        cos = cos.clamp(-1 + eps, 1 - eps)
    else:  # straight-through: the unclamped cosine's gradient
        cos = cos + (cos.clamp(-0.75, 0.75) - cos).detach()
    return torch.arccos(cos) / math.pi


def _off_diagonal(n, device):
    return ~torch.eye(n, dtype=torch.bool, device=device)


def _mean_off_diagonal(m):
    """mean over i != j of each (n, n) matrix of m, then over batch."""
    n = m.size(-1)
    off = m * _off_diagonal(n, m.device)
    return off.sum((1, 2)).div(n * (n - 1)).mean()


# The variants of dispersion (its docstring has their formulas)

def _dispersion_angular(z, tau, form):
    # a soft minimum of the distances: the closest pairs are pushed
    # apart hardest
    B, T, _ = z.shape
    shift = 0.0 if form == "paper" else 1e-2
    logits = -_angular_distance(z, form) / tau + shift
    pairs = _off_diagonal(T, z.device).reshape(1, T * T)
    logits = _mask_out(logits.reshape(B, T * T), pairs)
    per_sequence = torch.logsumexp(logits, -1)
    return (per_sequence - math.log(T * (T - 1))).mean()


def _dispersion_orthogonalization(z, tau, form):
    # only pairs closer than orthogonal are pushed apart
    hinge = F.relu(0.5 - _angular_distance(z, form)).square()
    return _mean_off_diagonal(hinge)


def _dispersion_decorrelation(z, tau, form):
    C = z.size(-1)
    std = z.std(-1, keepdim=True).clamp_min(1e-4)
    z_c = (z - z.mean(-1, keepdim=True)) / std
    cov = z_c @ z_c.transpose(1, 2) / (C - 1)
    return _mean_off_diagonal(cov.square())


def _dispersion_decorrelation_features(z, tau, form):
    # the token form of z^T: channels standardised over the tokens
    return _dispersion_decorrelation(z.transpose(1, 2), tau, form)


def _dispersion_l2_repel(z, tau, form):
    B, T, C = z.shape
    # |a|^2 + |b|^2 - 2ab, the diagonal set to 0, not computed
    sq_norm = z.square().sum(-1)
    sq_dist = (sq_norm.unsqueeze(2) + sq_norm.unsqueeze(1)
               - 2 * z @ z.transpose(1, 2))
    diagonal = ~_off_diagonal(T, z.device)
    sq_dist = sq_dist.masked_fill(diagonal, 0.0).clamp_min(0)
    distance = sq_dist / C if form == "paper" else sq_dist
    shift = 0.0 if form == "paper" else 1e-2
    logits = (-distance / tau + shift).reshape(B, T * T)
    per_sequence = torch.logsumexp(logits, -1)
    repel = (per_sequence - 2 * math.log(T)).mean()
    return repel + _dispersion_l2_repel_norm(z, tau, form)


def _dispersion_l2_repel_norm(z, tau, form):
    # all that is left of the released l2_repel for states far apart
    return 0.1 * z.square().mean()


DISPERSION_VARIANTS = {
    "angular": _dispersion_angular,
    "decorrelation": _dispersion_decorrelation,
    "decorrelation_features": _dispersion_decorrelation_features,
    "l2_repel": _dispersion_l2_repel,
    "l2_repel_norm": _dispersion_l2_repel_norm,
    "orthogonalization": _dispersion_orthogonalization,
}
DISPERSION_FORMS = ("paper", "authors")
# the released code's positions per sequence when T is longer
AUTHORS_MAX_POSITIONS = 256


def random_positions(layers, n):
    """Each (B,T,C) layer at n random positions (B,n,C), the same in
    every sequence, drawn anew for each layer."""
    return [z[:, torch.randperm(z.size(1), device=z.device)[:n]]
            for z in layers]


def dispersion(hidden_states, tau=1.0, variant="angular",
               form="paper"):
    """Dispersion loss and its alternatives (Liu et al., Sec. 4.4,
    Eq. 2, Table 1, App. A Algorithm 1).

    Against "embedding condensation", a sequence's states drifting to
    one direction with depth. For each layer's z (B,T,C), within each
    sequence:
      angular (default, Algorithm 1), eps = 1e-4:
          z_hat = z / (|z| + eps),  cos = z_hat z_hat^T
          D_ij = arccos(clamp(cos_ij, -1+eps, 1-eps)) / pi
          loss = logsumexp_{i!=j}(-D_ij / tau) - log(T(T-1))
      decorrelation (the released code's token form):
          Z_c = z standardised per token over channels (unbiased
          std, clamped at eps); Cov = Z_c Z_c^T / (C-1), T x T;
          loss = mean_{m!=n} Cov_mn^2
      decorrelation_features (the text's, Sec. 4.4): the same with
          each channel standardised over the T tokens;
          Cov = Z_c^T Z_c / (T-1), C x C
      l2_repel: D_ij = |z_i - z_j|^2 / C, all i, j (i = j bounds it
          below): logsumexp(-D_ij / tau) - log(T^2) + 0.1 mean(z^2)
      orthogonalization: mean_{i!=j} max(0, 1/2 - D_ij)^2, angular D
      l2_repel_norm: 0.1 mean(z^2) alone (an ablation)
    The loss is the mean over sequences, then over the layers.

    form="authors": the released code (ChenLiu-1996/LM-Dispersion,
    lm_dispersion/dispersion.py): z_hat = z / (|z| + 1e-2); cos
    clamped to [-0.75, 0.75] in value only (straight-through); 1e-2
    added inside the logsumexp; l2_repel's D_ij not divided by C;
    for T > 256, 256 random positions (the same in every sequence).

    hidden_states: a list of (B,T,C) tensors (by default every
    block's output) or one. Defaults: tau = 1.0, the weight
    lambda = 0.1 (the paper's; the caller's). Float32 (float64 kept).
    Needs T >= 2. Cost O(T^2 C) time, O(T^2) memory per layer and
    sequence.
    """
    if variant not in DISPERSION_VARIANTS:
        raise ValueError(f"unknown dispersion variant {variant!r}; "
                         f"valid: {', '.join(DISPERSION_VARIANTS)}")
    if form not in DISPERSION_FORMS:
        raise ValueError(f"unknown dispersion form {form!r}; "
                         f"valid: {', '.join(DISPERSION_FORMS)}")
    if torch.is_tensor(hidden_states):
        hidden_states = [hidden_states]
    layers = list(hidden_states)
    if not layers:
        raise ValueError("dispersion needs at least one layer of hidden states")
    T = layers[0].size(1)
    if T < 2:
        raise ValueError("dispersion needs T >= 2 positions "
                         f"(pairs i != j), got T = {T}")
    loss = DISPERSION_VARIANTS[variant]
    with full_fp32(layers[0].device.type):
        if form == "authors" and T > AUTHORS_MAX_POSITIONS:
            layers = random_positions(layers, AUTHORS_MAX_POSITIONS)
        per_layer = [loss(at_least_fp32(z), tau, form) for z in layers]
    return torch.stack(per_layer).mean()


def nitp(pred, shallow):
    """NITP, next implicit token prediction (NITP, ICML 2026,
    "cosine similarity loss").

        L = mean_{b, t < T-1} [ 1 - cos(pred[b, t], sg(shallow[b, t+1])) ]

    The final state, through a projection head P, predicts the
    shallow-layer state of the next token. pred = P(h) (B,T,C);
    shallow (B,T,C), the output of block k ~ 20 % of depth. Shift and
    stop-gradient (sg) are done here; pred's last position has no
    target. Default weight lambda = 1.0 (the caller's). Float32
    (float64 kept). Needs T >= 2. Cost O(T C).
    """
    if pred.shape != shallow.shape:
        raise ValueError(
            "pred and shallow must have the same shape, got "
            f"{tuple(pred.shape)} and {tuple(shallow.shape)}")
    if pred.size(1) < 2:
        raise ValueError("nitp needs T >= 2 positions (position t "
                         f"predicts t+1), got T = {pred.size(1)}")
    prediction = at_least_fp32(pred[:, :-1])
    target = at_least_fp32(shallow[:, 1:].detach())
    with full_fp32(pred.device.type):
        cos = F.cosine_similarity(prediction, target, dim=-1)
        return (1 - cos).mean()


def cwt(h, targets, wte, ignore_index=-1, tau=1.0):
    """Contrastive weight tying, the headless LM objective (Godey et
    al., ICLR 2024, Sec. 3.2).

    Over the N valid positions, with H (N,C) their final states and
    E_y (N,C) = wte[their targets]:
        logits = H E_y^T / tau     (N x N, raw dot products)
        L = mean_n [ logsumexp_m logits[n, m] - logits[n, n] ]
    over every position in the batch (same tokens included). No LM
    head. N = 0 gives 0. tau (default 1): the released code's
    temperature (NathanGodey/headless-lm, cwt_loss).

    h (B,T,C), targets (B,T), wte (V,C). Float32 (float64 kept). A
    fixed (B*T x B*T) matrix, ignored positions masked out. Cost
    O((B T)^2 C) time, O((B T)^2) memory.
    """
    flat_targets = targets.reshape(-1)
    valid = flat_targets != ignore_index
    position = torch.arange(valid.numel(), device=valid.device)
    diagonal_target = torch.where(valid, position, -100)
    safe_targets = torch.where(valid, flat_targets, 0)
    with full_fp32(h.device.type):
        states = at_least_fp32(h.reshape(-1, h.size(-1)))
        next_embeddings = at_least_fp32(wte[safe_targets])
        logits = states @ next_embeddings.t() / tau  # (B*T, B*T)
        # ignored positions leave the denominator (columns) and, by
        # their target -100, the average (rows)
        logits = _mask_out(logits, valid.unsqueeze(0))
        total = F.cross_entropy(logits, diagonal_target, ignore_index=-100,
                                reduction="sum")
    return total / valid.sum().clamp_min(1)
