"""
Every training loss of this repository, each one plain function: tensors in, scalar out.

A loss never reaches into the model. The model returns logits and hidden states (model.py);
objective.Objective calls the functions here and adds them up with the weights a config names.
Each docstring gives its loss's formula, defaults and edge cases, and the paper section it follows.
"""

import functools
import math

import torch
from torch.nn import functional as F

# at_least_fp32 is the repository's one upcast (half precision -> float32, float64 kept), full_fp32
# its no-autocast, no-TF32 region
from model import at_least_fp32, full_fp32


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
    logits = at_least_fp32(logits)
    if margin is not None:
        logits = threshold_logits(logits, targets, margin, ignore_index)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=ignore_index)


def _head_chunk(logits, targets, ignore_index, margin):
    """(token losses (n,) in float32, d token loss / d logits (n, V) in the logits' dtype) of one
    chunk of the LM head's logits, upcast to float32 and thresholded if margin is set. The gradient
    is softmax minus the one-hot target, 0 on ignored rows. Written as reductions and pointwise
    operations only, so that on a GPU torch.compile fuses it into kernels that never write float32
    logits (_head_chunk_kernel)."""
    z = at_least_fp32(logits)
    if margin is not None:
        z = threshold_logits(z, targets, margin, ignore_index)
    valid = (targets != ignore_index).unsqueeze(-1)
    target = torch.where(valid, targets.unsqueeze(-1), 0)
    lse = torch.logsumexp(z, -1, keepdim=True)
    token_loss = torch.where(valid, lse - z.gather(-1, target), 0.0).squeeze(-1)
    one_hot = torch.arange(z.size(-1), device=z.device) == target
    gradient = torch.where(valid, torch.exp(z - lse) - one_hot.to(z.dtype), 0.0)
    return token_loss, gradient.to(logits.dtype)


@functools.cache
def _head_chunk_kernel(device_type):
    """_head_chunk compiled where inductor fuses it on a GPU, as it is elsewhere."""
    return torch.compile(_head_chunk, dynamic=False) if device_type == "cuda" else _head_chunk


def _in_matmul_dtype(*tensors):
    """The tensors cast to the dtype autocast would run their matmul in (themselves without
    autocast). Cast here, not by autocast inside a forward that runs without gradients: autocast
    keeps its cast of a weight for the rest of the region, and a later use of that weight that needs
    its gradient would get the cast without one (torch 2.6 does)."""
    device_type = tensors[0].device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return tensors
    return tuple(t.to(torch.get_autocast_dtype(device_type)) for t in tensors)


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """cross_entropy(h @ weight^T, targets) over rows of h, chunk_size rows at a time. The forward
    pass also computes the gradients (through the head, from _head_chunk's), so the head's matmuls
    run once each, as without chunks, and backward only scales them."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, margin, chunk_size):
        ctx.dtypes = (h.dtype, weight.dtype)
        want_h, want_weight = ctx.needs_input_grad[:2]
        grad_weight = torch.zeros_like(weight, dtype=at_least_fp32(weight).dtype) if want_weight else None
        h, weight = _in_matmul_dtype(h, weight)
        grad_h = torch.empty_like(h) if want_h else None
        head_chunk = _head_chunk_kernel(h.device.type)
        total = 0.0
        for start in range(0, h.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            token_loss, g = head_chunk(F.linear(h[rows], weight), targets[rows], ignore_index, margin)
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
        grad_h, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return (None if grad_h is None else (grad_h * scale).to(ctx.dtypes[0]),
                None if grad_weight is None else (grad_weight * scale).to(ctx.dtypes[1]),
                None, None, None, None)

def linear_cross_entropy(h, weight, targets, ignore_index=-1, margin=None, chunk_size=4096,
                         reduction="mean"):
    """cross_entropy(h @ weight^T, targets, ignore_index, margin) -- the LM head and its loss in
    one -- without ever holding the whole (N, V) float32 logits: chunk_size rows of h at a time.
    At a 50k vocabulary and 32k positions the whole logits are 6.6 GB in float32 (and as much
    again for their gradient); a chunk of 4096 rows is 0.8 GB. Values and gradients are those of
    cross_entropy on the whole logits (thresholding included); a mean over no valid position is
    NaN, as there. reduction="none": each position's loss (0 where ignored), without gradient --
    evaluation's per-token losses. h (..., C), weight (V, C), targets (...)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    if margin is not None and margin < 0:
        raise ValueError(f"margin must be >= 0 (a negative margin would remove the target), got {margin}")
    h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
    if reduction == "none":
        with torch.no_grad():
            h, weight = _in_matmul_dtype(h, weight)
            return torch.cat([_head_chunk(F.linear(h[i:i + chunk_size], weight), targets[i:i + chunk_size],
                                          ignore_index, margin)[0]
                              for i in range(0, h.size(0), chunk_size)])
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    return _ChunkedHeadCrossEntropy.apply(h, weight, targets, ignore_index, margin, chunk_size)


