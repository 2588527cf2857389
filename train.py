"""
Train a GPT on a prepared dataset, nanoGPT style:

    python train.py config/lowres_baseline.py
    python train.py config/lowres_margin_0.6_se.py --seed=2 --out_dir=out/se_s2
    torchrun --nproc_per_node=8 train.py config/baseline_1b3.py     # data parallel (parallelism.py)

Defaults below are the Stop Jostling low-resource experiment (Sec. 4.1, Table 4): a 0.8M-parameter
character GPT on tiny Shakespeare where each training window is, with probability
low_resource_prob, rewritten into a second "low-resource" language (every id shifted by the
char vocabulary size). The run writes log.jsonl, ckpt.pt (resume with --init_from=resume),
best.pt and metrics.json to out_dir (every file and failure case: docs/runs.md; checkpoint.py
writes and reads them); under torchrun only rank 0 writes, and with parallel='fsdp' the latest
state is sharded (ckpt_dcp/). Ctrl-C, `kill`, a closed terminal or a scheduler's SIGUSR1 finishes
the step, saves ckpt.pt and prints the command that resumes; a non-finite loss stops the run before
anything is saved.
"""


import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import evaluate
import metrics
import parallelism
import memory
import plan
import prepare_shakespeare
import run
import tracking
from configurator import ConfigError, check_train_config, parse_config, train_rules
from data import EpochWindows, load_tokens, read_meta, read_windows, sample_windows
from errors import end_on_user_error
from model import GPT, GPTConfig, initial_weights
from objective import Objective, ObjectiveConfig, objective_step
from optim import AdaGC, apply_gradients, configure_optimizers, gradient_clipping, learning_rate_at
from utils import (StopRequest, autocast_context, choose_device, choose_dtype, keep_freed_memory, launched,
                   peak_flops, save_json)


# -----------------------------------------------------------------------------
# default config (every key can be set in a config file or with --key=value)
# I/O
out_dir = "out/lowres_baseline"
data_dir = "data/shakespeare_char"   # holds train.bin, val.bin, meta.json (prepare_shakespeare.py)
data_source = ""                     # tiny Shakespeare's data_dir still empty: prepare it from this URL/file
init_from = "scratch"                # 'scratch', 'resume' (out_dir/ckpt.pt), 'auto' (resume if out_dir holds
                                     # a checkpoint, else scratch: a requeued job's one command), or a
                                     # checkpoint's path
overwrite = False                    # a fresh run may replace a run already in out_dir (else it refuses)
resume_changes = ""                  # keys a resume may change, e.g. "learning_rate,margin" (recorded in
                                     # log.jsonl and the checkpoint); any other is refused (docs/runs.md)
head_from_embedding = False          # with a checkpoint path: the (untied) LM head starts as a copy of wte
eval_interval = 250
checkpoint_interval = 0              # also write ckpt.pt every this many steps; 0 = at evaluations only
eval_iters = 20                      # validation batches per evaluation
log_interval = 10
final_eval = True                    # evaluate best.pt at the end and write metrics.json
seed = 1337                          # the initialisation's (and dropout's) random numbers
data_seed = None                     # the training data order's (windows, language draws); None = seed
init_embeddings_from_seed = None     # a fresh run's wte (and the head tied to it) and wpe drawn as seed S's
                                     # run draws them (on the CPU), every other weight its own seed's
# data
batch_size = 12                      # sequences per process and micro-step; "auto": the most that fit
block_size = 64
gradient_accumulation_steps = 1      # micro-steps per optimizer step (derived when global_batch_size > 0)
global_batch_size = 0                # sequences per optimizer step over all processes; 0: batch x micro-steps
data_order = "random"                # random: windows drawn with replacement (nanoGPT's, the toy papers');
                                     # epoch: every window once per epoch, ordered by seed (data seed, epoch)
