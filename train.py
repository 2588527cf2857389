"""
Train a GPT on a prepared dataset, nanoGPT style:

    python train.py config/lowres_baseline.py
    python train.py config/lowres_margin_0.6_se.py --seed=2 --out_dir=out/se_s2

Defaults below are the Stop Jostling low-resource experiment (SPEC.md section 1): a 0.8M-parameter
character GPT on tiny Shakespeare where each training window is, with probability
low_resource_prob, rewritten into a second "low-resource" language (every id shifted by the
char vocabulary size). The run writes to out_dir:
    log.jsonl      one JSON object per logged step and per evaluation
    ckpt.pt/.json  the latest state (resume from it with --init_from=resume)
    best.pt/.json  the weights with the best validation loss (what the final metrics evaluate)
    metrics.json   metrics of best.pt (evaluate.py), and marginalization.json if asked
"""

import json
import math
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import evaluate
import metrics
from configurator import parse_config_or_exit
from losses import Objective
from model import GPT, GPTConfig, build_model
from optim import configure_optimizers
from utils import autocast_context, choose_device, choose_dtype, peak_flops, save_json, save_text, save_torch

# -----------------------------------------------------------------------------
# default config (every key can be set in a config file or with --key=value)
# I/O
out_dir = "out/lowres_baseline"
data_dir = "data/shakespeare_char"   # holds train.bin, val.bin, meta.json (prepare_shakespeare.py)
init_from = "scratch"                # 'scratch', 'resume' (out_dir/ckpt.pt), or a checkpoint path to start from
head_from_embedding = False          # with a checkpoint path: the (untied) LM head starts as a copy of wte
eval_interval = 250
eval_iters = 20                      # validation batches per evaluation
log_interval = 10
final_eval = True                    # evaluate best.pt at the end and write metrics.json
seed = 1337
# data
batch_size = 12
block_size = 64
gradient_accumulation_steps = 1      # micro-steps per optimizer step (derived when global_batch_size > 0)
global_batch_size = 0                # sequences per optimizer step over all processes; 0 = batch_size x accumulation
low_resource = True                  # add the simulated low-resource language (SPEC section 1)
low_resource_prob = 0.02             # probability that a training window is in that language
# model
vocab_size = 0                       # 0 = the dataset's (meta.json); more pads the table (GPT-2 BPE: 50304)
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
tie_weights = True
embedding_init_std = 0.02            # token embedding init std; the authors' SE rows start at 1.0 (torch.randn)
arch = "gpt2"                        # gpt2 | llama (RMSNorm, RoPE, SwiGLU; SPEC section 6)
ffn_hidden = 0                       # llama: SwiGLU width; 0 = 8/3 n_embd rounded up to a multiple of 256
n_expert = 1                         # llama: > 1 = Mixtral mixture of experts
top_k = 2                            # experts per token
moe_aux_weight = 0.02                # weight of the router's load-balancing loss (Mixtral-8x7B's 0.02)
rope_theta = 10000.0
init_std = 0.01                      # llama: std of every weight matrix
# loss: a weighted sum of the terms of losses.py, each *_weight = 0 switches it off (losses.Objective)
ce_weight = 1.0                      # next-token cross-entropy; 0 with cwt_weight > 0 = headless
margin = None                        # logit thresholding margin of the CE term (Stop Jostling); None = off
simreg_weight = 0.0                  # SimReg (SPEC 2); the paper's rule: 10 * sqrt(n_embd / 1024)
simreg_tau = 0.01
simreg_chunk_size = 0                # 0 = whole sequences
simreg_layer = -1                    # -1 = the final normed state; l = output of block l (0 = embedding)
dispersion_weight = 0.0              # dispersion loss (SPEC 3); the paper's 0.1
dispersion_tau = 1.0
dispersion_variant = "angular"       # angular | decorrelation | l2_repel | orthogonalization
dispersion_layers = "all"            # all | last
dispersion_positions = 0             # P > 0: P random positions per layer (an estimate); 0 = all
nitp_weight = 0.0                    # NITP (SPEC 4); the paper's 1.0
nitp_layer = 0                       # target block; 0 = max(1, round(0.2 * n_layer))
nitp_prenorm = False                 # predict from the last block's output instead of the normed state
nitp_hidden = 0                      # SwiGLU head width; 0 = 4 * n_embd
cwt_weight = 0.0                     # contrastive weight tying (SPEC 5)
separate_embeddings = False          # Stop Jostling SE: rows without gradient are not stepped
# AdamW and schedule
learning_rate = 1e-3
max_iters = 8000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0                      # clip the global gradient norm; 0 = off
warmup_iters = 100
lr_schedule = "cosine"               # cosine: decay to min_lr at lr_decay_iters; constant: stay at learning_rate
lr_decay_iters = 8000
min_lr = 1e-4
# analysis
log_marginalization = False          # record Stop Jostling's per-row gradient parts every step
# system
dry_run = False                      # build the model on the meta device, print its parameter count, exit
device = "auto"                      # auto = cuda > mps > cpu
dtype = "auto"                       # auto = bfloat16 autocast on GPU, float32 on CPU
num_threads = 0                      # CPU threads for torch; 0 = torch's default
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))]
config = parse_config_or_exit(sys.argv[1:], {k: globals()[k] for k in config_keys})
globals().update(config)
# -----------------------------------------------------------------------------

