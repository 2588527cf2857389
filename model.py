"""
A GPT-2 style language model, and the LLaMA / Mixtral variants the SimReg paper scales to, small
enough to read in one sitting. `GPTConfig.arch` picks the block:

    gpt2    pre-LN LayerNorm, learned positions, GELU MLP (the toy experiments)
    llama   RMSNorm, rotary positions (RoPE), SwiGLU MLP, no biases, untied embeddings (the
            SimReg paper's LLaMA-2, App. A.1); with n_expert > 1 the MLP is a Mixtral mixture
            of experts (moe.py)

The model knows nothing about losses. Its forward pass returns the logits and, when asked, the
hidden states that representation-level losses work on:

    hidden_states[0]      embedding output (token + position), the input of block 1
    hidden_states[l]      residual stream after block l, l = 1..n_layer
    hidden_states[-1]     the final state after ln_f, the one that feeds the LM head

A mixture-of-experts model also leaves its router's load-balancing loss of the last forward
pass in `model.aux_loss`. objective.Objective turns these into weighted losses, the router's
included. Parallelism, optimizers and the Stop Jostling "separated embeddings" (an
optimizer-side property, see optim.py) live outside.
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from moe import MixtureOfExperts


@dataclass
class GPTConfig:
    vocab_size: int = 130
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False        # biases in Linear and LayerNorm (GPT-2: True; the toy: False)
    tie_weights: bool = True  # LM head shares the token embedding matrix (weight tying)
    arch: str = "gpt2"        # gpt2 | llama
    # llama only
    ffn_hidden: int = 0       # SwiGLU hidden width; 0 = 8/3 n_embd rounded up to a multiple of 256
    n_expert: int = 1         # > 1: Mixtral mixture-of-experts MLP with this many experts
    top_k: int = 2            # experts per token
    capacity_factor: float = 0.0  # slots per expert: ceil(capacity_factor * tokens * top_k / n_expert),
    #                               at most all tokens; 0 = all tokens, nothing dropped (MixtureOfExperts)
    moe_routing: str = "capacity"  # capacity: static shapes, capacity_factor's slots per expert (the CPU's
    #                               path, the reference); dropless: tokens sorted by expert, each expert over
    #                               its own rows only, nothing dropped, the routed FLOPs (moe.py)
    rope_theta: float = 10000.0
    rope_layout: str = "half"  # which dimensions RoPE rotates together (apply_rope); checkpoints that
    #                            do not record it were written before it was, and rotate "interleaved"
    init_std: float = 0.01    # std of every weight matrix (LLaMA recipe); gpt2 uses 0.02

    @classmethod
    def from_config(cls, config, vocab_size):
        """The model train.py's keys describe (those of this dataclass), with the run's vocabulary
        (the dataset's, doubled for the low-resource language, or vocab_size): ValueError if bad."""
        return cls(**{**{key: config[key] for key in cls.__dataclass_fields__ if key in config},
                      "vocab_size": vocab_size})

    def __post_init__(self):
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"arch must be 'gpt2' or 'llama', got {self.arch!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.arch == "llama" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"RoPE needs an even head size, "
                             f"got n_embd / n_head = {self.n_embd // self.n_head}")
        if self.rope_layout not in ("half", "interleaved"):
            raise ValueError(f"rope_layout must be 'half' or 'interleaved', got {self.rope_layout!r}")
        if self.n_expert > 1 and not (self.arch == "llama" and 1 <= self.top_k <= self.n_expert):
            raise ValueError(f"n_expert > 1 needs arch='llama' and 1 <= top_k <= n_expert, "
                             f"got arch={self.arch!r}, top_k={self.top_k}, n_expert={self.n_expert}")
        if not self.capacity_factor >= 0:
            raise ValueError(f"capacity_factor must be >= 0, got {self.capacity_factor}")
        if self.moe_routing not in ("capacity", "dropless"):
            raise ValueError(f"moe_routing must be 'capacity' or 'dropless', got {self.moe_routing!r}")
        if self.moe_routing == "dropless" and self.capacity_factor:
            raise ValueError(f"moe_routing='dropless' has no capacity to set: capacity_factor must be 0, "
                             f"got {self.capacity_factor}")

    @classmethod
    def from_checkpoint(cls, model_config):
        """The model a checkpoint's 'model_config' describes; a LLaMA one written before the RoPE
        layout was recorded was trained with the interleaved one."""
        before = {"rope_layout": "interleaved"} if model_config.get("arch") == "llama" else {}
        return cls(**{**before, **model_config})

    @property
    def ffn_width(self):
        if self.ffn_hidden:
            return self.ffn_hidden
        return 256 * math.ceil(8 * self.n_embd / 3 / 256)

    @property
    def experts_computed(self):
        """Experts' worth of compute per token in a mixture of experts: each expert runs over all of its
        capacity slots, filled or not, min(capacity_factor * top_k, n_expert) (capacity's rounding up
        aside); n_expert when nothing may be dropped (capacity_factor 0); top_k, the routed work
        only, when dropless."""
        if self.moe_routing == "dropless":
            return self.top_k
        if not self.capacity_factor:
            return self.n_expert
        return min(self.capacity_factor * self.top_k, self.n_expert)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's own cannot drop only the bias)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    attention = staticmethod(F.scaled_dot_product_attention)  # the kernel: GPT.use_attention swaps it

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# LLaMA / Mixtral --------------------------------------------------------------