low_resource = True                  # add the simulated low-resource language (Stop Jostling, Sec. 4.1)
low_resource_prob = 0.02             # probability that a training window is in that language
# model
vocab_size = 0                       # 0 = the dataset's (meta.json); more pads the table (GPT-2 BPE: 50304)
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
tie_weights = True
arch = "gpt2"                        # gpt2 | llama (RMSNorm, RoPE, SwiGLU; SimReg paper, App. A.1)
ffn_hidden = 0                       # llama: SwiGLU width; 0 = 8/3 n_embd rounded up to a multiple of 256
n_expert = 1                         # llama: > 1 = Mixtral mixture of experts
top_k = 2                            # experts per token
capacity_factor = 0.0                # expert slots: x tokens * top_k / n_expert; 0 = all tokens, none dropped
moe_routing = "capacity"             # capacity (static shapes) | dropless (routed FLOPs only; moe.py)
rope_theta = 10000.0
rope_layout = "half"                 # llama: RoPE pairs (i, i + d/2), LLaMA's; "interleaved" = (2i, 2i+1)
init_std = 0.01                      # llama: std of every weight matrix
# loss: a weighted sum of the terms of losses.py, each on when its <name>_weight > 0; every key,
# with its default and its rule, is declared in objective.ObjectiveConfig (e.g. --simreg_weight=1.0)
globals().update(vars(ObjectiveConfig()))
separate_embeddings = False          # Stop Jostling SE: rows without gradient are not stepped
embedding_weight_decay = -1.0        # token embedding's weight decay; < 0: weight_decay (0: rows not decayed)
# AdamW and schedule
learning_rate = 1e-3
max_iters = 8000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0                      # clip the global gradient norm at this; 0 = off (adagc: in its warm-up)
grad_clip_mode = "norm"              # norm: global norm clipping | adagc: per-tensor adaptive (SimReg paper,
                                     # App. A.1; optim.AdaGC)
adagc_beta = 0.99                    # AdaGC: EMA coefficient of each tensor's clipped gradient norm
adagc_rel = 1.04                     # AdaGC: a tensor's norm is bounded by adagc_rel x its EMA
adagc_warmup = 100                   # AdaGC: steps of global clipping at grad_clip while the EMAs start
warmup_iters = 100
lr_schedule = "cosine"               # cosine: to min_lr at lr_decay_iters; constant: stay at learning_rate
lr_decay_iters = 8000
min_lr = 1e-4
# analysis
log_marginalization = False          # record Stop Jostling's per-row gradient parts every step
# system
parallel = "none"                    # none | ddp | fsdp (FSDP2): under torchrun --nproc_per_node=N
activation_checkpointing = False     # recompute each block's activations in backward: memory for ~1/3 more
fsdp_keep_gathered = False           # fsdp: gather each block once per step, not in each micro-step (memory:
                                     # the whole model in the compute dtype; parallelism.parallelize)
fsdp_shard_size = 0                  # fsdp: 0 shards over all processes; k (a node's GPUs, 8) shards within
                                     # each group of k and replicates across groups (hybrid sharding, HSDP)
check_memory = True                  # refuse, before allocating, a run the plan says the device cannot fit
compile = "auto"                     # torch.compile each block: auto = on CUDA only (True / False to choose)
dry_run = False                      # print the run's plan (size, FLOPs, memory, data, time: plan.py), exit
device = "auto"                      # auto = cuda > mps > cpu
dtype = "auto"                       # auto: bf16 autocast (GPU with bf16) | fp16 + loss scaling (CUDA) | fp32
num_threads = 0                      # CPU threads for torch; 0 = torch's default
# tracking (optional, `pip install wandb`; docs/tracking.md)
wandb_log = False                    # also send log.jsonl's records and the config to Weights & Biases
wandb_project = "repr-losses"
wandb_run_name = ""                  # "" = out_dir
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))]
end_on_user_error()  # from here an errors.UserError, raised anywhere, ends the run: its one line and status
# every value is checked (type and range, configurator.train_rules) before anything is touched: exit 2
config = parse_config(sys.argv[1:], {k: globals()[k] for k in config_keys}, train_rules())
globals().update(config)
keep_freed_memory()  # a big vocabulary's logits would otherwise be page-faulted in anew every step
stop = StopRequest(announce=os.environ.get("RANK", "0") == "0")  # from here a stop signal ends the run, saved
# -----------------------------------------------------------------------------