if log_marginalization and (dropout > 0 or not tie_weights or ce_weight == 0 or cwt_weight > 0):
    sys.exit("error: log_marginalization needs dropout=0, tie_weights=True, ce_weight > 0 and cwt_weight=0 "
             "(it splits the tied embedding's cross-entropy gradient)")
if init_from not in ("scratch", "resume") and not os.path.isfile(init_from):
    sys.exit(f"error: key 'init_from' must be 'scratch', 'resume' or an existing checkpoint file, got {init_from!r}")
if lr_schedule not in ("cosine", "constant"):
    sys.exit(f"error: key 'lr_schedule' must be 'cosine' or 'constant', got {lr_schedule!r}")

world_size = 1
if global_batch_size:  # the config names the batch the recipe needs; micro-steps follow from the hardware
    if global_batch_size % (batch_size * world_size):
        sys.exit(f"error: key 'global_batch_size' ({global_batch_size}) must be a multiple of batch_size "
                 f"({batch_size}) x processes ({world_size})")
    gradient_accumulation_steps = global_batch_size // (batch_size * world_size)

def make_model_config(vocab):
    try:
        return GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                         dropout=dropout, bias=bias, tie_weights=tie_weights, embedding_init_std=embedding_init_std,
                         arch=arch, ffn_hidden=ffn_hidden, n_expert=n_expert, top_k=top_k, rope_theta=rope_theta,
                         init_std=init_std)
    except ValueError as e:
        sys.exit(f"error: {e}")


meta_path = os.path.join(data_dir, "meta.json")
if dry_run:  # the model's size without data, weights or memory: every tensor lives on the meta device
    if not vocab_size and not os.path.exists(meta_path):
        sys.exit(f"error: dry_run needs key 'vocab_size' or a dataset in data_dir '{data_dir}'")
    with torch.device("meta"):
        dry_model = GPT(make_model_config(vocab_size or json.load(open(meta_path))["vocab_size"]))
    print(f"params: {dry_model.num_params()}")
    if n_expert > 1:
        print(f"active_params: {dry_model.num_params(active=True)}")
    sys.exit(0)
if num_threads > 0:
    torch.set_num_threads(num_threads)
device = choose_device(device)
dtype = choose_dtype(dtype, device)
autocast = autocast_context(device, dtype)
torch.manual_seed(seed)
os.makedirs(out_dir, exist_ok=True)

# data ------------------------------------------------------------------------
if not os.path.exists(meta_path):
    sys.exit(f"error: no dataset in data_dir '{data_dir}' (missing meta.json); "
             f"run prepare_shakespeare.py --out_dir {data_dir} first")
with open(meta_path) as f:
    meta = json.load(f)
base_vocab = meta["vocab_size"]
dataset_vocab = 2 * base_vocab if low_resource else base_vocab
if vocab_size and vocab_size < dataset_vocab:
    sys.exit(f"error: key 'vocab_size' is {vocab_size} but the dataset in {data_dir} has {dataset_vocab} tokens")
vocab_size = vocab_size or dataset_vocab
shift = base_vocab if low_resource else 0   # id offset of the low-resource language