# ----------------------------------------------------------------------------------------------
# Representation-level losses (SimReg, dispersion, NITP, CWT; each docstring cites its paper).
# Each works on hidden states, not on logits. They share three habits: half precision is upcast to
# float32 (at_least_fp32; float64 stays float64) and autocast and TF32 are switched off inside
# (full_fp32), so the similarity matmuls really run in that precision; masked entries get _mask_out's
# finite fill (sets that may be empty go through _masked_logsumexp), so an empty set gives a very
# negative number instead of -inf and no NaN ever reaches a gradient; and nothing calls .item() or
# indexes with a boolean mask, so no loss forces a host-device sync.
# ----------------------------------------------------------------------------------------------

def _mask_out(x, keep):
    """x with the entries where `keep` is False replaced by a finite, very negative number: a
    quarter of the dtype's minimum, so that the difference of two such results cannot overflow.
    In a logsumexp or softmax they weigh nothing, yet never make an -inf, and masked_fill passes
    no gradient to them."""
    return x.masked_fill(~keep, torch.finfo(x.dtype).min / 4)


def _masked_logsumexp(x, keep, dim):
    """logsumexp over the entries where `keep` is True (_mask_out). An empty set gives about
    fill + log(n): effectively -inf, yet finite, and its gradient is exactly zero."""
    return torch.logsumexp(_mask_out(x, keep), dim=dim)