world_size = launched("WORLD_SIZE", 1)  # torchrun sets it; `python train.py` is one process
if dry_run:  # this run's plan (plan.py) on these processes: nothing allocated or read, out_dir untouched
    plan.print_plan(config, world_size)
    sys.exit(0)
if problem := check_train_config(config, world_size):  # keys that must agree with each other, the model's
    raise ConfigError(problem)
if num_threads > 0:
    torch.set_num_threads(num_threads)
try:
    device = choose_device(device)
except ValueError as e:
    raise ConfigError(e) from None

# data: every file is checked before out_dir is touched -------------------------
if world_size == 1:  # (under torchrun every process would write it: prepare_shakespeare.py first)
    prepare_shakespeare.prepare_missing(data_dir, data_source)
meta = read_meta(data_dir)
base_vocab = meta["vocab_size"]
dataset_vocab = 2 * base_vocab if low_resource else base_vocab
if vocab_size and vocab_size < dataset_vocab:
    raise ConfigError(f"key 'vocab_size' is {vocab_size} but the dataset in {data_dir} has {dataset_vocab} "
                      f"tokens")
# train.bin / val.bin as read-only uint16 memmaps: only the sampled windows are ever read
train_data, val_data = (load_tokens(data_dir, split, block_size, base_vocab, meta.get(f"n_{split}"))
                        for split in ("train", "val"))
vocab_size = vocab_size or dataset_vocab
shift = base_vocab if low_resource else 0   # id offset of the low-resource language
rank, local_rank = 0, 0
if parallel != "none":
    rank, local_rank, world_size = parallelism.init_distributed("cuda" if "cuda" in device else device)
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
master = rank == 0  # the one process that prints and writes files
on_cuda = device.startswith("cuda")
if on_cuda:  # float32 matmuls (dtype=float32, or what autocast leaves in fp32) in TF32 on Ampere and later
    torch.set_float32_matmul_precision("high")  # GPUs; losses that need full fp32 keep it (model.full_fp32)
dtype = choose_dtype(dtype, device)
autocast = autocast_context(device, dtype)
# the same seed on every rank: the model starts identical everywhere (FSDP2 shards each rank's
# own copy, it does not broadcast), and dropout masks and dispersion positions are shared
torch.manual_seed(seed)
data_generator = torch.Generator().manual_seed(seed if data_seed is None else data_seed)
epoch_windows = EpochWindows(len(train_data), block_size, data_generator.initial_seed()) \
    if data_order == "epoch" else None


# model, parallelism and optimizer --------------------------------------------
# batch_size='auto': the most sequences per micro-step that the plan (memory.py) fits in every process
if batch_size == "auto":
    batch_size = config["batch_size"] = memory.auto_batch_size({**config, "dtype": dtype}, world_size,
                                                               vocab_size, device, master)
if global_batch_size:  # the config names the batch the recipe needs; micro-steps follow from the hardware
    gradient_accumulation_steps = global_batch_size // (batch_size * world_size)
if check_memory:  # the plan's memory for this process against what the device has, before allocating
    memory.check_fits({**config, "dtype": dtype}, world_size, vocab_size, device)
model_config = GPTConfig.from_config(config, vocab_size)  # (its rules were checked: check_train_config)
with torch.device("meta"):  # nothing allocated: parallelism.parallelize materialises each process's part
    model, objective = GPT(model_config), Objective.from_config(config)  # objective: NITP's head, if any

