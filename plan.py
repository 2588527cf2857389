"""
The plan of a run, before it starts: what train.py would do with a
config on a number of processes, whether it fits, and how long it takes.

    python train.py config/baseline_7b.py --dry_run=True
    python plan.py config/baseline_7b.py --processes 64 --gpu H100 \\
        --mfu 0.4 [--link_gbps 400] [--key=value ...]

Nothing is allocated: the model and the objective are built on the meta
device. train.py --dry_run plans for the processes as launched, on the
device the run would use: a CUDA GPU as an H100, a CPU or MPS at this
machine's measured speed and memory. What the lines say: README.md
("Sizes, and the plan of a run").

Design notes and measurements: docs/performance.md.
"""

import argparse
import math
import os

import torch

from configurator import (ConfigError, check_train_config, parse_config,
                          train_defaults, train_rules)
from data import DataError, preparation_command, read_meta
import parallelism
from memory import (AUTO_BATCH_MEMORY, GPU_MEMORY_GIB, compute_dtype,
                    device_memory, memory_by_mode, meta_model,
                    micro_steps_of, resolve_batch_size)
from comms import communication_lines, communication_plan
from errors import UsageError, end_with
from speed import measured_speed
from utils import (GPU_PEAK_BF16_FLOPS, choose_device, choose_dtype,
                   duration, launched)

# GPT-2 BPE tokens in one C4 "en" train shard, roughly (prepare_c4.py)
C4_TOKENS_PER_SHARD = 150e6


def run_vocab(config):
    """The run's vocabulary: vocab_size if set, else the dataset's,
    doubled by the simulated low-resource language. A ConfigError if
    vocab_size is below a prepared dataset's, or if neither is there."""
    vocab_size = config["vocab_size"]
    try:
        base = read_meta(config["data_dir"])["vocab_size"]
    except DataError as e:
        if vocab_size:
            return vocab_size
        raise ConfigError("a plan needs key 'vocab_size' or a dataset "
                          f"in data_dir ({e})") from None
    dataset = 2 * base if config["low_resource"] else base
    if vocab_size and vocab_size < dataset:
        raise ConfigError(f"key 'vocab_size' is {vocab_size} but the "
                          f"dataset in {config['data_dir']} has "
                          f"{dataset} tokens")
    return vocab_size or dataset


def training_flops_per_token(model, objective, micro_batch_tokens):
    """FLOPs of one training token, as train.py counts them for its MFU:
    the model's 6N + attention (model.flops_per_token), the objective's
    trainable head (NITP: 6 per weight) and CWT's in-batch logits, which
    stand in for the LM head (each token against the micro-batch's
    embeddings: 6 x tokens x C). Other similarity products not counted."""
    head = sum(p.numel() for p in objective.parameters() if p.dim() >= 2)
    contrastive = 0
    if objective.weights["cwt"]:
        contrastive = 6 * micro_batch_tokens * model.config.n_embd
    own = model.flops_per_token(with_head=objective.trains_head)
    return own + 6 * head + contrastive


def evaluation_flops(model, config, processes=1):
    """FLOPs of one evaluation over all processes: each runs
    ceil(eval_iters / processes) batches (a short share repeats one),
    each scored in every language with the LM head."""
    languages = 2 if config["low_resource"] else 1
    batches = math.ceil(config["eval_iters"] / processes) * processes
    sequences = batches * languages * config["batch_size"]
    tokens = sequences * config["block_size"]
    return tokens * model.flops_per_token(backward=False)


