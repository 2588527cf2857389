"""
The plan of a run, before it starts: what train.py would do with a config on a number of
processes, and whether it fits and how long it takes.

    python train.py config/baseline_7b.py --dry_run=True       # the plan for the processes as launched
    python plan.py config/baseline_7b.py --processes 64 --gpu H100 --mfu 0.4 \
        [--link_gbps 400] [--key=value ...]

Nothing is allocated for the run: the model and the objective are built on the meta device, so
a 7B plan takes seconds. train.py --dry_run plans for the device the run would use (its key
'device'): a CUDA GPU as an H100, as plan.py does without --gpu; a CPU or MPS at this machine's
measured speed and memory. The plan holds

    size      parameters (total; active per token for a mixture of experts), the objective's own
    batch     tokens per optimizer step and per run, micro-steps per process (global_batch_size)
    compute   FLOPs per step and per run (the ones train.py counts for MFU: 6 per matmul weight
              and token plus attention; evaluations added), and the time: on a GPU at a stated MFU
              of its datasheet peak; on a CPU (or MPS) at the speed measured there (measured_speed)
    communication  bytes each process sends per optimizer step for DDP or FSDP, their time at the
              link's bandwidth, and the run's time with compute and communication overlapped
    memory    per GPU (per process on a CPU) for DDP and for FSDP, with and without activation
              checkpointing
    data      the tokens the run reads against the tokens prepared in data_dir (C4: shards): epochs
              (data_order='epoch') or the share never seen (random windows), with a warning when it
              would pass over its data more than once

Memory: memory.py (states from the parameter count, activations measured on the meta device).
train.py compares this plan with the device's memory before it allocates anything
(memory.memory_problem).

Communication: comms.py (the bytes DDP and FSDP send per optimizer step, and their time).
"""

import argparse
import math
import os
import statistics

import torch

from configurator import ConfigError, check_train_config, parse_config, train_defaults, train_rules
from data import DataError, preparation_command, read_meta
import parallelism
from memory import (AUTO_BATCH_MEMORY, GPU_MEMORY_GIB, GiB, compute_dtype, cpu_heap_allowance,
                    gathered_bytes, memory_by_mode, meta_model, micro_steps_of, resolve_batch_size,
                    shard_group)
from comms import communication_bytes, communication_lines, link_of, step_seconds
from errors import UsageError, end_with
from model import GPT, GPTConfig, build_model
from objective import Objective, objective_step
from optim import configure_optimizers
from utils import (GPU_PEAK_BF16_FLOPS, autocast_context, available_memory, choose_device, choose_dtype, duration,
                   launched, measure_matmul_flops, peak_flops, seconds)

C4_TOKENS_PER_SHARD = 150e6  # GPT-2 BPE tokens in one C4 "en" train shard, roughly (prepare_c4.py)


def run_vocab(config):
    """The vocabulary a run builds its model with: vocab_size if set, else the dataset's, doubled
    by the simulated low-resource language (train.py does the same)."""
    if config["vocab_size"]:
        return config["vocab_size"]
    try:
        base = read_meta(config["data_dir"])["vocab_size"]
    except DataError as e:
        raise ConfigError(f"a plan needs key 'vocab_size' or a dataset in data_dir ({e})") from None
    return 2 * base if config["low_resource"] else base


def training_flops_per_token(model, objective, micro_batch_tokens):
    """FLOPs of one training token: the model's 6N + attention (model.flops_per_token), plus the
    objective's trainable head (NITP: 6 per weight) and CWT's in-batch logits, which stand in for
    the LM head (each token against the micro-batch's embeddings: 6 x tokens x C). The other
    losses' similarity products are not counted. train.py uses this for its MFU."""
    head = sum(p.numel() for p in objective.parameters() if p.dim() >= 2)
    contrastive = 6 * micro_batch_tokens * model.config.n_embd if objective.weights["cwt"] else 0
    return model.flops_per_token(with_head=objective.trains_head) + 6 * head + contrastive


def evaluation_flops(model, config, processes=1):
    """FLOPs of one evaluation over all processes: eval_iters batches split over them, each batch
    scored in every language, LM head on; a process whose share is short repeats a batch
    (evaluate.validation_losses), so every process runs ceil(eval_iters / processes)."""
    languages = 2 if config["low_resource"] else 1
    batches = math.ceil(config["eval_iters"] / processes) * processes
    tokens = batches * languages * config["batch_size"] * config["block_size"]
    return tokens * model.flops_per_token(backward=False)