start_weights = None  # memory-mapped on the CPU; parallelize copies them in (FSDP: each rank's shards only)
if init_from not in ("scratch", "resume", "auto"):  # another run's weights, fresh optimizer, step 0 (CWT)
    start_weights = checkpoint.starting_weights(init_from, model_config, head_from_embedding, data_dir,
                                                 sharded=parallel == "fsdp")
    if master:
        print(f"initialised from {init_from}" + (" (LM head := copy of wte)" if head_from_embedding else ""))
if init_embeddings_from_seed is not None:  # one initialisation's blocks with another's embeddings (issue 40)
    start_weights = initial_weights(model_config, seed, embeddings_seed=init_embeddings_from_seed)
    if master:
        print(f"embeddings from seed {init_embeddings_from_seed}'s initialisation, the rest from {seed}'s")

# parallelism goes on from outside, in one place: compile, activation checkpointing around the
# compiled blocks (a MoE block's routing statistics cannot be traced inside a checkpoint), then DDP
# or FSDP2 (parallelism.py). train_model / train_objective are what the training step runs
# forward through; `model` and `objective` stay the modules themselves for everything else.
if compile == "True" or (compile == "auto" and on_cuda):
    parallelism.compile_blocks(model)
if activation_checkpointing:
    parallelism.apply_activation_checkpointing(model)
train_model, train_objective = parallelism.parallelize(
    model, objective, parallel, device, param_dtype=None if dtype == "float32" else getattr(torch, dtype),
    # parameters without a gradient: a headless run's untied LM head (experts always get one, stacked)
    unused_parameters=not (objective.trains_head or tie_weights), weights=start_weights,
    keep_gathered=fsdp_keep_gathered, shard_size=fsdp_shard_size)
del start_weights  # copied in (whole in memory if read from FSDP shards); parameters are shards under fsdp
optimizers = configure_optimizers(model, learning_rate, weight_decay, (beta1, beta2), separate_embeddings,
                                  extra_modules=[objective], embedding_weight_decay=None
                                  if embedding_weight_decay < 0 else embedding_weight_decay)
# gradient clipping covers the model's parameters (not the objective's NITP head), in both modes
clipper = AdaGC(model.parameters(), grad_clip, adagc_beta, adagc_rel, adagc_warmup) \
    if grad_clip_mode == "adagc" else None
clip = gradient_clipping(model, grad_clip, clipper)
# float16 only: loss scaling (optim.apply_gradients), a pass-through in every other dtype
scaler = torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "float16")
iter_num, best_val_loss = 0, float("inf")
# Stop Jostling's per-row gradient parts, every step (log_marginalization; metrics.py)
grad_recorder = metrics.EmbeddingGradientRecorder(log_marginalization, vocab_size)
# the rest of what a checkpoint holds to go on exactly: FLOPs so far, data order, RNGs, AdaGC, loss scale
training = checkpoint.TrainingState(data_generator, epoch_windows, clipper, scaler, grad_recorder, device)

# out_dir: only now, with every setting and file checked, is anything in it touched ------
# one run at a time (rank 0 holds out_dir/run.lock for every rank); 'auto' becomes 'resume' or 'scratch';
# a fresh run refuses a run already in out_dir unless overwrite=True
run_files = run.RunFiles(out_dir, torch.nn.ModuleDict({"model": model, "objective": objective}), optimizers,
                         parallel, master, device, learning_rate)
run_lock, init_from = run.open_run(out_dir, init_from, overwrite, master, sys.orig_argv)
if init_from == "resume":  # (a finished run asked to go on, a requeued job: run.RunComplete, exit 0)
    resumed = run_files.resume(config, training)
    iter_num, best_val_loss = resumed["iter_num"], resumed["best_val_loss"]
# Weights & Biases gets a copy of every log record; a resume continues the same W&B run
wandb_run = tracking.start_wandb(config, out_dir, init_from == "resume") if wandb_log and master else None
run_files.wandb_run = wandb_run


