"""
The mixture-of-experts MLP of model.py's LlamaBlock (n_expert > 1).
Design notes: docs/parallelism.md.
"""

import math

import torch
import torch.nn as nn
from torch.nn import functional as F


def balanced_sizes(slots, n_expert):
    """Rows per expert for `slots` rows spread evenly, the first
    experts one more."""
    return [slots // n_expert + (e < slots % n_expert)
            for e in range(n_expert)]


def use_grouped_mm(x, weight):
    """Whether the dropless path can run as torch._grouped_mm: on CUDA,
    in bf16 (autocast's or the weights' dtype), rows of 16-byte steps."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda):
        return False
    dtype = weight.dtype
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    rows_fit = all(n % 8 == 0 for n in weight.shape[1:])
    return dtype == torch.bfloat16 and rows_fit


def swiglu(x, gate, up, down):
    """down(silu(gate(x)) * up(x)); weights (out, in) as nn.Linear's,
    or stacks of them."""
    return (F.silu(x @ gate.mT) * (x @ up.mT)) @ down.mT


def grouped_swiglu(rows, counts, gate, up, down):
    """swiglu of rows sorted by expert, counts[e] of them expert e's,
    as torch._grouped_mm calls in bf16 (no host sync)."""
    offsets = counts.cumsum(0).to(torch.int32)
    rows = rows.to(torch.bfloat16)
    gate, up, down = (w.to(torch.bfloat16).mT for w in (gate, up, down))
    hidden = (F.silu(torch._grouped_mm(rows, gate, offs=offsets))
              * torch._grouped_mm(rows, up, offs=offsets))
    return torch._grouped_mm(hidden, down, offs=offsets)


def looped_swiglu(rows, sizes, gate, up, down):
    """The same, expert by expert."""
    return torch.cat([swiglu(part, gate[e], up[e], down[e])
                      for e, part in enumerate(rows.split(sizes))])


def dropless_outputs(x, expert, counts, experts):
    """Each routed slot's expert output (k N, C); expert (k N,) is each
    slot's expert, counts (E,) the slots per expert, experts (gate, up,
    down). Sorted by expert, each expert over its own rows."""
    N = x.size(0)
    order = torch.argsort(expert, stable=True)
    rows = x[order % N]  # slot j N + n is token n's
    if use_grouped_mm(x, experts[0]):
        y = grouped_swiglu(rows, counts, *experts)
    else:
        if x.device.type == "meta":  # no routing to count
            sizes = balanced_sizes(expert.numel(), len(counts))
        else:
            sizes = counts.tolist()  # a host sync
        y = looped_swiglu(rows, sizes, *experts)
    return torch.zeros_like(y).index_copy(0, order, y)


def capacity_outputs(x, expert, chosen, capacity, experts):
    """The same at `capacity` slots per expert, as batched matmuls, and
    which slots were kept (k N,); chosen (k N, E): each slot's expert,
    one-hot. A dropped slot's output is garbage: weigh it by 0."""
    E = chosen.size(1)
    k = expert.numel() // x.size(0)
    place = ((chosen.cumsum(dim=0) - 1) * chosen).sum(dim=1)  # (k N,)
    kept = place < capacity
    # a dropped slot adds 0 to slot 0
    where = torch.where(kept, expert * capacity + place, 0)
    tokens = x.repeat(k, 1) * kept[:, None].to(x.dtype)  # (k N, C)
    buffer = x.new_zeros(E * capacity, x.size(1))
    buffer = buffer.index_add(0, where, tokens).view(E, capacity, -1)
    out = swiglu(buffer, *experts).view(E * capacity, -1)
    return out[where], kept


class MixtureOfExperts(nn.Module):
    """Mixtral's MLP (Jiang et al. 2024; the SimReg paper's Mixtral-8x1B,
    Table 4): a softmax router in fp32, each token to its top_k experts,
    their SwiGLU outputs mixed with the top_k probabilities
    renormalised: sum_j p_j / sum_i p_i * expert_j(x).

    moe_routing 'capacity' (static shapes): each expert takes
    ceil(capacity_factor * N * top_k / E) slots, at most N (Switch
    Transformer, Sec. 2.2), first choices first, then in token order
    (GShard, Algorithm 1); the rest are dropped (dropped_fraction).
    capacity_factor 0: capacity N. moe_routing 'dropless': each expert
    over its own rows only (MegaBlocks, Gale et al. 2022).

    aux_loss: the load-balancing loss E * sum_e f_e * P_e (Switch
    Transformer, eq. 4), f_e = fraction of the N * top_k routed slots
    that went to expert e (before any drop), P_e = mean router
    probability of e: 1 when balanced, E when one expert takes all."""

    def __init__(self, config):
        super().__init__()
        E = config.n_expert
        C = config.n_embd
        H = config.ffn_width
        self.router = nn.Linear(C, E, bias=False)
        # the experts' (out, in) matrices stacked, N(0, init_std)
        self.gate = nn.Parameter(torch.randn(E, H, C) * config.init_std)
        self.up = nn.Parameter(torch.randn(E, H, C) * config.init_std)
        self.down = nn.Parameter(torch.randn(E, C, H) * config.init_std)
        self.top_k = config.top_k
        self.capacity_factor = config.capacity_factor
        self.dropless = config.moe_routing == "dropless"
        self.aux_loss = None
        self.dropped_fraction = None

    def forward(self, x):
        shape = x.shape
        E = self.gate.size(0)
        k = self.top_k
        x = x.reshape(-1, shape[-1])  # (N, C)
        N = x.size(0)
        logits = self.router(x)
        # the softmax in fp32, also under autocast
        fp32 = torch.promote_types(logits.dtype, torch.float32)
        probs = F.softmax(logits.to(fp32), dim=-1)  # (N, E)
        top_p, top_e = probs.topk(k, dim=-1)  # (N, k)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        # the k N routed slots: slot j N + n is token n's j-th choice
        expert = top_e.t().reshape(-1)  # (k N,)
        chosen = expert[:, None] == torch.arange(E, device=x.device)
        f = chosen.mean(dim=0, dtype=probs.dtype)
        self.aux_loss = E * (f * probs.mean(dim=0)).sum()
        weight = top_p.t().reshape(-1, 1)  # (k N, 1)
        # a whole graph cannot hold the loop's data-dependent sizes:
        # compiled, the loop gives way to capacity N (the same outputs)
        experts = (self.gate, self.up, self.down)
        if self.dropless and (use_grouped_mm(x, self.gate)
                              or not torch.compiler.is_compiling()):
            y = dropless_outputs(x, expert, chosen.sum(dim=0), experts)
            self.dropped_fraction = probs.new_zeros(())
        else:
            capacity = N
            if self.capacity_factor:
                capacity = min(N, math.ceil(self.capacity_factor * N * k / E))
            y, kept = capacity_outputs(x, expert, chosen, capacity, experts)
            self.dropped_fraction = 1 - kept.mean(dtype=probs.dtype).detach()
            weight = weight * kept[:, None]  # 0 for a dropped slot
        mixed = (y * weight).view(k, N, -1).sum(dim=0)
        return mixed.type_as(x).view(shape)
