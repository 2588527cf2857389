"""
Optimizers: AdamW with weight decay on 2-D tensors only, and the row-wise AdamW that gives
Stop Jostling's "separated embeddings" (SE) the behaviour the paper intends.

Why SE needs its own optimizer. AdamW treats the embedding matrix as one tensor: even when a
row got no gradient this step, its first moment still carries last steps' gradients, so the row
keeps moving (momentum drift), and weight decay shrinks it. The paper's SE keeps every row as its
own nn.Parameter so that AdamW skips rows without a gradient. In PyTorch that does not happen:
the rows are torch.stack-ed in forward, stack's backward gives every row a zero tensor (not
None), and AdamW updates every row anyway (tests/test_optim.py shows it). SeparatedRowsAdamW does
what the paper meant: a row whose gradient is all zeros is left bitwise untouched -- weights, both
moments and its own step count -- so each row behaves exactly as if it were a separate
parameter stepped only when it had a gradient.
"""

import math

import torch

from utils import widest_float


class SeparatedRowsAdamW(torch.optim.Optimizer):
    """AdamW for 2-D parameters whose rows are treated as independent parameters.

    Per row r with gradient g_r != 0 this step (k_r = number of steps in which row r had one):
        w_r <- w_r (1 - lr wd)
        m_r <- b1 m_r + (1 - b1) g_r ;  v_r <- b2 v_r + (1 - b2) g_r^2
        w_r <- w_r - lr / (1 - b1^k_r) * m_r / (sqrt(v_r / (1 - b2^k_r)) + eps)
    Rows with an all-zero gradient keep w_r, m_r, v_r and k_r unchanged. When every row has a
    gradient this is exactly torch.optim.AdamW (tests/test_optim.py checks it).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"SeparatedRowsAdamW takes 2-D parameters (rows), "
                                     f"got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(p.size(0), 1, device=p.device, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                active = grad.ne(0).any(dim=1, keepdim=True)  # (rows, 1): rows that got a gradient
                step = state["step"] + active
                # rows never stepped: any k works, their update is discarded. float32 counts are exact
                # up to 2^24 steps, so k loses nothing where the device has no float64 (MPS)
                k = step.clamp(min=1).to(widest_float(p.device))
                exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
                # 1 - beta^k as -expm1(k log beta): in float32 it is within 2e-7 of the exact value,
                # where 1 - beta2^k loses up to 2e-5 to cancellation; in float64 both round to the
                # same float32 (tests/test_float32_stats.py). log 0 = -inf gives 1, as 1 - 0^k does
                log1, log2 = (math.log(beta) if beta > 0 else -math.inf for beta in (beta1, beta2))
                bias_correction1 = (-torch.expm1(k * log1)).to(p.dtype)
                bias_correction2_sqrt = (-torch.expm1(k * log2)).sqrt().to(p.dtype)
                denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
                new_p = p * (1 - lr * wd) - (lr / bias_correction1) * exp_avg / denom
                # torch.where copies the old bits for inactive rows: bitwise unchanged, not "close"
                p.copy_(torch.where(active, new_p, p))
                state["exp_avg"] = torch.where(active, exp_avg, state["exp_avg"])
                state["exp_avg_sq"] = torch.where(active, exp_avg_sq, state["exp_avg_sq"])
                state["step"] = step


def apply_gradients(optimizers, scaler, clip=None):
    """The update at the end of a step, once every micro-step's backward has run: clip (a
    callable, or None), step every optimizer, clear the gradients. Returns whether it stepped.

    float16 (scaler enabled, a torch.amp.GradScaler): fp16 stops at 65504 and flushes gradients
    below ~6e-8 to zero, so train.py multiplied the loss by a large power of two before backward
    (Micikevicius et al. 2018, "Mixed precision training", Sec. 3.2). Here the gradients are divided
    back first, so clipping thresholds and the optimizers see true gradients. If any gradient is
    inf or NaN the scale was too large: the whole update is skipped on every optimizer at once
    (SE's embedding rows must not move without the rest of the model), the scale halves, and
    it doubles again after 2,000 clean steps (scaler.update()). The check costs one pass over the
    gradients and one host sync, float16 only; under FSDP the shards' norms are all-reduced, so
    every rank takes the same decision."""
    stepped = True
    if scaler.is_enabled():
        for opt in optimizers:
            scaler.unscale_(opt)
        grads = [p.grad for opt in optimizers for group in opt.param_groups for p in group["params"]
                 if p.grad is not None]
        stepped = bool(torch.isfinite(tensor_norms(grads).sum()))
        scaler.update()  # reads the inf checks unscale_ recorded; the next step gets the new scale
    if stepped:
        if clip is not None:
            clip()
        for opt in optimizers:
            opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return stepped


def gradient_clipping(model, max_norm, clipper=None):
    """The step's clipping for apply_gradients: AdaGC's (clipper) or the global norm of the model's
    gradients clipped at max_norm (DTensors under FSDP: one all-reduce); None when max_norm <= 0."""
    if clipper is not None:
        return clipper.clip_
    return None if max_norm <= 0 else lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def learning_rate_at(step, learning_rate, warmup_iters, schedule, decay_iters, min_lr):
    """Linear warm-up to learning_rate over warmup_iters steps, then cosine decay to min_lr at
    decay_iters and min_lr after (schedule 'cosine'), or learning_rate from then on ('constant')."""
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if schedule == "constant":
        return learning_rate
    if step > decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def configure_optimizers(model, learning_rate, weight_decay, betas, separate_embeddings=False,
                         extra_modules=(), embedding_weight_decay=None):
    """AdamW with decay on every 2-D tensor (matmul weights, embeddings) and none on gains and
    biases (nanoGPT's rule), over the model and any extra_modules (e.g. the objective's NITP
    head). With separate_embeddings the token embedding (tied or not) moves to a
    SeparatedRowsAdamW with the same hyperparameters. embedding_weight_decay, if given, replaces
    weight_decay for the token embedding only (e.g. 0: rows not decayed; the Stop Jostling authors'
    SE model decays its 1-D rows explicitly, docs/fidelity.md). Returns a list of optimizers;
    train.py steps them all and sets each group's lr from the schedule."""
    modules = [model, *extra_modules]
    params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}  # a tied matrix once
    embedding = model.input_embedding()
    embedding_decay = weight_decay if embedding_weight_decay is None else embedding_weight_decay
    rowwise = [embedding] if separate_embeddings else []
    rest = [p for p in params.values() if not any(p is q for q in rowwise)]
    own_embedding_group = not separate_embeddings and embedding_decay != weight_decay
    groups = [
        {"params": [p for p in rest if p.dim() >= 2 and not (own_embedding_group and p is embedding)],
         "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ] + ([{"params": [embedding], "weight_decay": embedding_decay}] if own_embedding_group else [])
    # fused AdamW: one kernel per step instead of a dozen elementwise passes over every tensor
    optimizers = [torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)]
    if rowwise:
        optimizers.append(SeparatedRowsAdamW(rowwise, lr=learning_rate, betas=betas,
                                             weight_decay=embedding_decay))
    return optimizers


class AdaGC:
    """Adaptive per-tensor gradient clipping (Wang et al. 2025, "AdaGC", as in the SimReg paper,
    App. A.1).

    Global norm clipping lets one tensor's gradient spike pass as long as the total stays under
    the threshold, and shrinks every tensor when one spikes. AdaGC bounds each tensor i against its
    own history instead: with g_i its gradient at step t and gamma_i an EMA of its clipped norms,
        warm-up (t < warmup):  g <- g * min(1, max_norm / ||g||)      (global, ||g|| over all tensors)
                               gamma_i <- min(gamma_i, ||g_i||)        (clipped norm; running min from +inf)
        after:                 g_i <- g_i * min(1, rel * gamma_i / ||g_i||)
                               gamma_i <- beta * gamma_i + (1 - beta) * ||g_i||   (the clipped norm)
    Defaults beta 0.99, rel 1.04 (the SimReg paper), warm-up 100 steps at max_norm 1.0.
    A tensor without a gradient this step keeps its gamma. The norms are computed on the device,
    without a host sync. Under FSDP2 the gradients are shards (DTensors): each rank squares its
    shard and one all-reduce adds the squares of every tensor at once.

    Call clip_() after backward and before optimizer.step(); state_dict() holds the step count and
    the EMAs, which checkpoints keep so that a resumed run clips exactly as an uninterrupted one.
    """

    def __init__(self, params, max_norm=1.0, beta=0.99, rel=1.04, warmup=100):
        self.params = [p for p in params if p.requires_grad]
        self.max_norm, self.beta, self.rel, self.warmup = max_norm, beta, rel, warmup
        self.step = 0
        self.ema = None  # (number of tensors,) float32 on the gradients' device; +inf until first seen

    @torch.no_grad()
    def clip_(self):
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not have:
            return
        grads = [self.params[i].grad for i in have]
        device = _local(grads[0]).device
        if self.ema is None:
            self.ema = torch.full((len(self.params),), float("inf"), device=device)
        present = torch.zeros(len(self.params), dtype=torch.bool, device=device)
        present[have] = True
        norms = torch.zeros(len(self.params), device=device)
        norms[have] = tensor_norms(grads)
        if self.step < self.warmup:
            total = norms.square().sum().sqrt()
            scale = ((self.max_norm / (total + 1e-6)).clamp(max=1.0) if self.max_norm > 0
                     else total.new_ones(()))
            scale = scale.expand_as(norms)
            clipped = norms * scale
            ema = torch.minimum(self.ema, clipped)
        else:
            bound = self.rel * self.ema
            scale = torch.where(norms > bound, bound / norms, torch.ones_like(norms))
            clipped = norms * scale
            # warmup=0: there is no history yet, the first norm starts the EMA
            ema = torch.where(self.ema.isinf(), clipped, self.beta * self.ema + (1 - self.beta) * clipped)
        self.ema = torch.where(present, ema, self.ema)
        for i, grad in zip(have, grads):
            _local(grad).mul_(scale[i].to(grad.dtype))
        self.step += 1

    def state_dict(self):
        return {"step": self.step, "ema": None if self.ema is None else self.ema.cpu()}

    def load_state_dict(self, state):
        ema = state["ema"]
        if ema is not None and ema.numel() != len(self.params):
            raise ValueError(f"AdaGC state has {ema.numel()} tensors, this model {len(self.params)}")
        self.step = state["step"]
        self.ema = None if ema is None else ema.to(self.params[0].device)


def _local(tensor):
    """The part of a tensor this process holds: an FSDP2 DTensor's shard, else the tensor."""
    from torch.distributed.tensor import DTensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_norms(tensors):
    """L2 norm of each tensor, float32, (n,). DTensors sharded over ranks (FSDP2, or hybrid sharding's
    2-D mesh, replicated across groups): the squares of the local shards are summed over the ranks of
    the sharded mesh dimension in one all-reduce."""
    from torch.distributed.tensor import DTensor
    sharded = [t for t in tensors if isinstance(t, DTensor)]
    if not sharded:
        return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors])
    shard_dims = {tuple(i for i, p in enumerate(t.placements) if not p.is_replicate()) for t in sharded}
    if len(sharded) != len(tensors) or len(shard_dims) != 1 or len(next(iter(shard_dims))) != 1 \
            or any(not t.placements[next(iter(shard_dims))[0]].is_shard() for t in sharded):
        raise ValueError("tensor_norms takes plain tensors or DTensors sharded over one mesh dimension "
                         "(FSDP2, HSDP)")
    (mesh_dim,) = next(iter(shard_dims))
    squares = torch.stack([torch.linalg.vector_norm(t.to_local(), dtype=torch.float32)
                           for t in sharded]).square()
    torch.distributed.all_reduce(squares, group=sharded[0].device_mesh.get_group(mesh_dim))
    return squares.sqrt()