def load_tokens(split):
    """The split as a read-only uint16 memmap: a C4 shard is ~150M tokens, and only the sampled
    windows are ever read and widened to int64."""
    return np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")


train_data, val_data = load_tokens("train"), load_tokens("val")
data_generator = torch.Generator().manual_seed(seed)


def get_batch(data, generator, prob_low_resource):
    """B random windows of T+1 tokens -> inputs (B,T), targets (B,T). Each window independently
    becomes the low-resource language with probability prob_low_resource (the authors' code
    decides per window at batch time)."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    windows = torch.from_numpy(data[(starts.unsqueeze(1) + torch.arange(block_size + 1)).numpy()].astype(np.int64))
    is_low = torch.rand(batch_size, generator=generator) < prob_low_resource
    windows = windows + shift * is_low.unsqueeze(1)
    x, y = windows[:, :-1], windows[:, 1:]
    if device == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# model and optimizer ---------------------------------------------------------
model_config = make_model_config(vocab_size)
model = build_model(model_config, device)
try:
    objective = Objective(n_layer, n_embd, ce=ce_weight, margin=margin, simreg=simreg_weight, simreg_tau=simreg_tau,
                          simreg_chunk_size=simreg_chunk_size, simreg_layer=simreg_layer,
                          dispersion=dispersion_weight, dispersion_tau=dispersion_tau,
                          dispersion_variant=dispersion_variant, dispersion_layers=dispersion_layers,
                          dispersion_positions=dispersion_positions, nitp=nitp_weight, nitp_layer=nitp_layer,
                          nitp_prenorm=nitp_prenorm, nitp_hidden=nitp_hidden, cwt=cwt_weight).to(device)
except ValueError as e:
    sys.exit(f"error: {e}")
objective.init_weights()  # trainable parts of the losses (NITP's head), if any
optimizers = configure_optimizers(model, learning_rate, weight_decay, (beta1, beta2),
                                  separate_embeddings, device, extra_modules=[objective])
iter_num, best_val_loss = 0, float("inf")
grad_parts = []  # per step: (3, V) norms of the embedding gradient's parts (log_marginalization)

ckpt_path, best_path, log_path = (os.path.join(out_dir, n) for n in ("ckpt.pt", "best.pt", "log.jsonl"))
if init_from == "resume":
    if not os.path.exists(ckpt_path):
        sys.exit(f"error: init_from='resume' but there is no checkpoint at {ckpt_path}")
    checkpoint = torch.load(ckpt_path, map_location=device, weights_only=False)
    for key in ("arch", "n_layer", "n_head", "n_embd", "ffn_hidden", "n_expert", "block_size", "bias", "tie_weights", "low_resource",
                "separate_embeddings", "data_dir"):
        if checkpoint["config"].get(key, config[key]) != config[key]:  # keys newer than the checkpoint: default
            sys.exit(f"error: cannot resume: key '{key}' is {config[key]!r} but the checkpoint "
                     f"was trained with {checkpoint['config'][key]!r}")
    model.load_state_dict(checkpoint["model"])
    try:
        objective.load_state_dict(checkpoint.get("objective", {}))
    except RuntimeError:
        sys.exit("error: cannot resume: the checkpoint's loss parameters (NITP head) do not match "
                 "nitp_weight / nitp_hidden of this config")
    for opt, state in zip(optimizers, checkpoint["optimizers"]):
        opt.load_state_dict(state)
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    data_generator.set_state(checkpoint["data_rng"])
    torch.set_rng_state(checkpoint["torch_rng"])
    if device == "cuda" and checkpoint.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(checkpoint["cuda_rng"])
    grad_parts = checkpoint.get("grad_parts", [])
    # drop log lines from iter_num on: the loop re-runs the evaluation at iter_num (same value)
    # and the steps an interrupted run logged after its last checkpoint
    if os.path.exists(log_path):
        with open(log_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        kept = [r for r in records if r["iter"] < iter_num]
        save_text("".join(json.dumps(r) + "\n" for r in kept), log_path)
    print(f"resumed from {ckpt_path} at iter {iter_num}")
else:
    if os.path.exists(log_path):
        os.remove(log_path)  # a fresh run starts a fresh log
    if init_from != "scratch":
        # start from another run's weights (fresh optimizer, step 0), e.g. CWT's second stage:
        # a headless model gets a new untied LM head initialised as a copy of its input embedding
        source = torch.load(init_from, map_location=device, weights_only=False)
        for key, value in source["model_config"].items():
            if key not in ("tie_weights", "dropout") and getattr(model_config, key) != value:
                sys.exit(f"error: cannot start from {init_from}: model key '{key}' is "
                         f"{getattr(model_config, key)!r} here but {value!r} there")
        weights = dict(source["model"])
        if head_from_embedding:
            if tie_weights:
                sys.exit("error: head_from_embedding=True needs tie_weights=False (a tied head is the embedding)")
            weights["lm_head.weight"] = weights["wte.weight"].clone()
        model.load_state_dict(weights)
        print(f"initialised from {init_from}" + (" (LM head := copy of wte)" if head_from_embedding else ""))


def get_lr(it):
    """Linear warm-up to learning_rate, then cosine decay to min_lr at lr_decay_iters
    (or, with lr_schedule='constant', learning_rate from then on)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if lr_schedule == "constant":
        return learning_rate
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_val_loss():
    """Cross-entropy (never thresholded) on the same eval_iters validation batches every time
    (a fixed generator), in both languages. 'val' is the loss on the mixed batches, each window
    in the low-resource language with probability low_resource_prob, as in training; it is
    assembled from the per-window HR and LR losses, so it costs no extra forward pass. The other
    active loss terms are evaluated on the same mixed batches ('val_<term>'), their states
    picked per window from the HR and LR passes (windows do not attend to each other). A run
    without CE (headless) keeps the checkpoint with the best weighted sum of its terms instead.
    The RNG is forked so that evaluation never changes the training run's random stream."""
    model.eval()
    generator = torch.Generator().manual_seed(0)
    languages = (("hr", 0), ("lr", shift)) if low_resource else (("hr", 0),)
    aux = [name for name, weight in objective.weights.items() if weight and name != "ce"]
    per_window = {"hr": [], "lr": []}
    masks, term_sums = [], dict.fromkeys(aux, 0.0)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        for _ in range(eval_iters):
            x, y = get_batch(val_data, generator, prob_low_resource=0.0)
            is_low = torch.rand(batch_size, generator=generator) < low_resource_prob
            masks.append(is_low)
            passes = {}
            for lang, offset in languages:
                with autocast:
                    passes[lang] = model(x + offset, return_hidden_states=bool(aux))
                logits = passes[lang][0] if aux else passes[lang]
                nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), y + offset, reduction="none")
                per_window[lang].append(nll.mean(dim=1).cpu())
            if aux:
                logits, hidden = passes["hr"]
                if low_resource:
                    pick = is_low.to(device).view(-1, 1, 1)
                    logits = torch.where(pick, passes["lr"][0], logits)
                    hidden = [torch.where(pick, lr_h, hr_h) for lr_h, hr_h in zip(passes["lr"][1], hidden)]
                with autocast:
                    _, terms = objective(logits, hidden, y + shift * is_low.to(device).unsqueeze(1), model.input_embedding())
                for name in aux:
                    term_sums[name] += terms[name].item() / eval_iters
    model.train()
    hr = torch.cat(per_window["hr"])
    out = {"val_hr": hr.mean().item()}
    if low_resource:
        lr_ = torch.cat(per_window["lr"])
        out["val_lr"] = lr_.mean().item()
        out["val"] = torch.where(torch.cat(masks), lr_, hr).mean().item()
    else:
        out["val"] = out["val_hr"]
    out.update({f"val_{name}": value for name, value in term_sums.items()})
    if not objective.needs_logits:
        out["val_ce"] = out["val"]
        out["val"] = sum(objective.weights[name] * value for name, value in term_sums.items())
    return out