def data_needed(config, tokens_per_run):
    """What the run reads against what data_dir holds: a dict with the
    passes (None if nothing is prepared) and what the data order makes of
    them: epochs (data_order='epoch'), or the expected share of the
    training split never seen (random windows, with replacement)."""
    data_dir = config["data_dir"]
    out = {"data_dir": data_dir, "tokens": tokens_per_run}
    try:
        meta = read_meta(data_dir)
    except DataError:
        out["prepared"] = None
        out["passes"] = None
        if os.path.basename(os.path.normpath(data_dir)).startswith("c4"):
            shards = tokens_per_run / C4_TOKENS_PER_SHARD
            out["shards_needed"] = math.ceil(shards)
        return out
    n = out["prepared"] = meta.get("n_train", 0)
    out["passes"] = tokens_per_run / n if n else float("inf")
    T = config["block_size"]
    windows = tokens_per_run // T
    if config.get("data_order") == "epoch" and n > T:
        # data.EpochWindows: (n - 1) // T windows per epoch
        out["epochs"] = windows / ((n - 1) // T)
    elif n > T:
        # a token is in a window that starts at most T before it: T + 1
        # of the n - T random starts, so the run's windows all miss it
        # with probability (1 - (T + 1) / (n - T))^windows ~ exp(-passes)
        out["unseen"] = max(0.0, 1 - (T + 1) / (n - T)) ** windows
    if meta.get("train_shards"):
        out["shards"] = len(meta["train_shards"])
        per_shard = n / out["shards"]
        out["shards_needed"] = math.ceil(tokens_per_run / per_shard)
    return out


def device_figures(device, gpu, mfu, dtype, processes):
    """One process's peak FLOP/s, MFU and memory: for 'cuda' `gpu`'s
    datasheet at `mfu`; for a CPU or MPS this machine's, measured now."""
    if device == "cuda":
        return {"gpu": gpu, "peak": GPU_PEAK_BF16_FLOPS[gpu], "mfu": mfu,
                "memory_gib": GPU_MEMORY_GIB[gpu],
                "memory_of": f"one {gpu}'s", "heap": 0.0}
    peak, measured_mfu = measured_speed(device, dtype)
    available, heap, source = device_memory(device, processes)
    return {"gpu": None, "peak": peak, "mfu": measured_mfu,
            "memory_gib": available, "memory_of": f"this {device}'s",
            "memory_source": source, "heap": heap}


def check_plan_arguments(config, processes, gpu, mfu, link_gbps, device):
    """A ConfigError for a plan that cannot be made."""
    if not (isinstance(processes, int) and processes >= 1):
        raise ConfigError(f"processes must be a positive integer, got {processes}")
    if not 0 < mfu <= 1:
        raise ConfigError("mfu must be in (0, 1] (a fraction of the GPU's "
                          f"peak), got {mfu}")
    # a plan needs no checkpoint; a GPU plan is for GPUs, not the device
    # it is made on
    planned = {**config, "init_from": "scratch", "device": device}
    problem = check_train_config(planned, processes)
    if problem:
        raise ConfigError(problem)
    if device == "cuda" and gpu not in GPU_PEAK_BF16_FLOPS:
        raise ConfigError(f"unknown gpu {gpu!r}: expected one of "
                          f"{', '.join(GPU_PEAK_BF16_FLOPS)}")
    if link_gbps is not None and not link_gbps > 0:
        raise ConfigError(f"link_gbps must be > 0, got {link_gbps}")


def make_plan(config, processes=1, gpu="H100", mfu=0.4, measure=True,
              link_gbps=None, device="cuda"):
    """The plan of `config` (train.py's keys) on `processes` processes, as
    a dict. device 'cuda' plans for `gpu` at `mfu`; 'cpu' or 'mps' for
    this machine (device_figures). measure: memory_by_mode's. link_gbps:
    Gb/s each way per GPU; None: comms.LINK_GBPS's for gpu and
    processes."""
    check_plan_arguments(config, processes, gpu, mfu, link_gbps, device)
    # the step measured on the device; off a GPU in the dtype the run
    # would choose there (FSDP gathers float32 weights on a CPU)
    config = {**config, "device": device}
    if device != "cuda":
        config["dtype"] = choose_dtype(config["dtype"], device)
    vocab = run_vocab(config)
    model, objective = meta_model(config, vocab)
    # measured (off a GPU) once the plan is known to take the config
    figures = device_figures(device, gpu, mfu, config["dtype"], processes)
    auto = config["batch_size"] == "auto"
    config, fits = resolve_batch_size(config, processes, vocab,
                                      figures["memory_gib"], figures["heap"])
    B = config["batch_size"]
    T = config["block_size"]
    steps = config["max_iters"]
    fsdp = config["parallel"] == "fsdp"
    micro_steps = micro_steps_of(config, processes)
    tokens_per_step = micro_steps * B * T * processes
    flops_per_token = training_flops_per_token(model, objective, B * T)
    flops_per_step = flops_per_token * tokens_per_step
    # evaluations at step 0 and every eval_interval
    evaluations = steps // config["eval_interval"] + 1
    eval_flops = evaluation_flops(model, config, processes)
    flops_per_run = flops_per_step * steps + evaluations * eval_flops
    per_gpu, parts = memory_by_mode(model, config, processes, micro_steps,
                                    measure)
    # processes on a CPU talk over gloo: no link figure unless given
    timed = device == "cuda" or link_gbps is not None
    speed = figures["mfu"] * figures["peak"] * processes  # all processes
    hours = flops_per_run / speed / 3600
    compute_s = flops_per_step / speed
    # FSDP with the weights kept gathered over the step: its memory per GPU
    kept_gib = None
    if fsdp and not config.get("fsdp_keep_gathered", False):
        kept_config = {**config, "fsdp_keep_gathered": True}
        _, kept_parts = memory_by_mode(model, kept_config, processes,
                                       micro_steps, False)
        ckpt = config["activation_checkpointing"]
        gib = per_gpu["fsdp"]["checkpointed" if ckpt else "plain"]
        kept_gib = gib + (kept_parts["fsdp"] - parts["fsdp"])
    communication = communication_plan(
        model, objective, config, processes, micro_steps, compute_s, gpu,
        link_gbps, timed, kept_gib)
    padding = None
    if fsdp:
        named = [*model.named_parameters(), *objective.named_parameters()]
        padding = parallelism.padding_note(named,
                                           communication["shard_group"])
    step_s = communication["step_seconds"]
    return {
        "params": model.num_params(),
        "active_params": model.num_params(active=True),
        "objective_params": sum(p.numel() for p in objective.parameters()),
        "processes": processes, "micro_batch": B, "seq_len": T,
        "micro_steps": micro_steps,
        "auto_batch": auto and ("fits" if fits else "nothing fits"),
        "tokens_per_step": tokens_per_step,
        "tokens_per_run": tokens_per_step * steps, "steps": steps,
        "flops_per_step": flops_per_step, "flops_per_run": flops_per_run,
        "device": device, "dtype": config["dtype"], **figures,
        "hours": hours, "compute_seconds": compute_s, **communication,
        "hours_with_communication":
            hours + steps * (step_s - compute_s) / 3600,
        "fsdp_keep_gathered": config.get("fsdp_keep_gathered", False),
        "memory": per_gpu, "memory_parts": parts,
        "parallel": config["parallel"],
        "activation_checkpointing": config["activation_checkpointing"],
        "padding": padding,
        "data": data_needed(config, tokens_per_step * steps)}


def format_plan(p):
    """The plan as the lines train.py --dry_run prints."""
    active = ""
    if p["active_params"] != p["params"]:
        active = f" ({p['active_params']:,} active per token)"
    plus_objective = ""
    if p["objective_params"]:
        plus_objective = f" + objective {p['objective_params']:,}"
    source = f" ({p['memory_source']})" if "memory_source" in p else ""
    of_one_gpu = (f"{AUTO_BATCH_MEMORY:.0%} of {p['memory_of']} "
                  f"{p['memory_gib']:.1f} GiB{source}")
    auto = {"fits": f" (batch_size='auto': the most that fits {of_one_gpu})",
            "nothing fits": f" (batch_size='auto': not even 1 fits "
                            f"{of_one_gpu} on {p['processes']} "
                            "process(es): see memory)",
            False: ""}[p["auto_batch"]]
    unit, per_gib = memory_unit(p["memory"])
    lines = [
        f"params: {p['params']:,}{active}{plus_objective}",
        f"batch: {p['processes']} process(es) x {p['micro_steps']} "
        f"micro-step(s) x {p['micro_batch']}{auto} x {p['seq_len']} = "
        f"{p['tokens_per_step']:,} tokens/step; {p['steps']:,} steps = "
        f"{p['tokens_per_run']:,} tokens",
        f"compute: {p['flops_per_step']:.3e} FLOPs/step, "
        f"{p['flops_per_run']:.3e} FLOPs/run (evaluations included) = "
        f"{duration(p['hours'] * 3600)} on {speed_of(p)}",
        *communication_lines(p),
        *([p["padding"]] if p["padding"] else []),
        memory_heading(p, unit)]
    chosen = p["parallel"] if p["parallel"] != "none" else "ddp"

    def mark(mode, checkpointed):
        ours = checkpointed == p["activation_checkpointing"]
        return " <- this config" if mode == chosen and ours else ""
    for mode in ("ddp", "fsdp"):
        m = p["memory"][mode]
        lines.append(f"  {mode}: {m['plain'] * per_gib:.1f}{mark(mode, False)}, "
                     "with activation checkpointing "
                     f"{m['checkpointed'] * per_gib:.1f}{mark(mode, True)}")
    return "\n".join(lines + data_lines(p["data"]))


def data_lines(d):
    """The plan's data line, and a warning when the run passes over
    its data more than once."""
    tokens = f"data: {d['tokens']:,} tokens"
    if d["prepared"] is None:
        if "shards_needed" in d:
            command = preparation_command(d["data_dir"], d["shards_needed"])
            need = f"about {d['shards_needed']} C4 shards: {command}"
        else:
            need = preparation_command(d["data_dir"])
        return [f"{tokens} needed; nothing prepared in {d['data_dir']} ({need})"]
    shards = ""
    if "shards" in d:
        shards = (f" from {d['shards']} shard(s); "
                  f"{d['shards_needed']} needed for one pass")
    held = f"{d['prepared']:,} prepared in {d['data_dir']}{shards}"
    if "epochs" in d:
        line = (f"{tokens} trained = {d['epochs']:.2f} epochs of the "
                f"training split ({held}; data_order='epoch': every "
                "window once per epoch)")
    else:
        unseen = ""
        if "unseen" in d:
            unseen = ("; random windows (data_order='random') leave about "
                      f"{d['unseen']:.1%} of it never seen")
        line = (f"{tokens} trained = {d['passes']:.2f} passes over the "
                f"training split ({held}){unseen}")
    if d["passes"] <= 1:
        return [line]
    return [line, f"warning: the run passes over its data {d['passes']:.1f} times"]


def speed_of(p):
    """What the plan's time assumes: the GPUs at the stated MFU, or the
    speed measured here with the MFU it is of the matmul peak."""
    if p["gpu"]:
        return f"{p['processes']} x {p['gpu']} at MFU {p['mfu']:.0%}"
    return (f"{p['processes']} x {p['device']} at "
            f"{p['mfu'] * p['peak'] / 1e9:,.0f} GFLOP/s each, the toy's CE "
            f"step measured here now (MFU {p['mfu']:.0%} of a {p['dtype']} "
            f"matmul's {p['peak'] / 1e9:,.0f} GFLOP/s, as train.py counts it)")


def memory_unit(table):
    """(unit, figures per GiB) of the memory lines: MiB when a figure is
    under 1 GiB (it would read 0.0 in GiB), else GiB. NaN (not measured)
    does not count."""
    figures = [gib for mode in table.values() for gib in mode.values()
               if not math.isnan(gib)]
    if figures and min(figures) < 1:
        return "MiB", 1024
    return "GiB", 1


def memory_heading(p, unit):
    """The memory table's first line: per GPU, or off a GPU per process,
    whose tensors the figures are (not its libraries, nor glibc's heap)."""
    if p["gpu"]:
        return f"memory per GPU ({unit}; activations in the compute dtype):"
    dtype = compute_dtype({"device": p["device"], "dtype": p["dtype"]})
    activations = str(dtype).removeprefix("torch.")
    whose = "the process" if p["processes"] == 1 else "each process"
    return f"memory of {whose} ({unit}; its tensors, activations in {activations}):"


def print_plan(config, processes):
    """train.py --dry_run=True: rank 0 prints the plan of this run on
    these processes, for the device it would use; no data read, out_dir
    untouched. A config the plan cannot take is a ConfigError."""
    try:
        device = choose_device(config["device"])
    except ValueError as e:
        elsewhere = "to plan it for a GPU elsewhere: python plan.py <config> --gpu H100"
        raise ConfigError(f"{e}; {elsewhere}") from None
    # the run's threads time the toy's step (train.py sets them later)
    if config["num_threads"] > 0:
        torch.set_num_threads(config["num_threads"])
    if device.startswith("cuda"):
        device = "cuda"
    p = make_plan(config, processes, device=device)
    if launched("RANK", 0) == 0:
        print(format_plan(p))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=None,
                        help="default: WORLD_SIZE, else 1")
    parser.add_argument("--gpu", default="H100",
                        help=f"one of {', '.join(GPU_PEAK_BF16_FLOPS)} "
                             "(bf16 datasheet peak)")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="the model FLOPs utilisation assumed for the time")
    parser.add_argument("--link_gbps", type=float, default=None,
                        help="Gb/s each way per GPU of the collectives' "
                             "link (default: LINK_GBPS's for --gpu)")
    args, config_args = parser.parse_known_args(argv)
    try:
        config = parse_config(config_args, train_defaults(), train_rules())
        processes = args.processes
        if processes is None:
            processes = launched("WORLD_SIZE", 1)
        p = make_plan(config, processes, args.gpu, args.mfu,
                      link_gbps=args.link_gbps)
        print(format_plan(p))
    except UsageError as e:
        end_with(e)


if __name__ == "__main__":
    main()
