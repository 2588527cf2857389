"""
Mixtral's sparse MLP (Jiang et al. 2024; the SimReg paper's Mixtral-8x1B, Table 4), the MLP of
model.py's LlamaBlock when n_expert > 1. A linear router scores the experts, each token goes to its
top_k, and their SwiGLU outputs are mixed with the top_k probabilities renormalised to sum to 1.
Two ways to run the experts over the N * top_k routed (token, expert) slots, GPTConfig.moe_routing:

    capacity    static shapes: every expert runs over a fixed number of slots, filled or not; a slot
                past its expert's capacity is dropped (static shapes for a whole-graph compile; the reference)
    dropless    the slots sorted by expert, each expert over its own rows only: nothing dropped,
                the routed work and no more (MegaBlocks' "dropless MoE", Gale et al. 2022; here
                torch._grouped_mm on a GPU)
"""

import math

import torch
import torch.nn as nn
from torch.nn import functional as F


def balanced_sizes(slots, n_expert):
    """Rows per expert when `slots` rows are spread as evenly as they can be (the first experts take
    one more): what the dropless path assumes on the meta device, where no routing can be counted."""
    return [slots // n_expert + (e < slots % n_expert) for e in range(n_expert)]


def use_grouped_mm(x, weight):
    """Whether the dropless path runs as torch._grouped_mm: on CUDA where this torch has it, with the
    matmuls in bf16 (autocast's dtype, or the weights' own, e.g. FSDP's bf16 gathers) and rows of a
    multiple of 16 bytes (its stride rule). Its fast kernel is Hopper's and Blackwell's; elsewhere
    torch falls back to a loop over the groups."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda):
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
    return dtype == torch.bfloat16 and weight.size(1) % 8 == 0 and weight.size(2) % 8 == 0


def grouped_swiglu(rows, counts, gate, up, down):
    """down(silu(gate(x)) * up(x)) of rows sorted by expert, counts[e] of them expert e's, as three
    torch._grouped_mm calls in bf16: rows (R, C) by the stacked (E, C, out) views of the weights,
    offsets the int32 running ends of the groups. No host sync: the counts stay on the device."""
    offsets = counts.cumsum(0).to(torch.int32)
    rows = rows.to(torch.bfloat16)
    gate, up, down = (w.to(torch.bfloat16).transpose(1, 2) for w in (gate, up, down))
    hidden = (F.silu(torch._grouped_mm(rows, gate, offs=offsets))
              * torch._grouped_mm(rows, up, offs=offsets))
    return torch._grouped_mm(hidden, down, offs=offsets)


def looped_swiglu(rows, sizes, gate, up, down):
    """The same, expert by expert over split rows: sizes (a list) are the groups' lengths."""
    parts = [(F.silu(part @ gate[e].t()) * (part @ up[e].t())) @ down[e].t()
             for e, part in enumerate(rows.split(sizes))]
    return torch.cat(parts)


def dropless_outputs(x, expert, counts, gate, up, down):
    """Each routed slot's expert output (k N, C), in the order of `expert` (k N,), the slots' experts;
    counts (E,) is how many slots each expert has. The slots sorted by expert (a stable sort: in slot
    order within an expert), each token's row gathered, every expert run over its own rows, the
    outputs put back in slot order. The loop off CUDA reads the counts on the host (a sync, and shapes
    torch.compile cannot fix); on meta it takes balanced_sizes, so a step measured there holds the
    k N rows a real one does."""
    E, N = gate.size(0), x.size(0)
    order = torch.argsort(expert, stable=True)
    rows = x[order % N]  # slot j N + n is token n's
    if use_grouped_mm(x, gate):
        y = grouped_swiglu(rows, counts, gate, up, down)
    else:
        sizes = balanced_sizes(expert.numel(), E) if x.device.type == "meta" else counts.tolist()
        y = looped_swiglu(rows, sizes, gate, up, down)
    return torch.zeros_like(y).index_copy(0, order, y)


def capacity_outputs(x, expert, chosen, capacity, gate, up, down):
    """Each routed slot's expert output (k N, C) at a fixed `capacity` per expert, and which slots were
    kept (k N,): a slot's place in its expert's queue (chosen (k N, E): its expert, one-hot) decides;
    the kept slots are scattered into an (E, capacity, C) buffer and the experts run as one batched
    matmul per projection. A dropped slot's output is garbage: the caller weighs it by 0."""
    E, k = gate.size(0), expert.numel() // x.size(0)
    place = ((chosen.cumsum(dim=0) - 1) * chosen).sum(dim=1)  # (k N,)
    kept = place < capacity
    where = torch.where(kept, expert * capacity + place, 0)  # a dropped slot adds 0 to slot 0
    tokens = x.repeat(k, 1) * kept[:, None].to(x.dtype)  # (k N, C)
    buffer = x.new_zeros(E * capacity, x.size(1)).index_add(0, where, tokens).view(E, capacity, -1)
    hidden = F.silu(buffer @ gate.transpose(1, 2)) * (buffer @ up.transpose(1, 2))
    return (hidden @ down.transpose(1, 2)).view(E * capacity, -1)[where], kept


class MixtureOfExperts(nn.Module):
    """Mixtral's MLP: softmax of the router in fp32 over all experts, each token to its top_k,
    the outputs mixed with the top_k probabilities renormalised: sum_j p_j / sum_i p_i * expert_j(x).

    moe_routing 'capacity' -- static shapes, no host sync (so torch.compile takes it whole and FSDP's
    prefetch never waits): each expert has `capacity` = ceil(capacity_factor * N * top_k / E) slots
    (at most N; Switch Transformer, Sec. 2.2). The N * top_k routed slots are numbered within their
    expert (first choices before second choices, then in token order, as GShard's Algorithm 1),
    scattered into an (E, capacity, C) buffer, and the experts run as one batched matmul per
    projection on their stacked weights: gate and up (E, hidden, C), down (E, C, hidden), each
    expert's matrix laid out as nn.Linear's. A slot past its expert's capacity is dropped: it adds
    nothing, the residual stream carries the token on. capacity_factor 0 (or >= E / top_k) gives
    capacity N: nothing can be dropped, and every expert computes all N rows (E / top_k times the
    routed work).
    moe_routing 'dropless' -- the routed work only (dropless_outputs): N * top_k rows in all,
    nothing dropped, the same outputs as capacity N. Data-dependent group sizes: a host sync off CUDA.
    `dropped_fraction` (a tensor, detached) is the share of the N * top_k slots dropped in the last
    forward (0 when dropless).

    aux_loss: the load-balancing loss E * sum_e f_e * P_e (Switch Transformer, eq. 4),
    f_e = fraction of the N * top_k routed slots that went to expert e (before any drop),
    P_e = mean router probability of e. It is 1 for a perfectly balanced router and E when one
    expert takes all. Hugging Face's Mixtral (load_balancing_loss_func) counts f_e per top-k
    choice and sums over the k choices, i.e. top_k times ours (2 at balance for top-2): its
    router_aux_loss_coef of 0.02 is a weight of 0.04 on this loss. (It also pools the layers'
    tokens before taking the product; ours is the mean over layers of each layer's loss.)"""

    def __init__(self, config):
        super().__init__()
        E, C, H = config.n_expert, config.n_embd, config.ffn_width
        self.router = nn.Linear(C, E, bias=False)
        # each expert's matrices stacked, (E, out, in) as nn.Linear's; N(0, init_std) like the model's init
        self.gate = nn.Parameter(torch.randn(E, H, C) * config.init_std)
        self.up = nn.Parameter(torch.randn(E, H, C) * config.init_std)
        self.down = nn.Parameter(torch.randn(E, C, H) * config.init_std)
        self.top_k, self.capacity_factor = config.top_k, config.capacity_factor
        self.dropless = config.moe_routing == "dropless"
        self.aux_loss = self.dropped_fraction = None

    def forward(self, x):
        shape, E, k = x.shape, self.gate.size(0), self.top_k
        x = x.reshape(-1, shape[-1])  # (N, C)
        N = x.size(0)
        logits = self.router(x)  # softmax in fp32 even under autocast (model.at_least_fp32)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (N, E)
        top_p, top_e = probs.topk(k, dim=-1)  # (N, k)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        # the k N routed slots, first choices before second choices: slot j N + n is token n's j-th
        expert = top_e.t().reshape(-1)  # (k N,)
        chosen = expert[:, None] == torch.arange(E, device=x.device)  # (k N, E), one True per row
        self.aux_loss = E * (chosen.mean(dim=0, dtype=probs.dtype) * probs.mean(dim=0)).sum()
        weight = top_p.t().reshape(-1, 1)  # (k N, 1)
        # compiled without torch._grouped_mm, dropless takes the static path at capacity N (the same outputs):
        # the loop's sizes come from the data, which a whole-graph compile cannot take on every torch
        if self.dropless and (use_grouped_mm(x, self.gate) or not torch.compiler.is_compiling()):
            y = dropless_outputs(x, expert, chosen.sum(dim=0), self.gate, self.up, self.down)
            self.dropped_fraction = probs.new_zeros(())
        else:
            capacity = min(N, math.ceil(self.capacity_factor * N * k / E)) if self.capacity_factor else N
            y, kept = capacity_outputs(x, expert, chosen, capacity, self.gate, self.up, self.down)
            self.dropped_fraction = 1 - kept.mean(dtype=probs.dtype).detach()
            weight = weight * kept[:, None]  # 0 for a dropped slot
        return (y * weight).view(k, N, -1).sum(dim=0).type_as(x).view(shape)
