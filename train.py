"""
Train a GPT on a prepared dataset, nanoGPT style:

    python train.py config/lowres_baseline.py
    python train.py config/lowres_margin_0.6_se.py --seed=2 --out_dir=out/se_s2
    torchrun --nproc_per_node=8 train.py config/baseline_1b3.py

The defaults below are the Stop Jostling low-resource experiment (Sec. 4.1,
Table 4): a 0.8M-parameter character GPT on tiny Shakespeare where each
training window is, with probability low_resource_prob, rewritten into a
second "low-resource" language. The run writes log.jsonl, ckpt.pt (resume
with --init_from=resume), best.pt and metrics.json to out_dir. Files,
stops, failures and design notes: docs/runs.md.
"""


import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import memory
import metrics
import parallelism
import plan
import prepare_shakespeare
import run
import scoring
import speed
import tracking
from configurator import (ConfigError, check_train_config, parse_config,
                          train_rules)
from data import (EpochWindows, load_tokens, read_meta, read_windows,
                  sample_windows)
from errors import end_on_user_error
from hang import Watchdog
from model import GPT, GPTConfig, initial_weights
from objective import Objective, ObjectiveConfig, Trained
from optim import (AdaGC, apply_gradients, configure_optimizers,
                   gradient_clipping, learning_rate_at)
from utils import (StopRequest, autocast_context, choose_device, choose_dtype,
                   keep_freed_memory, launched, peak_flops, save_json)


# -----------------------------------------------------------------------------
# default config (every key can be set in a config file or with --key=value)
# I/O
out_dir = "out/lowres_baseline"
data_dir = "data/shakespeare_char"  # train.bin, val.bin, meta.json
data_source = ""  # URL/file to prepare tiny Shakespeare's empty data_dir from
# scratch | resume (out_dir/ckpt.pt) | auto (resume if out_dir holds a
# checkpoint, else scratch: a requeued job's one command) | a checkpoint path
init_from = "scratch"
overwrite = False  # a fresh run may replace the run in out_dir
# keys a resume may change, e.g. "learning_rate,margin"; any other is refused
resume_changes = ""
head_from_embedding = False  # from a checkpoint: untied LM head := its wte
eval_interval = 250
checkpoint_interval = 0  # also save every this many steps; 0: at evals only
eval_iters = 20  # validation batches per evaluation
log_interval = 10
final_eval = True  # evaluate best.pt at the end, write metrics.json
seed = 1337  # the initialisation's (and dropout's) random numbers
data_seed = None  # the data order's (windows, languages); None: seed
# a fresh run's wte (with a head tied to it) and wpe as seed S's run draws
# them (on the CPU), every other weight from seed
init_embeddings_from_seed = None
# data
batch_size = 12  # sequences per process and micro-step; "auto": most that fit
block_size = 64
gradient_accumulation_steps = 1  # micro-steps (set by global_batch_size > 0)
global_batch_size = 0  # sequences per step, all processes; 0: batch x steps
# random: windows drawn with replacement (nanoGPT's, the toy papers');
# epoch: every window once per epoch, in an order seeded by (data seed, epoch)
data_order = "random"
low_resource = True  # add the low-resource language (Stop Jostling, 4.1)
low_resource_prob = 0.02  # probability that a window is in that language
# model: each key's default, rule and comment: model.GPTConfig
globals().update(vars(GPTConfig(vocab_size=0, block_size=block_size)))
# loss: a weighted sum of losses.py's terms, each on when its <name>_weight
# > 0; each key's default and rule: objective.ObjectiveConfig
globals().update(vars(ObjectiveConfig()))
separate_embeddings = False  # Stop Jostling SE: rows without gradient not stepped
embedding_weight_decay = -1.0  # the token embedding's; < 0: weight_decay
# AdamW and schedule
learning_rate = 1e-3
max_iters = 8000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0  # clip the global gradient norm at this; 0: off
grad_clip_mode = "norm"  # norm | adagc: per tensor (SimReg, App. A.1)
adagc_beta = 0.99  # AdaGC: EMA coefficient of each tensor's clipped norm
adagc_rel = 1.04  # AdaGC: a tensor's norm is bounded by this x its EMA
adagc_warmup = 100  # AdaGC: steps clipped globally at grad_clip first
warmup_iters = 100
lr_schedule = "cosine"  # cosine: to min_lr at lr_decay_iters | constant
lr_decay_iters = 8000
min_lr = 1e-4
# analysis
log_marginalization = False  # Stop Jostling's per-row gradient parts
# system
parallel = "none"  # none | ddp | fsdp (FSDP2), under torchrun
activation_checkpointing = False  # recompute in backward: ~1/3 more compute
fsdp_keep_gathered = False  # gather each block once per step (more memory)
fsdp_shard_size = 0  # fsdp: 0 shards over all; k within groups of k (HSDP)
collective_timeout = 600.0  # s a rank may wait for the others; then exit 75
hang_factor = 20.0  # a step this many median steps long: exit 75 sooner
check_memory = True  # refuse a run the plan says the device cannot fit
compile = "auto"  # torch.compile each block; auto: on CUDA | True | False
dry_run = False  # print the run's plan (plan.py) and exit
device = "auto"  # auto: cuda > mps > cpu
dtype = "auto"  # auto: bf16 | fp16 + loss scaling (CUDA) | fp32
num_threads = 0  # CPU threads for torch; 0: torch's default
# tracking (optional, `pip install wandb`; docs/tracking.md)
wandb_log = False  # also send log.jsonl's records to Weights & Biases
wandb_project = "repr-losses"
wandb_run_name = ""  # "": out_dir
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_")
               and isinstance(v, (int, float, bool, str, type(None)))]