def long_work_notice(flops_per_step, flops_per_eval, peak, mfu=0.4, threshold_s=120):
    """The line train.py prints before its loop when one step or one evaluation would take more
    than threshold_s on this device: their FLOPs (over all processes) at the plan's MFU of the
    device's peak (peak: FLOP/s of all processes). Without it a run that works looks hung until
    its first log line. None when both are short."""
    seconds = {what: flops / (mfu * peak) for what, flops in (("one step", flops_per_step),
                                                                ("one evaluation", flops_per_eval))}
    long = [f"{what} will take about {s / 60:,.0f} min" for what, s in seconds.items() if s > threshold_s]
    if not long:
        return None
    return (f"note: {' and '.join(long)} on this device (plan: {flops_per_step / 1e12:,.1f} TFLOP per step, "
            f"{flops_per_eval / 1e12:,.1f} per evaluation, at MFU {mfu:.0%} of {peak / 1e9:,.0f} GFLOP/s); "
            f"the first log line comes after it")


# name -> (model config, batch size): the CE runs of the comparison grids; a CPU plan times the first
EFFICIENCY_SETTINGS = {
    "lowres": (dict(vocab_size=130, block_size=64, n_layer=4, n_head=4, n_embd=128), 12),
    "bpe": (dict(vocab_size=50304, block_size=128, n_layer=4, n_head=4, n_embd=128), 8),
}