def simreg(h, labels, tau=0.01, chunk_size=None, ignore_index=-1):
    """SimReg, embedding similarity regularization (Sun et al. 2026, Sec. 3, Eq. 3).

    Within one sequence, for anchor i with label y_i (the next-token target of position i):
        P_i = {j : y_j = y_i}  (i itself included, so P_i is never empty)
        N_i = {j : y_j != y_i}
        s_ij = cos(e_i, e_j) / tau
        L_i  = logsumexp_{j in N_i} s_ij - logsumexp_{j in P_i} s_ij          (Eq. 3)
        token loss = softplus(L_i) = -log( sum_P e^s / sum_{P u N} e^s )
    a multi-positive InfoNCE: states that predict the same token are pulled together, states
    that predict different tokens are pushed apart. N_i empty -> token loss 0.

    Group-level averaging (so frequent tokens do not dominate, the paper's long-tail argument):
    in each sequence the token losses are averaged within each distinct label, those label means
    are averaged, and the result is averaged over sequences. Positions labelled ignore_index are
    dropped from anchors, P and N. A sequence (or chunk) with no valid position has no loss and
    drops out of the average over sequences; if no position in the batch is valid the result is 0
    (still attached to the graph, with zero gradient).

    chunk_size c (default None: whole sequences): each sequence is split into ceil(T/c)
    consecutive chunks (the last may be shorter), each treated as its own sequence and averaged
    with equal weight (the paper weights chunks "according to the ratio of positive and negative
    samples" without a formula; equal weighting is our choice). c >= T gives the full loss.

    h (B,T,C) hidden states, by default the ones feeding the LM head; labels (B,T).
    Defaults: tau = 0.01 (the paper's); the weight lambda = 10*sqrt(C/1024) is the caller's.
    With tau = 0.01 the logits reach +-100, so they are computed in float32 (float64 kept)
    even under bf16 autocast. Cost O(T^2 C) time and O(T^2) memory per sequence; O(T c C) and
    O(T c) with chunks.
    """
    B, T, C = h.shape
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")
        if chunk_size < T:
            # chunks become sequences of the batch; the last chunk is padded with ignored positions
            n_chunks = -(-T // chunk_size)
            pad = n_chunks * chunk_size - T
            h = F.pad(h, (0, 0, 0, pad)).reshape(B * n_chunks, chunk_size, C)
            labels = F.pad(labels, (0, pad), value=ignore_index).reshape(B * n_chunks, chunk_size)

    with full_fp32(h.device.type):
        return _simreg_sequences(at_least_fp32(h), labels, tau, ignore_index)


def _simreg_sequences(h, labels, tau, ignore_index):
    """simreg over the rows of h (S,t,C), each one sequence or chunk; autocast already off."""
    e = F.normalize(h, dim=-1)
    sim = e @ e.transpose(1, 2) / tau                                         # (S, t, t) s_ij
    valid = labels != ignore_index                                            # (S, t)
    pair = valid.unsqueeze(2) & valid.unsqueeze(1)                            # both ends kept
    same = labels.unsqueeze(2) == labels.unsqueeze(1)
    positive, negative = pair & same, pair & ~same
    contrast = _masked_logsumexp(sim, negative, -1) - _masked_logsumexp(sim, positive, -1)
    # softplus of an (almost) -inf L_i is exactly 0 with zero gradient: the N_i-empty case
    token_loss = F.softplus(contrast)

    # Group averaging without a scatter: anchor i's label occurs |P_i| times in its sequence, so
    # weighting each token by 1/|P_i| sums to one per label, and sum_i 1/|P_i| counts the labels.
    group_size = positive.sum(-1).to(token_loss.dtype)                       # |P_i|, 0 if ignored
    weight = torch.where(valid, 1.0 / group_size.clamp_min(1), 0.0)
    n_labels = weight.sum(-1)                                                 # distinct labels
    has_valid = valid.any(-1)                         # a sequence without one drops out
    per_sequence = (weight * token_loss).sum(-1) / torch.where(has_valid, n_labels, 1.0)
    return (per_sequence * has_valid).sum() / has_valid.sum().clamp_min(1)


def _angular_distance(z):
    """The paper's angular distance between the states of each sequence (Algorithm 1), (B,T,T):
    D = arccos(cos) / pi in [0, 1] (0 parallel, 1/2 orthogonal, 1 opposite), with
    z_hat = z / (|z| + eps) and the cosine clamped to [-1 + eps, 1 - eps], eps = 1e-4: arccos of the
    cosine is better conditioned than the cosine itself, and the clamp keeps its slope finite."""
    eps = 1e-4
    z_hat = z / (z.norm(dim=-1, keepdim=True) + eps)
    return torch.arccos((z_hat @ z_hat.transpose(1, 2)).clamp(-1 + eps, 1 - eps)) / math.pi


def _angular_distance_released(z):
    """The released code's angular distance: z_hat = z / (|z| + 1e-2), and the cosine clamped to
    [-0.75, 0.75] in value only (straight-through: the gradient is the unclamped cosine's)."""
    z_hat = z / (z.norm(dim=-1, keepdim=True) + 1e-2)
    cos = z_hat @ z_hat.transpose(1, 2)
    return torch.arccos(cos + (cos.clamp(-0.75, 0.75) - cos).detach()) / math.pi


def _off_diagonal(T, device):
    return ~torch.eye(T, dtype=torch.bool, device=device)


def _dispersion_angular(z, tau, form):
    """log-mean-exp over pairs i != j of -D_ij / tau: a soft minimum of the distances, so the
    closest pairs are pushed apart hardest. The released code adds 1e-2 inside (a shift of the
    value, no gradient)."""
    B, T, _ = z.shape
    distance = _angular_distance(z) if form == "paper" else _angular_distance_released(z)
    logits = (-distance / tau + (0.0 if form == "paper" else 1e-2)).reshape(B, T * T)
    per_sequence = _masked_logsumexp(logits, _off_diagonal(T, z.device).reshape(1, T * T), -1)
    return (per_sequence - math.log(T * (T - 1))).mean()


def _dispersion_orthogonalization(z, tau, form):
    """mean over pairs i != j of max(0, 1/2 - D_ij)^2: only pairs closer than orthogonal (acute
    angles) are pushed apart."""
    T = z.size(1)
    distance = _angular_distance(z) if form == "paper" else _angular_distance_released(z)
    hinge = F.relu(0.5 - distance).square()
    return (hinge * _off_diagonal(T, z.device)).sum((1, 2)).div(T * (T - 1)).mean()


def _dispersion_decorrelation(z, tau, form):
    """The released code's token form, the same in both forms: each token standardised over its
    channels, and the squared correlations between tokens (a T x T matrix) off the diagonal."""
    T, C = z.shape[1:]
    z_c = (z - z.mean(-1, keepdim=True)) / z.std(-1, keepdim=True).clamp_min(1e-4)  # unbiased std
    cov = z_c @ z_c.transpose(1, 2) / (C - 1)                                         # (B, T, T)
    return (cov.square() * _off_diagonal(T, z.device)).sum((1, 2)).div(T * (T - 1)).mean()


def _dispersion_decorrelation_features(z, tau, form):
    """The paper's text's form (Sec. 4.4: "reduces the correlations between feature dimensions"):
    each channel standardised over the sequence's T tokens, and the squared correlations between
    channels (a C x C matrix) off the diagonal."""
    T, C = z.shape[1:]
    z_c = (z - z.mean(1, keepdim=True)) / z.std(1, keepdim=True).clamp_min(1e-4)    # unbiased std over T
    cov = z_c.transpose(1, 2) @ z_c / (T - 1)                                         # (B, C, C)
    return (cov.square() * _off_diagonal(C, z.device)).sum((1, 2)).div(C * (C - 1)).mean()


def _dispersion_l2_repel(z, tau, form):
    """log-mean-exp over all T^2 pairs, i = j included, of -|z_i - z_j|^2 / (C tau), plus a norm
    term that keeps the states from spreading out by simply growing. Each diagonal term is
    exp(0) = 1, so the log-mean-exp never falls below -log T however far apart the states are
    pushed. The released code: distances not divided by C, and 1e-2 added inside."""
    B, T, C = z.shape
    # squared distances via |a|^2 + |b|^2 - 2ab (no (B,T,T,C) difference tensor); a state's distance
    # to itself is set to 0, not computed: the rounding noise of |a|^2 + |a|^2 - 2a.a had a gradient
    # that, in a TF32 backward on CUDA, outweighed the released form's true one 5 to 1 (results/gpu.md)
    sq_norm = z.square().sum(-1)
    sq_dist = sq_norm.unsqueeze(2) + sq_norm.unsqueeze(1) - 2 * z @ z.transpose(1, 2)
    sq_dist = sq_dist.masked_fill(~_off_diagonal(T, z.device), 0.0).clamp_min(0)
    distance, shift = (sq_dist / C, 0.0) if form == "paper" else (sq_dist, 1e-2)
    per_sequence = torch.logsumexp((-distance / tau + shift).reshape(B, T * T), -1)
    return (per_sequence - 2 * math.log(T)).mean() + 0.1 * z.square().mean()


def _dispersion_l2_repel_norm(z, tau, form):
    """l2_repel's norm term alone, the same in both forms (an ablation, not in the paper): the
    released l2_repel's repulsion terms, exp(-|z_i - z_j|^2) of states far apart, are 0 in float32."""
    return 0.1 * z.square().mean()


DISPERSION_VARIANTS = {"angular": _dispersion_angular, "decorrelation": _dispersion_decorrelation,
                       "decorrelation_features": _dispersion_decorrelation_features,
                       "l2_repel": _dispersion_l2_repel, "l2_repel_norm": _dispersion_l2_repel_norm,
                       "orthogonalization": _dispersion_orthogonalization}
DISPERSION_FORMS = ("paper", "authors")
AUTHORS_MAX_POSITIONS = 256  # the released code's positions per sequence when T is longer


def dispersion(hidden_states, tau=1.0, variant="angular", form="paper"):
    """Dispersion loss and its alternatives (Liu et al., Sec. 4.4, Table 1, App. A Algorithm 1).

    Counteracts "embedding condensation": the states of one sequence drifting towards a single
    direction as depth grows. For each layer's z (B,T,C), per sequence, over pairs i != j (i = j
    excluded except in l2_repel; pairs never cross sequences):
      angular (default, Algorithm 1):
          z_hat = z / (|z| + eps),  cos = z_hat z_hat^T clamped to [-1+eps, 1-eps],  eps = 1e-4
          (Algorithm 1 names eps without a value; 1e-4 is an earlier release of the authors' code)
          D_ij = arccos(cos_ij) / pi
          loss = logsumexp_{i!=j}(-D_ij / tau) - log(T(T-1))
          (Algorithm 1 also adds eps inside the logsumexp: a constant 1e-4, left out here)
      decorrelation: Z_c = (z - mean_c z) / std_c z per token, unbiased std (clamped at eps so
          a constant token gives no 0/0); Cov = Z_c Z_c^T / (C-1), a T x T token-by-token
          matrix; loss = mean_{m!=n} Cov_mn^2. The paper's text (Sec. 4.4) and Table 1 speak of
          the C x C covariance between feature dimensions; this is the released code's token
          form (docs/fidelity.md), and the paper does not say which form gave its numbers.
      decorrelation_features: the text's form: Z_c = (z - mean_T z) / std_T z per channel over
          the sequence's tokens (unbiased, clamped at eps); Cov = Z_c^T Z_c / (T-1), C x C;
          loss = mean_{m!=n} Cov_mn^2. (Table 1 standardises over d and divides by d - 1, which
          mixes the two readings; Sec. 4.4's "correlations between feature dimensions" decides.)
      l2_repel: D_ij = |z_i - z_j|^2 / C (width-scaled, as in the authors' later code);
          loss = logsumexp_{all i, j}(-D_ij / tau) - log(T^2) + 0.1 * mean(z^2)
          Here the diagonal i = j is included (as in two of the authors' three code versions).
          Without it the loss is unbounded below as the states grow (our grids diverged); the T
          diagonal terms, each exp(0) = 1, bound the repulsion below by -log T (docs/fidelity.md).
      orthogonalization: angular D; loss = mean_{i!=j} max(0, 1/2 - D_ij)^2
      l2_repel_norm: l2_repel's norm term alone, 0.1 * mean(z^2) (not in the paper: an ablation)
    The loss is the mean over sequences, then over the given layers.

    form = "authors" is the authors' released code (ChenLiu-1996/LM-Dispersion,
    lm_dispersion/dispersion.py) where it differs from the text above (docs/fidelity.md):
    z_hat = z / (|z| + 1e-2); cos clamped to [-0.75, 0.75] in value only (straight-through: the
    gradient is that of the unclamped cosine); 1e-2 added inside the logsumexp (angular,
    l2_repel); l2_repel's D_ij = |z_i - z_j|^2, not divided by C; and when T > 256, 256 random
    positions (the same for every sequence, drawn per layer). Decorrelation (either) is the same in both.
    On condensed states (every state of a sequence near one direction) the two forms' gradients
    differ several-fold: the paper's clamp near +-1 keeps arccos' steep slope, the released
    +-0.75 value clamp and straight-through gradient do not.

    hidden_states: a list of (B,T,C) tensors (by default every block's residual output) or one
    tensor. Defaults: tau = 1.0 and the weight lambda = 0.1 (the paper's; the caller applies
    lambda). Computed in float32 (float64 kept) even under autocast. Needs T >= 2. Every
    position given is used (any subsampling is the caller's). Cost O(T^2 C) time and O(T^2)
    memory per layer and sequence.
    """
    if variant not in DISPERSION_VARIANTS:
        raise ValueError(f"unknown dispersion variant {variant!r}; valid: {', '.join(DISPERSION_VARIANTS)}")
    if form not in DISPERSION_FORMS:
        raise ValueError(f"unknown dispersion form {form!r}; valid: {', '.join(DISPERSION_FORMS)}")
    layers = [hidden_states] if torch.is_tensor(hidden_states) else list(hidden_states)
    if not layers:
        raise ValueError("dispersion needs at least one layer of hidden states")
    if layers[0].size(1) < 2:
        raise ValueError(f"dispersion needs T >= 2 positions (pairs i != j), got T = {layers[0].size(1)}")
    with full_fp32(layers[0].device.type):
        if form == "authors" and layers[0].size(1) > AUTHORS_MAX_POSITIONS:
            layers = [z[:, torch.randperm(z.size(1), device=z.device)[:AUTHORS_MAX_POSITIONS]]
                      for z in layers]
        per_layer = [DISPERSION_VARIANTS[variant](at_least_fp32(z), tau, form) for z in layers]
    return torch.stack(per_layer).mean()


def nitp(pred, shallow):
    """NITP, next implicit token prediction (NITP, ICML 2026, "cosine similarity loss").

        L = mean_{b, t < T-1} [ 1 - cos( pred[b, t], stopgrad(shallow[b, t+1]) ) ]

    The final state, through a projection head P, predicts the shallow-layer representation of
    the next token: a continuous target next to the discrete next-token one. pred = P(h) (B,T,C);
    shallow = z (B,T,C), the output of block k ~ 20 % of depth. The shift t -> t+1 and the
    stop-gradient are done here: the shallow layer is an anchor, not pulled towards the
    prediction, and the last position of pred has no target (zero gradient).
    Default weight lambda = 1.0 (the caller's). Computed in float32 (float64 kept). Needs T >= 2.
    Cost O(T C) per sequence.
    """
    if pred.shape != shallow.shape:
        raise ValueError(f"pred and shallow must have the same shape, "
                         f"got {tuple(pred.shape)} and {tuple(shallow.shape)}")
    if pred.size(1) < 2:
        raise ValueError(f"nitp needs T >= 2 positions (position t predicts t+1), got T = {pred.size(1)}")
    prediction = at_least_fp32(pred[:, :-1])
    target = at_least_fp32(shallow[:, 1:].detach())
    with full_fp32(pred.device.type):
        return (1 - F.cosine_similarity(prediction, target, dim=-1)).mean()


def cwt(h, targets, wte, ignore_index=-1, tau=1.0):
    """Contrastive weight tying, the headless LM objective (Godey et al., ICLR 2024, Sec. 3.2).

    Over the N valid positions of the batch (targets != ignore_index), with H (N,C) their final
    states and E_y (N,C) = wte[their targets], the input embeddings of the next tokens:
        logits = H E_y^T / tau          (N x N, raw dot products; the paper's tau is 1)
        L = mean_n [ logsumexp_m logits[n, m] - logits[n, n] ]
    i.e. cross-entropy whose target is the diagonal: each state must pick the embedding of its
    own next token among the embeddings at every other position of the batch. Other positions
    holding the same token stay in the denominator (the paper's negatives are "every input
    embedding at a different position in the batch"), so with a small vocabulary many negatives
    are the target itself. No LM head is computed. N = 0 gives 0. tau: the released code's
    temperature (NathanGodey/headless-lm, engine/tasks/pretraining/utils.py, cwt_loss; default 1).

    h (B,T,C), targets (B,T), wte (V,C). Logits in float32 (float64 kept) even under autocast.
    Computed as a fixed-shape (B*T x B*T) matrix with ignored positions masked out of both rows
    and columns (no data-dependent shapes, no sync). Cost O((B T)^2 C) time, O((B T)^2) memory.
    """
    C = h.size(-1)
    flat_targets = targets.reshape(-1)
    valid = flat_targets != ignore_index
    position = torch.arange(valid.numel(), device=valid.device)
    diagonal_target = torch.where(valid, position, -100)
    with full_fp32(h.device.type):
        states = at_least_fp32(h.reshape(-1, C))
        next_embeddings = at_least_fp32(wte[torch.where(valid, flat_targets, 0)])
        logits = states @ next_embeddings.t() / tau                          # (B*T, B*T)
        # ignored positions leave the denominator (columns) and the average (rows)
        logits = _mask_out(logits, valid.unsqueeze(0))
        total = F.cross_entropy(logits, diagonal_target, ignore_index=-100, reduction="sum")
    return total / valid.sum().clamp_min(1)
