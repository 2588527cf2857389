"""
A GPT-2 language model, and the LLaMA / Mixtral variants the SimReg
paper scales to (App. A.1). `GPTConfig.arch` picks the block:

    gpt2    LayerNorm, learned positions, GELU MLP (the toys)
    llama   RMSNorm, RoPE, SwiGLU MLP, no biases; with n_expert > 1
            the MLP is a Mixtral mixture of experts (moe.py)

The model knows nothing about losses. Its forward returns the logits
and, if asked, the hidden states the representation losses use:

    hidden_states[0]    embedding output, the input of block 1
    hidden_states[l]    residual stream after block l, l = 1..n_layer
    hidden_states[-1]   the final state after ln_f, fed to the LM head

A mixture of experts leaves its router's load-balancing loss in
`model.aux_loss`.

Design notes: docs/model.md
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from errors import (FRACTION, NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE,
                    POSITIVE_NUMBER, Settings, one_of, setting)
from moe import MixtureOfExperts


@dataclass
class GPTConfig(Settings):
    """Every key of the model, declared once with its default and rule."""
    # 0 in train.py: the dataset's; more pads the table (GPT-2: 50304)
    vocab_size: int = setting(130, NON_NEGATIVE)
    block_size: int = setting(64, POSITIVE)
    n_layer: int = setting(4, POSITIVE)
    n_head: int = setting(4, POSITIVE)
    n_embd: int = setting(128, POSITIVE)
    dropout: float = setting(0.0, FRACTION)
    bias: bool = setting(False)  # in Linear and LayerNorm (GPT-2: True)
    # the LM head is the token embedding
    tie_weights: bool = setting(True)
    arch: str = setting("gpt2", one_of("gpt2", "llama"))
    # llama only
    # SwiGLU width; 0: 8/3 n_embd, up to x256
    ffn_hidden: int = setting(0, NON_NEGATIVE)
    # > 1: a Mixtral mixture-of-experts MLP
    n_expert: int = setting(1, POSITIVE)
    top_k: int = setting(2, POSITIVE)  # experts per token
    # slots: x tokens * top_k / n_expert; 0: no token dropped
    capacity_factor: float = setting(0.0, NON_NEGATIVE_NUMBER)
    # capacity: static shapes | dropless: only the routed FLOPs
    moe_routing: str = setting("capacity", one_of("capacity", "dropless"))
    rope_theta: float = setting(10000.0, POSITIVE_NUMBER)
    # RoPE's pairs: half (i, i + d/2) | interleaved (2i, 2i+1)
    rope_layout: str = setting("half", one_of("half", "interleaved"))
    # every matrix (LLaMA); gpt2 uses 0.02
    init_std: float = setting(0.01, POSITIVE_NUMBER)

    @classmethod
    def from_config(cls, config, vocab_size):
        """The model train.py's keys describe, with the run's
        vocabulary: ValueError if bad."""
        given = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        return cls(**{**given, "vocab_size": vocab_size})

    @classmethod
    def from_checkpoint(cls, model_config):
        """The model a checkpoint's 'model_config' describes; a LLaMA
        one that predates rope_layout rotated "interleaved"."""
        llama = model_config.get("arch") == "llama"
        before = {"rope_layout": "interleaved"} if llama else {}
        return cls(**{**before, **model_config})

    def __post_init__(self):
        super().__post_init__()  # each key's rule
        head_size = self.n_embd // self.n_head
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        if self.arch == "llama" and head_size % 2:
            raise ValueError(f"RoPE needs an even head size, "
                             f"got n_embd / n_head = {head_size}")
        top_k_ok = 1 <= self.top_k <= self.n_expert
        if self.n_expert > 1 and not (self.arch == "llama" and top_k_ok):
            raise ValueError(f"n_expert > 1 needs arch='llama' and 1 <= top_k <= "
                             f"n_expert, got arch={self.arch!r}, top_k={self.top_k}, "
                             f"n_expert={self.n_expert}")
        if self.moe_routing == "dropless" and self.capacity_factor:
            raise ValueError(f"moe_routing='dropless' has no capacity to set: "
                             f"capacity_factor must be 0, got {self.capacity_factor}")

    @property
    def ffn_width(self):
        if self.ffn_hidden:
            return self.ffn_hidden
        return 256 * math.ceil(8 * self.n_embd / 3 / 256)

    @property
    def experts_computed(self):
        """Experts' worth of compute per token: every capacity slot
        runs, filled or not."""
        if self.moe_routing == "dropless":
            return self.top_k
        if not self.capacity_factor:
            return self.n_expert
        return min(self.capacity_factor * self.top_k, self.n_expert)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.c_attn = nn.Linear(C, 3 * C, bias=config.bias)
        self.c_proj = nn.Linear(C, C, bias=config.bias)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        shape = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.c_fc = nn.Linear(C, 4 * C, bias=config.bias)
        self.c_proj = nn.Linear(4 * C, C, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# LLaMA / Mixtral

def at_least_fp32(x):
    """x in float32 if it is in a lower precision (bf16 under
    autocast), else as it is (float64 tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@contextlib.contextmanager
def full_fp32(device_type):
    """Autocast off and full float32 matmuls (no TF32) inside, for
    the losses that need them."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        # the meta device (plan.py) has no autocast
        autocast_off = contextlib.nullcontext()
        if device_type != "meta":
            autocast_off = torch.autocast(device_type, enabled=False)
        with autocast_off:
            yield
    finally:
        torch.set_float32_matmul_precision(saved)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019), in fp32."""

    def __init__(self, ndim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x):
        weight = at_least_fp32(self.weight)
        y = F.rms_norm(at_least_fp32(x), self.weight.shape, weight, self.eps)
        return y.type_as(x)


def rope_angles(seq_len, head_dim, theta, device):
    """cos and sin (T, head_dim/2), float32, of RoPE (Su et al.
    2021): pair i of a head at position t is rotated by
    t * theta^(-2i/head_dim)."""
    f32 = dict(device=device, dtype=torch.float32)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, **f32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, **f32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin, layout="half"):
    """Rotate (..., T, head_dim) by the angles (cos, sin: (..., T,
    head_dim/2)). Pair i is dimensions (i, i + head_dim/2) in layout
    "half", (2i, 2i+1) in "interleaved"."""
    if layout == "half":
        cos = cos.to(x.dtype)
        sin = sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = at_least_fp32(x).unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RotaryAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.wqkv = nn.Linear(C, 3 * C, bias=False)
        self.wo = nn.Linear(C, C, bias=False)
        self.n_head = config.n_head
        self.rope_layout = config.rope_layout

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        shape = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(shape) for t in self.wqkv(x).split(C, dim=2))
        # rotated as the projection wrote them, before the heads move
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        q, k = (apply_rope(t, cos, sin, self.rope_layout) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (Shazeer 2020): the
    LLaMA MLP, a Mixtral expert, NITP's projection head."""

    def __init__(self, n_embd, hidden):
        super().__init__()
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm block with RMSNorm: x + attn(norm(x)), then
    x + mlp(norm(x)); mlp is SwiGLU or a mixture of experts."""

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


# the model

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        llama = config.arch == "llama"
        C = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, C)
        self.wpe = None if llama else nn.Embedding(config.block_size, C)
        self.drop = nn.Dropout(config.dropout)
        block = LlamaBlock if llama else Block
        self.h = nn.ModuleList([block(config) for _ in range(config.n_layer)])
        self.ln_f = RMSNorm(C) if llama else nn.LayerNorm(C, bias=config.bias)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        # MoE: the router's loss and the dropped share, layers' means
        self.aux_loss = None
        self.dropped_fraction = None
        self._rope = {}  # (T, device) -> RoPE's cos and sin
        self.tie_weights()

    # under autocast, the residual stream in bf16
    residual_in_compute_dtype = True

    def rope_cache(self, seq_len, device):
        """rope_angles for this length and device, made once outside
        inference mode (a training step may save them)."""
        key = (seq_len, str(device))
        if key not in self._rope:
            head_dim = self.config.n_embd // self.config.n_head
            theta = self.config.rope_theta
            with torch.inference_mode(False):
                self._rope[key] = rope_angles(seq_len, head_dim, theta, device)
        return self._rope[key]

    def tie_weights(self):
        # Weight tying (Press & Wolf 2017): each row gets the three
        # gradients Stop Jostling separates
        if self.config.tie_weights:
            self.lm_head.weight = self.wte.weight

    def initializers(self):
        """(name, fill) for every parameter, in the order the init
        draws them; fill(t) writes the initial value into a tensor of
        the parameter's shape: N(0, 0.02) matrices (LLaMA: init_std),
        GPT-2's residual projections over sqrt(2 n_layer)."""
        def normal(std):
            return lambda t: nn.init.normal_(t, 0.0, std)

        std = self.config.init_std if self.config.arch == "llama" else 0.02
        projection = std / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                yield name, normal(projection)
            elif p.dim() >= 2:
                yield name, normal(std)
            elif name.endswith("bias"):
                yield name, nn.init.zeros_
            else:
                yield name, nn.init.ones_

    @torch.no_grad()
    def init_weights(self):
        self.tie_weights()  # to_empty() may have un-shared the tie
        fill_parameters(self, self.initializers())

    def embeddings(self):
        """The (V, C) weights a loss may need, by name: 'input', the rows
        looked up for input tokens; 'output', the rows the final state is
        scored against. Tied: one matrix."""
        return {"input": self.wte.weight, "output": self.lm_head.weight}

    def num_params(self, non_embedding=False, active=False):
        """Parameter count; non_embedding: without wpe; active: only
        the top_k experts a token uses (Mixtral-8x7B: 47B, 13B)."""
        cfg = self.config
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n -= self.wpe.weight.numel()
        if active and cfg.n_expert > 1:
            expert = 3 * cfg.n_embd * cfg.ffn_width  # gate, up, down
            n -= cfg.n_layer * (cfg.n_expert - cfg.top_k) * expert
        return n

    def flops_per_token(self, with_head=True, backward=True):
        """Training FLOPs per token (PaLM, appendix B): 6 per matmul
        parameter + 12 * n_layer * n_embd * T for attention scores;
        backward=False: the forward alone, a third of that;
        with_head=False: no LM head. Experts: experts_computed."""
        cfg = self.config
        T = cfg.block_size
        # the matmuls' weights; lookups (wpe, an untied wte) are free
        n = self.num_params(non_embedding=True, active=True)
        if cfg.n_expert > 1:
            expert = 3 * cfg.n_embd * cfg.ffn_width
            padded = cfg.experts_computed - cfg.top_k
            n += round(cfg.n_layer * padded * expert)
        if not cfg.tie_weights:
            n -= self.wte.weight.numel()
        if not with_head:
            n -= self.lm_head.weight.numel()
        training = 6 * n + 12 * cfg.n_layer * cfg.n_embd * T
        return training if backward else training // 3

    def forward(self, idx, return_hidden_states=False, compute_logits=True):
        """idx (B, T) -> logits (B, T, V) (None if not compute_logits),
        and the hidden states if asked."""
        B, T = idx.shape
        block_size = self.config.block_size
        assert T <= block_size, f"sequence length {T} > block_size {block_size}"
        x = self.wte(idx)
        rope = ()
        if self.wpe is None:  # llama: q and k rotate in every block
            rope = self.rope_cache(T, idx.device)
        else:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        device_type = idx.device.type
        autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
        if self.residual_in_compute_dtype and autocast:
            x = x.to(torch.get_autocast_dtype(device_type))
        hidden_states = [x]
        for block in self.h:
            x = block(x, *rope)
            hidden_states.append(x)
        if self.config.n_expert > 1:
            mlps = [block.mlp for block in self.h]
            self.aux_loss = torch.stack([m.aux_loss for m in mlps]).mean()
            dropped = [m.dropped_fraction for m in mlps]
            self.dropped_fraction = torch.stack(dropped).mean()
        x = self.ln_f(x)
        hidden_states.append(x)
        logits = self.lm_head(x) if compute_logits else None
        return (logits, hidden_states) if return_hidden_states else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None,
                 generator=None):
        """Sample max_new_tokens tokens after idx (B, T)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :]
            # max at 0 first: a temperature near 0 is greedy
            largest = logits.max(dim=-1, keepdim=True).values
            logits = (logits - largest) / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def fill_parameters(module, initializers):
    parameters = dict(module.named_parameters())
    for name, fill in initializers:
        fill(parameters[name])


def initial_weights(config, seed, embeddings_seed=None):
    """{name: tensor} a run seeded `seed` starts from, drawn on the
    CPU without touching the global random state; embeddings_seed:
    wte, wpe (and a tied head) as that seed's run draws them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        weights = build_model(config).state_dict()
    if embeddings_seed is not None:
        names = ["wte.weight", "wpe.weight"]
        if config.tie_weights:
            names.append("lm_head.weight")
        other = initial_weights(config, embeddings_seed)
        weights.update((k, v) for k, v in other.items() if k in names)
    return weights


def build_model(config, device="cpu"):
    """The model, initialised once on `device`."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    return model
