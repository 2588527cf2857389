"""
AdamW (decay on 2-D tensors only), the row-wise AdamW of Stop Jostling's
separated embeddings (SE), AdaGC's clipping and the learning rate
schedule. Design notes: docs/parallelism.md.
"""

import math

import torch

import parallelism
from utils import widest_float


class SeparatedRowsAdamW(torch.optim.Optimizer):
    """AdamW for 2-D parameters whose rows are independent parameters.

    Per row r with gradient g_r != 0 this step (k_r = number of steps in
    which row r had one):
        w_r <- w_r (1 - lr wd)
        m_r <- b1 m_r + (1 - b1) g_r ;  v_r <- b2 v_r + (1 - b2) g_r^2
        w_r <- w_r - lr / (1 - b1^k_r) * m_r / (sqrt(v_r / (1 - b2^k_r)) + eps)
    Rows with an all-zero gradient keep w_r, m_r, v_r and k_r bitwise
    unchanged. When every row has a gradient this is torch.optim.AdamW.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        shapes = [tuple(p.shape) for group in self.param_groups
                  for p in group["params"] if p.dim() != 2]
        if shapes:
            raise ValueError(f"SeparatedRowsAdamW takes 2-D parameters "
                             f"(rows), got shape {shapes[0]}")

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)

    def _update(self, p, group):
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        grad = p.grad
        state = self.state[p]
        if not state:
            state["step"] = p.new_zeros(p.size(0), 1, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        active = grad.ne(0).any(dim=1, keepdim=True)  # (rows, 1)
        step = state["step"] + active
        # any k for a row never stepped: its update is discarded
        k = step.clamp(min=1).to(widest_float(p.device))
        exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
        # 1 - beta^k as -expm1(k log beta), free of cancellation;
        # log 0 = -inf gives 1, as 1 - 0^k does
        log1, log2 = (math.log(beta) if beta > 0 else -math.inf
                      for beta in (beta1, beta2))
        correction1 = (-torch.expm1(k * log1)).to(p.dtype)
        correction2_sqrt = (-torch.expm1(k * log2)).sqrt().to(p.dtype)
        denom = exp_avg_sq.sqrt() / correction2_sqrt + group["eps"]
        decayed = p * (1 - lr * group["weight_decay"])
        new_p = decayed - (lr / correction1) * exp_avg / denom
        # torch.where keeps the old bits of inactive rows
        p.copy_(torch.where(active, new_p, p))
        state["exp_avg"] = torch.where(active, exp_avg, state["exp_avg"])
        state["exp_avg_sq"] = torch.where(active, exp_avg_sq,
                                          state["exp_avg_sq"])
        state["step"] = step


def apply_gradients(optimizers, scaler, clip=None):
    """After the step's last backward: clip (a callable, or None), step
    every optimizer, clear the gradients; returns whether it stepped.
    float16 (a GradScaler enabled; Micikevicius et al. 2018, Sec. 3.2):
    the gradients are unscaled first, and an inf or NaN one skips the
    update on every optimizer, on every rank."""
    stepped = True
    if scaler.is_enabled():
        for opt in optimizers:
            scaler.unscale_(opt)
        grads = [p.grad for opt in optimizers
                 for group in opt.param_groups for p in group["params"]
                 if p.grad is not None]
        stepped = bool(torch.isfinite(tensor_norms(grads).sum()))
        scaler.update()  # the next step's scale
    if stepped:
        if clip is not None:
            clip()
        for opt in optimizers:
            opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return stepped


def gradient_clipping(model, max_norm, clipper=None):
    """apply_gradients' clip: AdaGC's (clipper), else the global
    norm's at max_norm; None when max_norm <= 0."""
    if clipper is not None:
        return clipper.clip_
    if max_norm <= 0:
        return None
    clip = torch.nn.utils.clip_grad_norm_
    return lambda: clip(model.parameters(), max_norm)


def learning_rate_at(step, learning_rate, warmup_iters, schedule,
                     decay_iters, min_lr):
    """Linear warm-up to learning_rate over warmup_iters steps, then
    cosine decay to min_lr at decay_iters and min_lr after (schedule
    'cosine'), or learning_rate from then on ('constant')."""
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if schedule == "constant":
        return learning_rate
    if step > decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / (decay_iters - warmup_iters)
    cosine = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + cosine * (learning_rate - min_lr)