# training loop ---------------------------------------------------------------
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size * world_size  # over all processes
# the FLOPs train.py counts for MFU and the grids' cost (plan.py: 6N + attention + the objective's own)
flops_per_iter = tokens_per_iter * plan.training_flops_per_token(model, objective, batch_size * block_size)
flops_per_eval = plan.evaluation_flops(model, config, world_size)  # its batches split over the processes
peak = peak_flops(device, dtype) * world_size
if master:
    print(plan.run_summary(model.num_params(), device, dtype, tokens_per_iter, flops_per_iter, peak, parallel,
                           world_size, fsdp_shard_size))
    if notice := plan.long_work_notice(flops_per_iter, flops_per_eval, peak):  # a long wait for the first log
        print(notice, flush=True)
    if notice := plan.slow_dtype_notice(device, dtype, peak / world_size):  # e.g. float16 on most CPUs
        print(notice, flush=True)

last_eval = None
# a stop takes effect between steps: after every step the ranks agree on it (one host all-reduce of
# the flag, no device sync), so every rank stops at the same step, well inside torchrun's 30 s
stopping = 0  # the signal number of a stop agreed by every rank, 0 while none
bar = tqdm(total=max_iters, initial=iter_num, desc=os.path.basename(out_dir.rstrip("/")), dynamic_ncols=True,
           disable=not master)
t_window, window_iters = time.perf_counter(), 0
while True:
    lr = learning_rate_at(iter_num, learning_rate, warmup_iters, lr_schedule, lr_decay_iters, min_lr)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr

    evaluating, best = iter_num % eval_interval == 0 or iter_num == max_iters, False
    if evaluating:  # the batches split over the ranks, the result the same everywhere
        evaluation = evaluate.validation_losses(model, objective, val_data, batch_size, block_size,
                                                eval_iters, shift, low_resource_prob, device, autocast, rank,
                                                world_size, lambda: stop.signum and iter_num < max_iters)
        # None: a stop cut it short (on any rank); this step is saved without it, a resume evaluates it
        # again. Every rank got None together: they agree on the stop's signal
        if evaluation is None:
            stopping = parallelism.max_over_processes(stop.signum or 0)
    if evaluating and evaluation is not None:
        last_eval = evaluation
        training.flops_done["eval"] += flops_per_eval
        run_files.log({"iter": iter_num, **last_eval})
        bar.set_postfix(val=f"{last_eval['val']:.4f}")
        run_files.stop_if_diverged(last_eval, "validation", iter_num)  # no checkpoint holds a NaN
        best, best_val_loss = last_eval["val"] < best_val_loss, min(best_val_loss, last_eval["val"])
    # ckpt.pt at every evaluation, every checkpoint_interval steps (what a preempted long run loses at
    # most) and on a stop signal
    if evaluating or (checkpoint_interval and iter_num % checkpoint_interval == 0) or \
            (stopping and run_files.saved_step != iter_num):
        run_files.save(checkpoint.run_state(config, model_config, meta, iter_num, best_val_loss, last_eval),
                       training, best)
        t_window, window_iters = time.perf_counter(), 0  # keep evaluation and saving out of the speed figures
    if iter_num >= max_iters or stopping:
        break

    # The step's whole global batch is drawn at once, identically on every rank, and micro-step k
    # of rank r reads rows (k * world_size + r) * batch_size onwards: the union is the same global
    # batch however it is split over processes and micro-steps (one process with batch_size B and
    # 4 micro-steps sees exactly what 2 processes with 2 micro-steps each see).
    starts, is_low = sample_windows(len(train_data), block_size,
                                    gradient_accumulation_steps * world_size * batch_size, data_generator,
                                    low_resource_prob, epoch_windows)
    step_loss, step_terms = 0.0, {}
    for micro_step in range(gradient_accumulation_steps):
        first_row = (micro_step * world_size + rank) * batch_size
        rows = slice(first_row, first_row + batch_size)
        x, y = read_windows(train_data, starts[rows], is_low[rows], block_size, shift, device)
        # gradients are averaged over the processes only in the step's last backward
        with parallelism.gradient_sync((train_model, train_objective),
                                       micro_step == gradient_accumulation_steps - 1, fsdp_keep_gathered):
            with autocast:
                loss, terms, logits, hidden_states = objective_step(model, objective, x, y, train_model,
                                                                    train_objective)
            loss = loss / gradient_accumulation_steps
            grad_recorder.watch(logits, hidden_states)
            scaler.scale(loss).backward()
        step_loss = step_loss + loss.detach()  # the step's loss: the mean over its micro-steps
        # MoE: the share of tokens past an expert's capacity
        dropped = {} if model.dropped_fraction is None else {"moe_dropped": model.dropped_fraction}
        for name, value in {**terms, **dropped}.items():
            step_terms[name] = step_terms.get(name, 0) + value.detach() / gradient_accumulation_steps
        grad_recorder.add(x, y, logits, hidden_states, scaler)
        del logits, hidden_states  # or they live on into the next forward: one more logits at the peak
    stepped = apply_gradients(optimizers, scaler, clip)  # float16: unscaled first, skipped if any is inf/NaN
    grad_recorder.end_step(stepped)
    iter_num += 1
    window_iters += 1
    training.flops_done["train"] += flops_per_iter
    bar.update(1)
    stopping = parallelism.max_over_processes(stop.signum or 0)  # a stop on any rank: its signal, everywhere

    if iter_num % log_interval == 0:
        # the loss of the global batch: mean over micro-steps here, over processes by one all-reduce
        # (.tolist() syncs the device: only when logging)
        values = torch.stack([v.float() for v in (step_loss, *step_terms.values())])
        loss_value, *term_values = parallelism.mean_over_processes(values).tolist()
        step_losses = {"loss": loss_value, **dict(zip(step_terms, term_values))}
        dt = (time.perf_counter() - t_window) / window_iters
        record = {"iter": iter_num - 1, **step_losses, "lr": lr, "ms_per_iter": 1000 * dt,
                  "tokens_per_s": tokens_per_iter / dt, "mfu": flops_per_iter / dt / peak,
                  **({"loss_scale": scaler.get_scale()} if scaler.is_enabled() else {})}
        run_files.log(record)
        run_files.stop_if_diverged(step_losses, "training", iter_num)
        bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                        mfu=f"{record['mfu']:.2f}")
        t_window, window_iters = time.perf_counter(), 0