def step_time(model_config, objective_kwargs, batch_size, steps, warmup, device, dtype):
    """Median seconds of one training step of random tokens with the given objective (its keys,
    objective.ObjectiveConfig's), after `warmup` untimed steps."""
    torch.manual_seed(0)
    model = build_model(model_config, device)
    objective = Objective(model_config.n_layer, model_config.n_embd, **objective_kwargs).to(device)
    objective.init_weights()
    optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), extra_modules=[objective])
    T, V = model_config.block_size, model_config.vocab_size
    x = torch.randint(0, V, (batch_size, T), device=device)
    y = torch.randint(0, V, (batch_size, T), device=device)
    autocast = autocast_context(device, dtype)

    def step():
        with autocast:
            loss, *_ = objective_step(model, objective, x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    times = [seconds(step, device) for _ in range(warmup + steps)]
    return statistics.median(times[warmup:])


def measured_speed(device, dtype):
    """(peak FLOP/s, MFU) of this machine's `device`, where no datasheet gives a speed (a CPU, MPS):
    the matmul peak train.py divides by for its MFU (utils.peak_flops), and the MFU that the toy's
    CE training step reaches on it, timed as `python -m tools.bench --section efficiency` times it
    (its lowres setting; results/bench.md: 0.56 on 2 cores). About a second on 2 cores."""
    peak = peak_flops(device, dtype)
    settings, batch_size = EFFICIENCY_SETTINGS["lowres"]
    toy = GPTConfig(**settings)
    # the median of 10 steps after 3 untimed ones (allocation, the first kernels' set-up)
    step_s = step_time(toy, {}, batch_size, 10, 3, device, dtype)
    with torch.device("meta"):
        flops = GPT(toy).flops_per_token() * batch_size * toy.block_size
    return peak, flops / step_s / peak


def data_needed(config, tokens_per_run):
    """What the run reads against what data_dir holds: dict with passes (None if not prepared) and
    what the data order makes of them: epochs (data_order='epoch': every window once per epoch),
    or the expected share of the training split never seen (random windows, with replacement)."""
    out = {"data_dir": config["data_dir"], "tokens": tokens_per_run}
    try:
        meta = read_meta(config["data_dir"])
    except DataError:
        meta = None
    c4 = os.path.basename(os.path.normpath(config["data_dir"])).startswith("c4")
    if meta is not None:
        out["prepared"] = meta.get("n_train", 0)
        out["passes"] = tokens_per_run / out["prepared"] if out["prepared"] else float("inf")
        n, T, windows = out["prepared"], config["block_size"], tokens_per_run // config["block_size"]
        if config.get("data_order") == "epoch" and n > T:  # data.EpochWindows: (n - 1) // T windows per epoch
            out["epochs"] = windows / ((n - 1) // T)
        elif n > T:
            # a token is in a window that starts at most T before it: T + 1 of the n - T random starts,
            # so the run's windows all miss it with probability (1 - (T + 1) / (n - T))^windows ~ exp(-passes)
            out["unseen"] = max(0.0, 1 - (T + 1) / (n - T)) ** windows
        if meta.get("train_shards"):
            per_shard = out["prepared"] / len(meta["train_shards"])
            out["shards"] = len(meta["train_shards"])
            out["shards_needed"] = math.ceil(tokens_per_run / per_shard)
    else:
        out["prepared"], out["passes"] = None, None
        if c4:
            out["shards_needed"] = math.ceil(tokens_per_run / C4_TOKENS_PER_SHARD)
    return out


def device_figures(device, gpu, mfu, dtype, processes):
    """What a plan takes from the device it is for: the peak FLOP/s of one process, the MFU, and
    the memory batch_size='auto' may fill. device 'cuda': `gpu`'s datasheet figures at `mfu` (the
    GPU need not be here). A CPU or MPS: this machine's, measured now (measured_speed; `mfu` is not
    used), with what it has for each process (utils.available_memory) and, on the CPU, glibc's
    heap on top of the tensors (memory.CPU_HEAP_ALLOWANCE), as train.py's memory check counts it."""
    if device == "cuda":
        return {"gpu": gpu, "peak": GPU_PEAK_BF16_FLOPS[gpu], "mfu": mfu,
                "memory_gib": GPU_MEMORY_GIB[gpu], "memory_of": f"one {gpu}'s", "heap": 0.0}
    peak, measured_mfu = measured_speed(device, dtype)
    available, source = available_memory(device)
    return {"gpu": None, "peak": peak, "mfu": measured_mfu,
            "memory_gib": available / GiB, "memory_of": f"this {device}'s", "memory_source": source,
            "heap": cpu_heap_allowance(processes) if device == "cpu" else 0.0}


def make_plan(config, processes=1, gpu="H100", mfu=0.4, measure=True, link_gbps=None, device="cuda"):
    """The plan of `config` (a dict of train.py's keys) on `processes` processes, as a dict.
    device: 'cuda' plans for `gpu` at `mfu`; 'cpu' or 'mps' for this machine at its measured speed
    (device_figures).
    link_gbps: the link's Gb/s each way per GPU; None = LINK_GBPS's figure for gpu and processes
    (none for processes on a CPU: their communication is counted, not timed)."""
    if not (isinstance(processes, int) and processes >= 1):
        raise ConfigError(f"processes must be a positive integer, got {processes}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"mfu must be in (0, 1] (a fraction of the GPU's peak), got {mfu}")
    # a plan needs no checkpoint; a GPU plan is for GPUs, not the device it is made on
    problem = check_train_config({**config, "init_from": "scratch", "device": device}, processes)
    if problem:
        raise ConfigError(problem)
    if device == "cuda" and gpu not in GPU_PEAK_BF16_FLOPS:
        raise ConfigError(f"unknown gpu {gpu!r}: expected one of {', '.join(GPU_PEAK_BF16_FLOPS)}")
    if link_gbps is not None and not link_gbps > 0:
        raise ConfigError(f"link_gbps must be > 0, got {link_gbps}")
    # its step measured with the device's logits (step_peak_bytes); off a GPU in the dtype the run
    # would choose there (FSDP gathers float32 weights on a CPU)
    config = {**config, "device": device}
    if device != "cuda":
        config["dtype"] = choose_dtype(config["dtype"], device)
    model, objective = meta_model(config, run_vocab(config))
    # measured (off a GPU) once the config is known to be one the plan can take
    figures = device_figures(device, gpu, mfu, config["dtype"], processes)
    auto = config["batch_size"] == "auto"
    config, fits = resolve_batch_size(config, processes, run_vocab(config), figures["memory_gib"],
                                      figures["heap"])
    B, T = config["batch_size"], config["block_size"]
    micro_steps = micro_steps_of(config, processes)
    tokens_per_step = micro_steps * B * T * processes
    flops_per_token = training_flops_per_token(model, objective, B * T)
    flops_per_step = flops_per_token * tokens_per_step
    evaluations = config["max_iters"] // config["eval_interval"] + 1  # at step 0 and every eval_interval
    flops_per_run = (flops_per_step * config["max_iters"]
                     + evaluations * evaluation_flops(model, config, processes))
    per_gpu, parts = memory_by_mode(model, config, processes, micro_steps, measure)
    # processes on a CPU talk over gloo, for which there is no link figure unless one is given
    timed = device == "cuda" or link_gbps is not None
    link, link_name = link_of(gpu, processes, link_gbps) if timed else (None, None)
    speed = figures["mfu"] * figures["peak"] * processes  # FLOP/s of all the processes
    hours = flops_per_run / speed / 3600
    compute_s = flops_per_step / speed

    def communication(micro_steps, processes=processes, keep=config.get("fsdp_keep_gathered", False)):
        """bytes, and seconds at the links' Gb/s: FSDP's within its shard group's link; DDP's, and
        hybrid sharding's all-reduce between the groups, over the link between all the processes"""
        group = shard_group(config, processes) if config["parallel"] == "fsdp" else processes
        moved = communication_bytes(model, objective, config["parallel"], processes, micro_steps,
                                    gathered_bytes(config), keep, group)
        if not timed:  # no time to set against compute (communication_lines says so)
            return {**moved, "seconds": 0.0, "exposed_seconds": 0.0}
        within, between = (link_of(gpu, n, link_gbps)[0] * 1e9 / 8 for n in (group, processes))
        seconds = (moved["all_gather"] + moved["reduce_scatter"]) / within + moved["all_reduce"] / between
        return {**moved, "seconds": seconds,
                "exposed_seconds": moved["exposed"] / within + moved["exposed_between"] / between}
    moved = communication(micro_steps)
    step_s = step_seconds(compute_s, moved["seconds"], moved["exposed_seconds"])
    # fewer micro-steps (a larger batch_size, the same tokens per step) gather FSDP's units fewer times:
    # the most micro-steps whose communication compute would hide; failing that, the most processes
    # (fewer than now, one micro-step each) on which the step's compute would hide it
    fewer = next(({"micro_steps": k, "seconds": communication(k)["seconds"],
                   "keys": f"--batch_size={B * micro_steps // k}"
                   + ("" if config["global_batch_size"] else f" --gradient_accumulation_steps={k}")}
                  for k in range(micro_steps - 1, 0, -1) if micro_steps % k == 0
                  and communication(k)["seconds"] <= compute_s), None)
    # FSDP: the weights kept gathered over the step (fsdp_keep_gathered): its time, and its memory per GPU
    kept = None
    if config["parallel"] == "fsdp" and not config.get("fsdp_keep_gathered"):
        gathered = memory_by_mode(model, {**config, "fsdp_keep_gathered": True}, processes, micro_steps,
                                  False)[1]["fsdp"]
        mode = "checkpointed" if config["activation_checkpointing"] else "plain"
        kept = {"seconds": communication(micro_steps, keep=True)["seconds"],
                "gib": per_gpu["fsdp"][mode] + (gathered - parts["fsdp"])}
    sequences = config["global_batch_size"]
    fewer_processes = next(({"processes": n, "keys": f"--batch_size={sequences // n}"}
                            for n in range(processes - 1, 0, -1) if sequences and sequences % n == 0
                            and communication(1, n)["seconds"] <= compute_s * processes / n), None)
    return {"params": model.num_params(), "active_params": model.num_params(active=True),
            "objective_params": sum(p.numel() for p in objective.parameters()),
            "processes": processes, "micro_batch": B, "seq_len": T, "micro_steps": micro_steps,
            "auto_batch": auto and ("fits" if fits else "nothing fits"),
            "tokens_per_step": tokens_per_step, "tokens_per_run": tokens_per_step * config["max_iters"],
            "steps": config["max_iters"], "flops_per_step": flops_per_step, "flops_per_run": flops_per_run,
            "device": device, "dtype": config["dtype"],
            **figures, "hours": hours, "compute_seconds": compute_s,
            "communication": moved, "link_gbps": link, "link": link_name, "step_seconds": step_s,
            "shard_group": shard_group(config, processes) if config["parallel"] == "fsdp" else processes,
            "group_link": link_of(gpu, shard_group(config, processes), link_gbps) if timed else None,
            "hours_with_communication": hours + config["max_iters"] * (step_s - compute_s) / 3600,
            "fewer_micro_steps": fewer, "fewer_processes": fewer_processes, "keep_gathered": kept,
            "fsdp_keep_gathered": config.get("fsdp_keep_gathered", False),
            "memory": per_gpu, "memory_parts": parts, "parallel": config["parallel"],
            "activation_checkpointing": config["activation_checkpointing"],
            "padding": None if config["parallel"] != "fsdp" else parallelism.padding_note(
                [*model.named_parameters(), *objective.named_parameters()], shard_group(config, processes)),
            "data": data_needed(config, tokens_per_step * config["max_iters"])}


def format_plan(p):
    """The plan as the lines train.py --dry_run prints."""
    active = f" ({p['active_params']:,} active per token)" if p["active_params"] != p["params"] else ""
    plus_objective = f" + objective {p['objective_params']:,}" if p["objective_params"] else ""
    source = f" ({p['memory_source']})" if "memory_source" in p else ""
    of_one_gpu = f"{AUTO_BATCH_MEMORY:.0%} of {p['memory_of']} {p['memory_gib']:.1f} GiB{source}"
    auto = {"fits": f" (batch_size='auto': the most that fits {of_one_gpu})",
            "nothing fits": f" (batch_size='auto': not even 1 fits {of_one_gpu} on {p['processes']} "
                            "process(es): see memory)",
            False: ""}[p["auto_batch"]]
    unit, per_gib = memory_unit(p["memory"])
    lines = [f"params: {p['params']:,}{active}{plus_objective}",
             f"batch: {p['processes']} process(es) x {p['micro_steps']} micro-step(s) x {p['micro_batch']}"
             f"{auto} x {p['seq_len']} = {p['tokens_per_step']:,} tokens/step; {p['steps']:,} steps = "
             f"{p['tokens_per_run']:,} tokens",
             f"compute: {p['flops_per_step']:.3e} FLOPs/step, {p['flops_per_run']:.3e} FLOPs/run "
             f"(evaluations included) = {duration(p['hours'] * 3600)} on {speed_of(p)}",
             *communication_lines(p), *([p["padding"]] if p["padding"] else []),
             memory_heading(p, unit)]
    chosen = p["parallel"] if p["parallel"] != "none" else "ddp"
    for mode in ("ddp", "fsdp"):
        m = p["memory"][mode]
        def mark(ckpt):
            return " <- this config" if mode == chosen and ckpt == p["activation_checkpointing"] else ""
        lines.append(f"  {mode}: {m['plain'] * per_gib:.1f}{mark(False)}, "
                     f"with activation checkpointing {m['checkpointed'] * per_gib:.1f}{mark(True)}")
    d = p["data"]
    if d["prepared"] is None:
        if "shards_needed" in d:
            need = (f" (about {d['shards_needed']} C4 shards: "
                    f"{preparation_command(d['data_dir'], d['shards_needed'])})")
        else:
            need = f" ({preparation_command(d['data_dir'])})"
        lines.append(f"data: {d['tokens']:,} tokens needed; nothing prepared in {d['data_dir']}{need}")
    else:
        shards = (f" from {d['shards']} shard(s); {d['shards_needed']} needed for one pass"
                  if "shards" in d else "")
        held = f"{d['prepared']:,} prepared in {d['data_dir']}{shards}"
        if "epochs" in d:
            lines.append(f"data: {d['tokens']:,} tokens trained = {d['epochs']:.2f} epochs of the "
                         f"training split ({held}; data_order='epoch': every window once per epoch)")
        else:
            unseen = (f"; random windows (data_order='random') leave about {d['unseen']:.1%} of it "
                      "never seen") if "unseen" in d else ""
            lines.append(f"data: {d['tokens']:,} tokens trained = {d['passes']:.2f} passes over the "
                         f"training split ({held}){unseen}")
        if d["passes"] > 1:
            lines.append(f"warning: the run passes over its data {d['passes']:.1f} times")
    return "\n".join(lines)


def speed_of(p):
    """What the plan's time assumes: on a GPU, the processes' GPUs at the stated MFU; elsewhere the
    speed measured here (measured_speed), with the MFU it is and the peak it is a fraction of."""
    if p["gpu"]:
        return f"{p['processes']} x {p['gpu']} at MFU {p['mfu']:.0%}"
    return (f"{p['processes']} x {p['device']} at {p['mfu'] * p['peak'] / 1e9:,.0f} GFLOP/s each, "
            f"the toy's CE step measured here now (MFU {p['mfu']:.0%} of a {p['dtype']} matmul's "
            f"{p['peak'] / 1e9:,.0f} GFLOP/s, as train.py counts it)")


def memory_unit(table):
    """(unit, its figures per GiB) of the memory lines: MiB when a figure is under 1 GiB, which
    would read 0.0 in GiB (a toy's whole run), else GiB. Figures not measured (NaN) do not count."""
    figures = [gib for mode in table.values() for gib in mode.values() if not math.isnan(gib)]
    return ("MiB", 1024) if figures and min(figures) < 1 else ("GiB", 1)


def memory_heading(p, unit):
    """The memory table's first line: per GPU; off a GPU, of each process, whose tensors the
    figures are (weights, gradients, AdamW's moments, a step's activations: not its libraries, nor
    the heap glibc keeps)."""
    if p["gpu"]:
        return f"memory per GPU ({unit}; activations in the compute dtype):"
    activations = str(compute_dtype({"device": p["device"], "dtype": p["dtype"]})).removeprefix("torch.")
    whose = "the process" if p["processes"] == 1 else "each process"
    return f"memory of {whose} ({unit}; its tensors, activations in {activations}):"


def slow_dtype_notice(device, dtype, peak):
    """The line train.py prints when a CPU runs the chosen dtype's matmuls slower than float32's
    (peak: the chosen dtype's measured FLOP/s; most CPUs have no float16 units, some no bfloat16
    ones): both speeds, measured here. None on a GPU, in float32, or where the dtype is faster."""
    if device != "cpu" or dtype == "float32":
        return None
    float32 = measure_matmul_flops(device, torch.float32)
    if float32 <= peak:
        return None
    return (f"note: {dtype} matmuls run at {peak / 1e9:,.0f} GFLOP/s on this CPU and float32's at "
            f"{float32 / 1e9:,.0f}: --dtype=float32 would train about {float32 / peak:,.0f}x faster")


def run_summary(params, device, dtype, tokens_per_iter, flops_per_iter, peak, parallel, processes,
                shard_size):
    """train.py's first line: the model's size, the device, a step's tokens and FLOPs, the peak (all
    processes') and how the processes share the work."""
    hybrid = f" sharded in groups of {shard_size}" if parallel == "fsdp" and 0 < shard_size < processes \
        else ""
    plural = "es" if processes > 1 else ""
    how = f" | {processes} process{plural}, {parallel}{hybrid}" if parallel != "none" else ""
    return (f"params: {params:,} | device {device} {dtype} | {tokens_per_iter} tokens/iter | "
            f"{flops_per_iter / 1e9:.2f} GFLOP/iter | peak {peak / 1e9:.0f} GFLOP/s{how}")


def print_plan(config, processes):
    """train.py --dry_run=True: the plan of this run on these processes, for the device it would
    use (a CUDA GPU planned as an H100; a CPU or MPS at its measured speed), printed by rank 0;
    nothing allocated for the run, no data read, out_dir untouched. A config the plan cannot take
    is a ConfigError."""
    try:
        device = choose_device(config["device"])
    except ValueError as e:
        elsewhere = "to plan it for a GPU elsewhere: python plan.py <config> --gpu H100"
        raise ConfigError(f"{e}; {elsewhere}") from None
    if config["num_threads"] > 0:  # the run's threads time the toy's step (train.py sets them after this)
        torch.set_num_threads(config["num_threads"])
    p = make_plan(config, processes, device="cuda" if device.startswith("cuda") else device)
    if launched("RANK", 0) == 0:
        print(format_plan(p))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=None, help="default: WORLD_SIZE, else 1")
    parser.add_argument("--gpu", default="H100",
                        help=f"one of {', '.join(GPU_PEAK_BF16_FLOPS)} (bf16 datasheet peak)")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="the model FLOPs utilisation assumed for the time")
    parser.add_argument("--link_gbps", type=float, default=None,
                        help="Gb/s each way per GPU of the collectives' link "
                             "(default: LINK_GBPS's for --gpu)")
    args, config_args = parser.parse_known_args(argv)
    try:
        config = parse_config(config_args, train_defaults(), train_rules())  # train.py's rules
        processes = launched("WORLD_SIZE", 1) if args.processes is None else args.processes
        print(format_plan(make_plan(config, processes, args.gpu, args.mfu, link_gbps=args.link_gbps)))
    except UsageError as e:  # a config, a key, an argument or the environment: the usage error's status
        end_with(e)


if __name__ == "__main__":
    main()