def configure_optimizers(model, learning_rate, weight_decay, betas,
                         separate_embeddings=False, extra_modules=(),
                         embedding_weight_decay=None):
    """A list of optimizers: AdamW, decay on every 2-D tensor and none
    on gains and biases (nanoGPT's rule), over the model and
    extra_modules (NITP's head). separate_embeddings: the token
    embedding gets a SeparatedRowsAdamW; embedding_weight_decay, if
    given, is its decay (docs/fidelity.md)."""
    params = {id(p): p for m in (model, *extra_modules)
              for p in m.parameters() if p.requires_grad}  # tied: once
    embedding = model.wte.weight
    decay = (weight_decay if embedding_weight_decay is None
             else embedding_weight_decay)
    # the token embedding apart: in its own optimizer or its own group
    apart = separate_embeddings or decay != weight_decay
    rest = [p for p in params.values() if not (apart and p is embedding)]
    groups = [{"params": [p for p in rest if p.dim() >= 2],
               "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() < 2],
               "weight_decay": 0.0}]
    if apart and not separate_embeddings:
        groups.append({"params": [embedding], "weight_decay": decay})
    # fused: one kernel per step, not a pass per operation
    optimizers = [torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                                    fused=True)]
    if separate_embeddings:
        optimizers.append(SeparatedRowsAdamW(
            [embedding], lr=learning_rate, betas=betas, weight_decay=decay))
    return optimizers


class AdaGC:
    """Adaptive per-tensor gradient clipping (Wang et al. 2025, "AdaGC",
    as in the SimReg paper, App. A.1). With g_i the gradient of tensor i
    at step t and gamma_i an EMA of its clipped norms:
        warm-up (t < warmup):
            g <- g * min(1, max_norm / ||g||)   (||g|| over all tensors)
            gamma_i <- min(gamma_i, ||g_i||)    (clipped; from +inf)
        after:
            g_i <- g_i * min(1, rel * gamma_i / ||g_i||)
            gamma_i <- beta * gamma_i + (1 - beta) * ||g_i||  (clipped)
    Defaults beta 0.99, rel 1.04 (the SimReg paper), warm-up 100 steps
    at max_norm 1.0. A tensor without a gradient keeps its gamma.
    Call clip_() after backward, before optimizer.step().
    """

    def __init__(self, params, max_norm=1.0, beta=0.99, rel=1.04,
                 warmup=100):
        self.params = [p for p in params if p.requires_grad]
        self.max_norm = max_norm
        self.beta = beta
        self.rel = rel
        self.warmup = warmup
        self.step = 0
        self.ema = None  # per tensor, float32, +inf until seen

    @torch.no_grad()
    def clip_(self):
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not have:
            return
        grads = [self.params[i].grad for i in have]
        device = parallelism.local_part(grads[0]).device
        n = len(self.params)
        if self.ema is None:
            self.ema = torch.full((n,), float("inf"), device=device)
        present = torch.zeros(n, dtype=torch.bool, device=device)
        present[have] = True
        norms = torch.zeros(n, device=device)
        norms[have] = tensor_norms(grads)
        if self.step < self.warmup:
            total = norms.square().sum().sqrt()
            scale = total.new_ones(())
            if self.max_norm > 0:
                scale = (self.max_norm / (total + 1e-6)).clamp(max=1.0)
            scale = scale.expand_as(norms)
            clipped = norms * scale
            ema = torch.minimum(self.ema, clipped)
        else:
            bound = self.rel * self.ema
            scale = torch.where(norms > bound, bound / norms,
                                torch.ones_like(norms))
            clipped = norms * scale
            average = self.beta * self.ema + (1 - self.beta) * clipped
            # warmup=0: no history yet, the first norm starts the EMA
            ema = torch.where(self.ema.isinf(), clipped, average)
        self.ema = torch.where(present, ema, self.ema)
        for i, grad in zip(have, grads):
            parallelism.local_part(grad).mul_(scale[i].to(grad.dtype))
        self.step += 1

    def state_dict(self):
        ema = None if self.ema is None else self.ema.cpu()
        return {"step": self.step, "ema": ema}

    def load_state_dict(self, state):
        ema = state["ema"]
        if ema is not None and ema.numel() != len(self.params):
            raise ValueError(f"AdaGC state has {ema.numel()} tensors, "
                             f"this model {len(self.params)}")
        self.step = state["step"]
        if ema is not None:
            ema = ema.to(self.params[0].device)
        self.ema = ema


def tensor_norms(tensors):
    """L2 norm of each tensor, float32, (n,). DTensors sharded over one
    mesh dimension (FSDP2, HSDP): their local shards' squares summed
    over its ranks in one all-reduce."""
    from torch.distributed.tensor import DTensor
    norms = torch.stack([
        torch.linalg.vector_norm(parallelism.local_part(t),
                                 dtype=torch.float32)
        for t in tensors])
    sharded = [t for t in tensors if isinstance(t, DTensor)]
    if not sharded:
        return norms
    dims = {parallelism.sharded_mesh_dim(t) for t in sharded}
    if len(sharded) < len(tensors) or len(dims) != 1 or None in dims:
        raise ValueError("tensor_norms takes plain tensors or DTensors "
                         "sharded over one mesh dimension (FSDP2, HSDP)")
    (mesh_dim,) = dims
    squares = norms.square()
    group = sharded[0].device_mesh.get_group(mesh_dim)
    torch.distributed.all_reduce(squares, group=group)
    return squares.sqrt()