def at_least_fp32(x):
    """x in float32 if it is in a lower precision (bf16 under autocast), else as it is (float64 tests).
    The one upcast helper of the repository: losses.py and metrics.py use it too."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@contextlib.contextmanager
def full_fp32(device_type):
    """Autocast off and float32 matmuls in full float32 inside: the losses that need it (SimReg's
    similarities over tau = 0.01 reach +-100) stay exact where train.py lets the rest of a CUDA
    step use TF32 (a 10-bit mantissa, ~1e-3 relative error). The backward of those matmuls runs
    later, outside, at the step's precision."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        # (the meta device, on which plan.py measures a step, has no autocast to switch off)
        autocast_off = (torch.autocast(device_type=device_type, enabled=False) if device_type != "meta"
                        else contextlib.nullcontext())
        with autocast_off:
            yield
    finally:
        torch.set_float32_matmul_precision(saved)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019): LayerNorm without centring or bias, in fp32."""

    def __init__(self, ndim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(at_least_fp32(x), self.weight.shape, at_least_fp32(self.weight),
                          self.eps).type_as(x)


def rope_angles(seq_len, head_dim, theta, device):
    """cos and sin (T, head_dim/2), float32, of RoPE (Su et al. 2021): pair i of a head at position
    t is rotated by t * theta^(-2i/head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin, layout="half"):
    """Rotate (..., T, head_dim) by the angles (cos and sin broadcast to (..., T, head_dim/2));
    relative positions end up in q . k.
    layout "half": pair i is dimensions (i, i + head_dim/2), LLaMA's and Hugging Face's layout,
    rotated in x's dtype (bf16 under autocast) with cos and sin cast to it, as LLaMA does: two
    contiguous halves, one pointwise kernel. "interleaved": pair i is (2i, 2i+1), rotated in
    float32, exactly as runs before the layout was recorded were trained."""
    if layout == "half":
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = at_least_fp32(x).unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