end_on_user_error()  # a UserError, raised anywhere, ends the run in one line
config = parse_config(sys.argv[1:], {k: globals()[k] for k in config_keys},
                      train_rules())
globals().update(config)
# -----------------------------------------------------------------------------

keep_freed_memory()  # or big logits are page-faulted in anew every step
stop = StopRequest(announce=os.environ.get("RANK", "0") == "0")
world_size = launched("WORLD_SIZE", 1)  # set by torchrun
if dry_run:  # nothing allocated or read, out_dir untouched
    plan.print_plan(config, world_size)
    sys.exit(0)
if problem := check_train_config(config, world_size):
    raise ConfigError(problem)
torch.set_num_threads(num_threads or torch.get_num_threads())
try:
    device = choose_device(device)
except ValueError as e:
    raise ConfigError(e) from None

# data: every file is checked before out_dir is touched
if world_size == 1:  # under torchrun every process would write it
    prepare_shakespeare.prepare_missing(data_dir, data_source)
meta = read_meta(data_dir)
base_vocab = meta["vocab_size"]
vocab_size = plan.run_vocab(config)
# read-only memmaps: only the sampled windows are ever read
train_data, val_data = (
    load_tokens(data_dir, split, block_size, base_vocab, meta.get(f"n_{split}"))
    for split in ("train", "val"))
shift = base_vocab if low_resource else 0  # the low-resource language's ids
rank = 0
if parallel != "none":
    # the watchdog (below) ends a rank before a collective times out
    rank, local_rank, world_size = parallelism.init_distributed(
        "cuda" if "cuda" in device else device, collective_timeout + 60)
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
master = rank == 0  # the one process that prints and writes files
# a rank that stops answering ends the others in minutes (a thread)
watchdog = Watchdog(collective_timeout, hang_factor, rank, world_size)
on_cuda = device.startswith("cuda")
# TF32 on CUDA; a loss that needs full fp32 keeps it
torch.set_float32_matmul_precision("high" if on_cuda else "highest")
dtype = choose_dtype(dtype, device)
autocast = autocast_context(device, dtype)
# the same seed on every rank: FSDP2 shards each rank's own copy of the
# model (no broadcast), and dropout masks are shared
torch.manual_seed(seed)
data_generator = torch.Generator().manual_seed(
    seed if data_seed is None else data_seed)
epoch_windows = None
if data_order == "epoch":
    epoch_windows = EpochWindows(len(train_data), block_size,
                                 data_generator.initial_seed())

# model, parallelism and optimizer
if batch_size == "auto":  # the most sequences that fit in every process
    batch_size = memory.auto_batch_size({**config, "dtype": dtype},
                                        world_size, vocab_size, device, master)
    config["batch_size"] = batch_size
if global_batch_size:  # the recipe's batch; the hardware sets micro-steps
    gradient_accumulation_steps = global_batch_size // (batch_size * world_size)
if check_memory:  # before allocating anything
    memory.check_fits({**config, "dtype": dtype}, world_size, vocab_size,
                      device)
model_config = GPTConfig.from_config(config, vocab_size)
# the model and its loss (NITP's head), allocated by parallelize
with torch.device("meta"):
    trained = Trained(GPT(model_config), Objective.from_config(config))

start_weights = None  # memory-mapped on the CPU until parallelize
if init_from not in ("scratch", "resume", "auto"):  # CWT: fresh optimizer
    start_weights = checkpoint.starting_weights(
        init_from, model_config, head_from_embedding, data_dir,
        sharded=parallel == "fsdp")
    if master:
        head = " (LM head := copy of wte)" if head_from_embedding else ""
        print(f"initialised from {init_from}{head}")