def save_checkpoint(path, full):
    """Atomic torch.save plus a readable JSON beside it (config, step, losses)."""
    state = {"model": model.state_dict(), "objective": objective.state_dict(), "model_config": model_config.__dict__, "config": config,
             "iter_num": iter_num, "best_val_loss": best_val_loss, "meta": meta}
    if full:  # everything needed to continue exactly where we stopped
        state.update(optimizers=[opt.state_dict() for opt in optimizers], data_rng=data_generator.get_state(),
                     torch_rng=torch.get_rng_state(), grad_parts=grad_parts,
                     cuda_rng=torch.cuda.get_rng_state() if device == "cuda" else None)
    save_torch(state, path)
    save_json({"config": config, "model_config": model_config.__dict__, "iter_num": iter_num,
               "best_val_loss": best_val_loss, "last_eval": last_eval}, path[:-3] + ".json")


def log(record):
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")


# training loop ---------------------------------------------------------------
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
flops_per_iter = model.flops_per_token(with_head=objective.needs_logits) * tokens_per_iter  # model only, not the losses
peak = peak_flops(device, dtype)
print(f"params: {model.num_params():,} | device {device} {dtype} | {tokens_per_iter} tokens/iter | "
      f"{flops_per_iter / 1e9:.2f} GFLOP/iter | peak {peak / 1e9:.0f} GFLOP/s")

