"""
A GPT-2 style language model, small enough to read in one sitting.

The model knows nothing about losses. Its forward pass returns the logits and, when asked, the
hidden states that representation-level losses work on:

    hidden_states[0]      embedding output (token + position), the input of block 1
    hidden_states[l]      residual stream after block l, l = 1..n_layer
    hidden_states[-1]     the final state after ln_f, the one that feeds the LM head

train.py turns these into weighted losses (see losses.py). Parallelism, optimizers and the
Stop Jostling "separated embeddings" (an optimizer-side property, see optim.py) live outside.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


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
    embedding_init_std: float = 0.02  # std of the token embedding rows at init (Stop Jostling's SE rows: 1.0)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's own cannot drop only the bias)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
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
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
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


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        # Weight tying (Press & Wolf 2017): one matrix is both the input embedding and the output
        # layer, so every row is trained by its use as input, as target and as non-target -- the
        # three gradient sources Stop Jostling separates.
        if self.config.tie_weights:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self):
        """nanoGPT/GPT-2 init: N(0, 0.02) everywhere, residual projections scaled by
        1/sqrt(2 n_layer) so the residual stream's variance does not grow with depth.
        Separate from __init__ so a model built on the meta device can be materialised
        cheaply with to_empty() and then initialised once."""
        self.tie_weights()  # to_empty() may have un-shared the tied tensor
        std = 0.02
        for name, p in self.named_parameters():
            if name == "wte.weight":
                nn.init.normal_(p, mean=0.0, std=self.config.embedding_init_std)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weights
                nn.init.ones_(p)

    def input_embedding(self):
        """(V, C) rows looked up for input tokens."""
        return self.wte.weight

    def output_embedding(self):
        """(V, C) rows the final state is scored against (= input_embedding() when tied)."""
        return self.lm_head.weight

    def num_params(self, non_embedding=False):
        n = sum(p.numel() for p in self.parameters())  # parameters() counts a tied matrix once
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len=None, with_head=True):
        """Training FLOPs per token (forward + backward), PaLM appendix B style:
        6 per parameter for the matmuls plus 12 * n_layer * n_embd * T for attention scores.
        with_head=False: a headless run that never computes the LM head."""
        T = seq_len or self.config.block_size
        # matmul weights: the blocks and the LM head. Lookups (wpe, and wte when untied) are free.
        n = self.num_params(non_embedding=True)
        if not self.config.tie_weights:
            n -= self.wte.weight.numel()
        if not with_head:
            n -= self.lm_head.weight.numel()
        return 6 * n + 12 * self.config.n_layer * self.config.n_embd * T

    def forward(self, idx, return_hidden_states=False, compute_logits=True):
        """idx (B, T) token ids -> logits (B, T, V), and the list of hidden states if asked.
        compute_logits=False skips the LM head (headless training, e.g. CWT): logits is None."""
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        hidden_states = [x]
        for block in self.h:
            x = block(x)
            hidden_states.append(x)
        x = self.ln_f(x)
        hidden_states.append(x)
        logits = self.lm_head(x) if compute_logits else None
        return (logits, hidden_states) if return_hidden_states else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample max_new_tokens tokens after idx (B, T); the context is cropped to block_size."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits = self(context)[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def build_model(config, device="cpu"):
    """Build on the meta device (no memory, no init work), materialise on `device`, init once.
    At 7B scale this avoids initialising every weight twice on the CPU."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    return model