if init_embeddings_from_seed is not None:
    start_weights = initial_weights(
        model_config, seed, embeddings_seed=init_embeddings_from_seed)
    if master:
        print(f"embeddings from seed {init_embeddings_from_seed}'s "
              f"initialisation, the rest from {seed}'s")

# compile, checkpoint around the compiled blocks, then DDP or FSDP2; a
# step runs forward through the wrapper, all else uses trained itself
if compile == "True" or (compile == "auto" and on_cuda):
    parallelism.compile_blocks(trained.model)
if activation_checkpointing:
    parallelism.apply_activation_checkpointing(trained.model)
wrapper = parallelism.parallelize(
    trained, parallel, device,
    param_dtype=None if dtype == "float32" else getattr(torch, dtype),
    # a headless run's untied LM head gets no gradient
    unused_parameters=not (trained.objective.trains_head
                           or model_config.tie_weights),
    weights=start_weights,
    keep_gathered=fsdp_keep_gathered, shard_size=fsdp_shard_size)
del start_weights  # copied in
optimizers = configure_optimizers(
    trained.model, learning_rate, weight_decay, (beta1, beta2),
    separate_embeddings, extra_modules=[trained.objective],
    embedding_weight_decay=None if embedding_weight_decay < 0
    else embedding_weight_decay)
clipper = None  # clipping covers the model, not the objective's head
if grad_clip_mode == "adagc":
    clipper = AdaGC(trained.model.parameters(), grad_clip, adagc_beta,
                    adagc_rel, adagc_warmup)
clip = gradient_clipping(trained.model, grad_clip, clipper)
# float16's loss scaling; a pass-through in other dtypes
scaler = torch.amp.GradScaler(torch.device(device).type,
                              enabled=dtype == "float16")
iter_num = 0
best_val_loss = float("inf")
grad_recorder = metrics.EmbeddingGradientRecorder(log_marginalization,
                                                  vocab_size)
# the rest of what a resume needs to go on exactly
training = checkpoint.TrainingState(data_generator, epoch_windows, clipper,
                                    scaler, grad_recorder, device)

# out_dir: touched only now, with every setting and file checked
run_files = run.RunFiles(out_dir, trained, optimizers, parallel, master,
                         device, learning_rate)
run_lock, init_from = run.open_run(out_dir, init_from, overwrite, master,
                                   sys.orig_argv)  # auto: resume | scratch
if init_from == "resume":
    resumed = run_files.resume(config, training)
    iter_num = resumed["iter_num"]
    best_val_loss = resumed["best_val_loss"]
wandb_run = tracking.start_wandb(config, out_dir, init_from == "resume",
                                 master)
run_files.wandb_run = wandb_run


# training loop ---------------------------------------------------------------
tokens_per_iter = (gradient_accumulation_steps * batch_size * block_size
                   * world_size)
# the FLOPs counted for MFU and for the grids' cost
flops_per_iter = tokens_per_iter * plan.training_flops_per_token(
    trained.model, trained.objective, batch_size * block_size)
flops_per_eval = plan.evaluation_flops(trained.model, config, world_size)
peak = peak_flops(device, dtype) * world_size
if master:
    print(speed.start_lines(trained.model.num_params(), config, device,
                            dtype, tokens_per_iter, flops_per_iter,
                            flops_per_eval, peak, world_size), flush=True)


def stop_pending():
    """Asked before each evaluation batch; each gets the watchdog's
    limit anew."""
    watchdog.enter("evaluating", iter_num)
    return stop.signum and iter_num < max_iters


last_eval = None
stopping = 0  # the signal of a stop every rank agreed on; 0: none
bar = tqdm(total=max_iters, initial=iter_num, disable=not master,
           desc=os.path.basename(out_dir.rstrip("/")), dynamic_ncols=True)