class RotaryAttention(nn.Module):
    attention = staticmethod(F.scaled_dot_product_attention)  # the kernel: GPT.use_attention swaps it

    def __init__(self, config):
        super().__init__()
        self.wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.wo = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.n_head = config.n_head
        self.rope_layout = config.rope_layout

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in self.wqkv(x).split(C, dim=2))
        # rotated before the heads move in front of T: the rotation writes (B, T, n_head, head_dim) in
        # the order the projection wrote it, and the attention reads the transposed views as they are
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, head_dim/2): the same for every head
        q, k = (apply_rope(t, cos, sin, self.rope_layout) for t in (q, k))
        y = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    """C -> hidden -> C without biases: down(silu(gate(x)) * up(x)) (Shazeer 2020). The LLaMA MLP,
    one Mixtral expert, and NITP's projection head (losses.py)."""

    def __init__(self, n_embd, hidden):
        super().__init__()
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm block with RMSNorm: x + attn(norm(x)), then x + mlp(norm(x)); mlp is SwiGLU or MoE."""

    def __init__(self, config):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd)
        self.attn = RotaryAttention(config)
        self.mlp_norm = RMSNorm(config.n_embd)
        self.mlp = (MixtureOfExperts(config) if config.n_expert > 1
                    else SwiGLU(config.n_embd, config.ffn_width))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


# the model ----------------------------------------------------------------------

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        llama = config.arch == "llama"
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if llama else nn.Embedding(config.block_size, config.n_embd)  # llama: RoPE instead
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([LlamaBlock(config) if llama else Block(config)
                                for _ in range(config.n_layer)])
        self.ln_f = RMSNorm(config.n_embd) if llama else LayerNorm(config.n_embd, config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.aux_loss = None  # MoE: the router's load-balancing loss of the last forward, mean over layers
        # MoE: share of routed slots past their expert's capacity, mean over layers
        self.dropped_fraction = None
        self._rope = {}  # (T, device) -> RoPE's cos and sin (rope_cache)
        self.tie_weights()

    # Under autocast the residual stream is kept in the compute dtype (bf16), as it is under FSDP's
    # bf16 parameters: half the activation memory, and no float32 copy cast again by every matmul.
    # The norms and the losses still compute in float32. (The GPU check turns it off to measure it.)
    residual_in_compute_dtype = True

    def rope_cache(self, seq_len, device):
        """rope_angles for this length on this device, computed once (outside any inference mode,
        so that a later training step may save them for backward)."""
        key = (seq_len, str(device))
        if key not in self._rope:
            with torch.inference_mode(False):
                self._rope[key] = rope_angles(seq_len, self.config.n_embd // self.config.n_head,
                                              self.config.rope_theta, device)
        return self._rope[key]

    def tie_weights(self):
        # Weight tying (Press & Wolf 2017): one matrix is both the input embedding and the output
        # layer, so every row is trained by its use as input, as target and as non-target -- the
        # three gradient sources Stop Jostling separates.
        if self.config.tie_weights:
            self.lm_head.weight = self.wte.weight

    def initializers(self):
        """(name, fill) for every parameter, in the order the init draws its random numbers (the
        global generator of the parameter's device): fill(t) writes the initial value into a
        tensor of the parameter's full shape. init_weights fills the parameters themselves; a
        caller that fills other tensors of these shapes, in this order, gets the same numbers.
        nanoGPT/GPT-2 init: N(0, 0.02) everywhere, residual projections scaled
        by 1/sqrt(2 n_layer) so the residual stream's variance does not grow with depth."""
        if self.config.arch == "llama":  # N(0, init_std) for every matrix, ones for the norms
            normal = lambda t: nn.init.normal_(t, 0.0, self.config.init_std)  # noqa: E731
            for name, p in self.named_parameters():
                yield name, normal if p.dim() >= 2 else nn.init.ones_  # stacked experts: (E, out, in)
            return
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                yield name, lambda t: nn.init.normal_(t, mean=0.0,
                                                      std=std / math.sqrt(2 * self.config.n_layer))
            elif p.dim() == 2:
                yield name, lambda t: nn.init.normal_(t, mean=0.0, std=std)
            elif name.endswith("bias"):
                yield name, nn.init.zeros_
            else:  # LayerNorm weights
                yield name, nn.init.ones_

    @torch.no_grad()
    def init_weights(self):
        """Separate from __init__ so a model built on the meta device can be materialised
        cheaply with to_empty() and then initialised once."""
        self.tie_weights()  # to_empty() may have un-shared the tied tensor
        fill_parameters(self, self.initializers())

    def use_attention(self, kernel):
        """Every block's attention calls kernel(q, k, v, is_causal=True, ...) instead of
        F.scaled_dot_product_attention, in this model only (plan.py measures a step on the meta
        device with the CPU flash kernel's memory this way)."""
        for module in self.modules():
            if isinstance(module, (CausalSelfAttention, RotaryAttention)):
                module.attention = kernel

    def embeddings(self):
        """The weights a loss may need, by name (objective.Objective): 'input', the rows looked up for
        input tokens, and 'output', the rows the final state is scored against; on a tied model
        both are the one matrix."""
        return {"input": self.input_embedding(), "output": self.output_embedding()}

    def input_embedding(self):
        """(V, C) rows looked up for input tokens."""
        return self.wte.weight

    def output_embedding(self):
        """(V, C) rows the final state is scored against (= input_embedding() when tied)."""
        return self.lm_head.weight

    def num_params(self, non_embedding=False, active=False):
        """Parameter count; parameters() counts a tied matrix once. non_embedding drops the
        position table; active counts, of each mixture of experts, only the top_k experts a
        token runs through (Mixtral-8x7B: 47B parameters, 13B active)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n -= self.wpe.weight.numel()
        if active and self.config.n_expert > 1:
            expert = 3 * self.config.n_embd * self.config.ffn_width  # gate, up, down
            n -= self.config.n_layer * (self.config.n_expert - self.config.top_k) * expert
        return n

    def flops_per_token(self, seq_len=None, with_head=True, backward=True):
        """Training FLOPs per token (forward + backward), PaLM appendix B style:
        6 per parameter for the matmuls plus 12 * n_layer * n_embd * T for attention scores.
        with_head=False: a headless run that never computes the LM head. backward=False: the
        forward pass alone (evaluation), a third of that: 2 per parameter + 4 * n_layer * n_embd * T.
        A mixture of experts counts the experts its capacity computes (config.experts_computed), not
        the top_k a token uses: the padding of the capacity slots is work the hardware does (dropless
        routing has none: top_k)."""
        T = seq_len or self.config.block_size
        # matmul weights: the blocks and the LM head. Lookups (wpe, and wte when untied) are free.
        n = self.num_params(non_embedding=True, active=True)
        if self.config.n_expert > 1:
            expert = 3 * self.config.n_embd * self.config.ffn_width
            n += round(self.config.n_layer * (self.config.experts_computed - self.config.top_k) * expert)
        if not self.config.tie_weights:
            n -= self.wte.weight.numel()
        if not with_head:
            n -= self.lm_head.weight.numel()
        training = 6 * n + 12 * self.config.n_layer * self.config.n_embd * T
        return training if backward else training // 3

    def forward(self, idx, return_hidden_states=False, compute_logits=True):
        """idx (B, T) token ids -> logits (B, T, V), and the list of hidden states if asked.
        compute_logits=False skips the LM head (headless training, e.g. CWT): logits is None."""
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
        if self.wpe is None:  # llama: positions enter as rotations of q and k in every block
            x = self.drop(self.wte(idx))
            cos, sin = self.rope_cache(T, idx.device)
            run = lambda block, x: block(x, cos, sin)  # noqa: E731
        else:
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
            run = lambda block, x: block(x)  # noqa: E731
        device_type = idx.device.type
        autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
        if self.residual_in_compute_dtype and autocast:
            x = x.to(torch.get_autocast_dtype(device_type))
        hidden_states = [x]
        for block in self.h:
            x = run(block, x)
            hidden_states.append(x)
        if self.config.n_expert > 1:
            self.aux_loss = torch.stack([block.mlp.aux_loss for block in self.h]).mean()
            self.dropped_fraction = torch.stack([block.mlp.dropped_fraction for block in self.h]).mean()
        x = self.ln_f(x)
        hidden_states.append(x)
        logits = self.lm_head(x) if compute_logits else None
        return (logits, hidden_states) if return_hidden_states else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample max_new_tokens tokens after idx (B, T); the context is cropped to block_size."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits = self(context)[:, -1, :]
            # the largest at 0 first: a temperature near 0 is greedy, not inf / inf
            logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def fill_parameters(module, initializers):
    """Apply (name, fill) pairs to module's parameters in place, in their order."""
    parameters = dict(module.named_parameters())
    for name, fill in initializers:
        fill(parameters[name])


def initial_weights(config, seed, embeddings_seed=None):
    """{name: tensor} of the weights a fresh run seeded `seed` starts from on the CPU: train.py's
    draws (torch.manual_seed(seed), then the model's initializers in order; the GPT-2 init of
    Radford et al. 2019 as nanoGPT writes it), made here without touching the global random state.
    embeddings_seed: wte (and the head tied to it) and wpe as that seed's run draws them instead.
    A toy's tool: the whole model is drawn on the CPU (issue 40's embedding swap)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        weights = build_model(config).state_dict()
    if embeddings_seed is not None:
        names = ("wte.weight", "wpe.weight") + (("lm_head.weight",) if config.tie_weights else ())
        weights.update((k, v) for k, v in initial_weights(config, embeddings_seed).items() if k in names)
    return weights


def build_model(config, device="cpu"):
    """Build on the meta device (no memory, no init work), materialise on `device`, init once.
    At 7B scale this avoids initialising every weight twice on the CPU."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    return model