last_eval = None
bar = tqdm(total=max_iters, initial=iter_num, desc=os.path.basename(out_dir.rstrip("/")), dynamic_ncols=True)
t_window, window_iters = time.perf_counter(), 0
while True:
    lr = get_lr(iter_num)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        last_eval = estimate_val_loss()
        log({"iter": iter_num, **last_eval})
        bar.set_postfix(val=f"{last_eval['val']:.4f}")
        if last_eval["val"] < best_val_loss:
            best_val_loss = last_eval["val"]
            save_checkpoint(best_path, full=False)
        save_checkpoint(ckpt_path, full=True)
        t_window, window_iters = time.perf_counter(), 0  # keep evaluation out of the speed figures
    if iter_num >= max_iters:
        break

    step_parts = 0
    for micro_step in range(gradient_accumulation_steps):
        x, y = get_batch(train_data, data_generator, low_resource_prob)
        with autocast:
            logits, hidden_states = model(x, return_hidden_states=True, compute_logits=objective.needs_logits)
            loss, terms = objective(logits, hidden_states, y, model.input_embedding())
            if n_expert > 1:  # Mixtral: keep the router from sending every token to the same experts
                terms["moe_aux"] = model.aux_loss
                loss = loss + moe_aux_weight * model.aux_loss
        loss = loss / gradient_accumulation_steps
        if log_marginalization:
            logits.retain_grad()
            hidden_states[0].retain_grad()
        loss.backward()
        if log_marginalization:
            # raw gradient (before clipping) of each embedding row, split into input / target /
            # non-target parts; summed over micro-steps before taking norms
            step_parts = step_parts + torch.stack(metrics.embedding_gradient_part_vectors(
                x.reshape(-1), y.reshape(-1), hidden_states[-1].detach().reshape(-1, n_embd).float(),
                logits.grad.reshape(-1, vocab_size).float(),
                hidden_states[0].grad.reshape(-1, n_embd).float(), vocab_size))
    if log_marginalization:
        grad_parts.append(step_parts.norm(dim=-1).cpu())
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    iter_num += 1
    window_iters += 1
    bar.update(1)

    if iter_num % log_interval == 0:
        loss_value = loss.item() * gradient_accumulation_steps  # .item() syncs: only when logging
        dt = (time.perf_counter() - t_window) / window_iters
        record = {"iter": iter_num - 1, "loss": loss_value, **{k: v.item() for k, v in terms.items()},
                  "lr": lr, "ms_per_iter": 1000 * dt,
                  "tokens_per_s": tokens_per_iter / dt, "mfu": flops_per_iter / dt / peak}
        log(record)
        bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{record['mfu']:.2f}")
        t_window, window_iters = time.perf_counter(), 0
bar.close()

if log_marginalization and grad_parts:
    parts = torch.stack(grad_parts)  # (steps, 3, V)
    ratios = evaluate.marginalization_report(parts, torch.from_numpy(train_data.astype(np.int64)), shift, meta["itos"])
    save_json(ratios, os.path.join(out_dir, "marginalization.json"))

if final_eval:
    metrics = evaluate.evaluate_checkpoint(best_path, device=device)
    save_json(metrics, os.path.join(out_dir, "metrics.json"))
    print(evaluate.format_metrics(metrics))