t_window = time.perf_counter()  # speed: since the last log or save
window_iters = 0
while True:
    lr = learning_rate_at(iter_num, learning_rate, warmup_iters, lr_schedule,
                          lr_decay_iters, min_lr)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr

    # evaluate and log; None: a stop cut it short (on every rank)
    evaluating = iter_num % eval_interval == 0 or iter_num == max_iters
    evaluation = None
    if evaluating:
        evaluation = scoring.validation_losses(
            trained.model, trained.objective, val_data, batch_size,
            block_size, eval_iters, shift, low_resource_prob, device,
            autocast, rank, world_size, stop_pending)
    best = False
    if evaluation is not None:
        last_eval = evaluation
        training.flops_done["eval"] += flops_per_eval
        run_files.log({"iter": iter_num, **last_eval})
        bar.set_postfix(val=f"{last_eval['val']:.4f}")
        run_files.stop_if_diverged(last_eval, "validation", iter_num)
        best = last_eval["val"] < best_val_loss
        best_val_loss = min(best_val_loss, last_eval["val"])

    # a stop on any rank: the same step and signal on all
    watchdog.enter("saving", iter_num)
    stopping = parallelism.max_over_processes(stop.signum or 0)
    # save (what a preempted run loses at most: checkpoint_interval steps)
    if (evaluating
            or (checkpoint_interval and iter_num % checkpoint_interval == 0)
            or (stopping and run_files.saved_step != iter_num)):
        state = checkpoint.run_state(config, model_config, meta, iter_num,
                                     best_val_loss, last_eval)
        run_files.save(state, training, best)
        t_window = time.perf_counter()  # no saving in the speed figures
        window_iters = 0
    if iter_num >= max_iters or stopping:
        break

    # step: the global batch is drawn whole, the same on every rank
    watchdog.enter("training", iter_num)
    starts, is_low = sample_windows(
        len(train_data), block_size,
        gradient_accumulation_steps * world_size * batch_size,
        data_generator, low_resource_prob, epoch_windows)
    step_loss = 0.0
    step_terms = {}
    for micro_step in range(gradient_accumulation_steps):
        first_row = (micro_step * world_size + rank) * batch_size
        rows = slice(first_row, first_row + batch_size)
        x, y = read_windows(train_data, starts[rows], is_low[rows],
                            block_size, shift, device)
        last_micro_step = micro_step == gradient_accumulation_steps - 1
        # gradients are averaged over the processes in the last backward
        with parallelism.gradient_sync(wrapper, last_micro_step,
                                       fsdp_keep_gathered):
            with autocast:
                loss, terms, logits, hidden_states = wrapper(x, y)
            loss = loss / gradient_accumulation_steps
            grad_recorder.watch(logits, hidden_states)
            scaler.scale(loss).backward()
        step_loss = step_loss + loss.detach()
        dropped = trained.model.dropped_fraction
        if dropped is not None:  # MoE: tokens past capacity
            terms = {**terms, "moe_dropped": dropped}
        for name, value in terms.items():
            share = value.detach() / gradient_accumulation_steps
            step_terms[name] = step_terms.get(name, 0) + share
        grad_recorder.add(x, y, logits, hidden_states, scaler)
        del logits, hidden_states  # or one more logits at the next peak
    # float16: unscaled first, skipped if any gradient is inf/NaN
    stepped = apply_gradients(optimizers, scaler, clip)
    grad_recorder.end_step(stepped)
    iter_num += 1
    window_iters += 1
    training.flops_done["train"] += flops_per_iter
    bar.update(1)

    if iter_num % log_interval == 0:  # .tolist() syncs: only when logging
        values = [v.float() for v in (step_loss, *step_terms.values())]
        loss_value, *term_values = parallelism.mean_over_processes(
            torch.stack(values)).tolist()
        step_losses = {"loss": loss_value, **dict(zip(step_terms, term_values))}
        dt = (time.perf_counter() - t_window) / window_iters
        record = {"iter": iter_num - 1, **step_losses, "lr": lr,
                  "ms_per_iter": 1000 * dt,
                  "tokens_per_s": tokens_per_iter / dt,
                  "mfu": flops_per_iter / dt / peak}
        if scaler.is_enabled():
            record["loss_scale"] = scaler.get_scale()
        run_files.log(record)
        run_files.stop_if_diverged(step_losses, "training", iter_num)
        bar.set_postfix(loss=f"{loss_value:.4f}",
                        tok_s=f"{record['tokens_per_s']:.0f}",
                        mfu=f"{record['mfu']:.2f}")
        t_window = time.perf_counter()
        window_iters = 0
bar.close()
watchdog.stop()
stopped = stopping and iter_num < max_iters  # at max_iters: complete
if stopped and master:  # the step is saved: say how to go on
    print(run.stopped_message(stopping, iter_num, out_dir, sys.argv,
                              world_size), flush=True)
flops_done = training.flops_done  # for metrics.json
if parallel != "none":  # the final evaluation reads best.pt
    del wrapper, trained, run_files
    del optimizers, clipper, clip, training
    parallelism.shutdown()
if stopped:
    sys.exit(128 + stopping)  # the same status on every rank

if grad_recorder.steps:  # log_marginalization (one process)
    parts = torch.stack(grad_recorder.steps)
    train_tokens = torch.from_numpy(train_data.astype(np.int64))
    report = scoring.marginalization_report(parts, train_tokens, shift,
                                             meta["itos"])
    save_json(report, os.path.join(out_dir, "marginalization.json"))

stop.release()  # the run is complete: Ctrl-C now ends the final evaluation
if final_eval and master:  # best.pt, read whole (FSDP: from its shards)
    scoring.write_run_metrics(out_dir, flops_done, device, stop.name)
if wandb_run is not None:
    wandb_run.finish()