bar.close()
stopped = stopping and iter_num < max_iters  # a stop signal ended the run (at max_iters it is complete)
if stopped and master:  # the step is finished and saved: say how to go on, then exit 128 + signal
    print(run.stopped_message(stopping, iter_num, out_dir, sys.argv, world_size), flush=True)
flops_done = training.flops_done  # what the run executed, for metrics.json
if parallel != "none":  # nothing below needs the live model: the final evaluation reads best.pt
    del train_model, train_objective, model, objective, run_files, optimizers, clipper, clip, training
    parallelism.shutdown()
if stopped:
    sys.exit(128 + stopping)  # the same status on every rank, whichever got the signal

if grad_recorder.steps:  # (log_marginalization, parallel='none' only: one process)
    parts, train_tokens = torch.stack(grad_recorder.steps), torch.from_numpy(train_data.astype(np.int64))
    report = evaluate.marginalization_report(parts, train_tokens, shift, meta["itos"])
    save_json(report, os.path.join(out_dir, "marginalization.json"))

stop.release()  # the run is complete: from here Ctrl-C interrupts the final evaluation at once
if final_eval and master:  # one process: best.pt is read whole in any mode (FSDP: from its shards)
    evaluate.write_run_metrics(out_dir, flops_done, device, stop.name)  # a stop in the last step: not run
if wandb_run is not None:
    wandb_run.finish()
