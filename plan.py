"""
The plan of a run, before it starts: what train.py would do with a config on a number of
processes, and whether it fits and how long it takes.

    python train.py config/baseline_7b.py --dry_run=True       # the plan for the processes as launched
    python plan.py config/baseline_7b.py --processes 64 --gpu H100 --mfu 0.4 \
        [--link_gbps 400] [--key=value ...]

Nothing is allocated for the run: the model and the objective are built on the meta device, so
a 7B plan takes seconds. The plan holds

    size      parameters (total; active per token for a mixture of experts), the objective's own
    batch     tokens per optimizer step and per run, micro-steps per process (global_batch_size)
    compute   FLOPs per step and per run (the ones train.py counts for MFU: 6 per matmul weight
              and token plus attention; evaluations added), and the time at a stated MFU
    communication  bytes each process sends per optimizer step for DDP or FSDP, their time at the
              link's bandwidth, and the run's time with compute and communication overlapped
    memory    per GPU for DDP and for FSDP, with and without activation checkpointing
    data      the tokens the run reads against the tokens prepared in data_dir (C4: shards): epochs
              (data_order='epoch') or the share never seen (random windows), with a warning when it
              would pass over its data more than once

Memory: memory.py (states from the parameter count, activations measured on the meta device).
train.py compares this plan with the device's memory before it allocates anything
(memory.memory_problem).

Communication (communication_bytes), in the convention of ring collectives and of nccl-tests'
"bus bandwidth": the bytes one process sends in an optimizer step (it receives as many). An
all-gather or a reduce-scatter of a buffer of S bytes (the whole gathered tensor) sends
S (N-1)/N from each of N processes, an all-reduce twice that; the time is bytes / the link's
bandwidth each way per GPU (LINK_GBPS, or --link_gbps).
    ddp    one all-reduce of every fp32 gradient per optimizer step (gradient sync only in the last
           micro-step: parallelism.gradient_sync)
    fsdp   in every micro-step an all-gather of each unit in the dtype it computes in (bf16 on a GPU,
           FSDP's param_dtype; fp32 with dtype=float32): every block twice (forward, and again in
           backward: FSDP2 reshards a block after its forward), the root (embeddings, final norm, LM
           head) and the objective's parameters once (a root stays gathered from forward to
           backward); then one fp32 reduce-scatter of every gradient in the last micro-step (in the
           others set_requires_gradient_sync(False) accumulates whole gradients locally)
Left out: scalars and small vectors (the loss's and the gradient norms' all-reduces, DDP's map of
unused parameters) and evaluations' all-gathers.
tools/bench.py --section plan_comm counts every collective's buffer in a real 2-process step of
each (tests/test_plan.py: within 10 %).
Overlap: a unit's collective runs while another unit computes (FSDP2 gathers block i+1 during block
i; DDP all-reduces a bucket during the backward of the next), except what nothing can hide: FSDP's
all-gathers of the root and the first block at each micro-step's start and their reduce-scatters at
the step's end, DDP's all-reduce of the embeddings' gradient, which backward makes last. A step
takes exposed + max(compute, communication - exposed).
"""

import argparse
import math
import os

from configurator import ConfigError, check_train_config, parse_config, train_defaults
from data import DataError, preparation_command, read_meta
import parallelism
from memory import (AUTO_BATCH_MEMORY, GPU_MEMORY_GIB, fsdp_units, gathered_bytes, memory_by_mode, meta_model,
                    micro_steps_of, resolve_batch_size, shard_group)
from errors import end_with
from utils import GPU_PEAK_BF16_FLOPS

C4_TOKENS_PER_SHARD = 150e6  # GPT-2 BPE tokens in one C4 "en" train shard, roughly (prepare_c4.py)
# The link a process's collectives run over, per GPU, in gigabits per second each way: the datasheet
# figures the plan assumes without --link_gbps (nccl-tests reach 70-90 % of them: pass a measured busbw x 8).
# Up to GPUS_PER_NODE processes share a node and its NVLink (PCIe where there is none); beyond that every
# ring crosses the network, one NIC per GPU as in DGX/HGX nodes.
GPUS_PER_NODE = 8
LINK_GBPS = {  # gpu: (Gb/s within a node, Gb/s between nodes, the link within, the link between)
    "H100": (3600, 400, "NVLink 4, 450 GB/s each way", "InfiniBand NDR"),
    "H200": (3600, 400, "NVLink 4, 450 GB/s each way", "InfiniBand NDR"),
    "H800": (1600, 400, "NVLink, 200 GB/s each way", "InfiniBand NDR"),
    "A100": (2400, 200, "NVLink 3, 300 GB/s each way", "InfiniBand HDR"),
    "A800": (1600, 200, "NVLink, 200 GB/s each way", "InfiniBand HDR"),
    "L40S": (256, 200, "PCIe 4.0 x16, 32 GB/s each way", "200 Gb/s Ethernet"),
    "A10G": (256, 100, "PCIe 4.0 x16, 32 GB/s each way", "100 Gb/s Ethernet"),
    "4090": (256, 100, "PCIe 4.0 x16, 32 GB/s each way", "100 Gb/s Ethernet"),
}


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


def training_flops_per_token(model, objective, micro_batch_tokens, cwt):
    """FLOPs of one training token: the model's 6N + attention (model.flops_per_token), plus the
    objective's trainable head (NITP: 6 per weight) and CWT's in-batch logits, which stand in for
    the LM head (each token against the micro-batch's embeddings: 6 x tokens x C). The other
    losses' similarity products are not counted. train.py uses this for its MFU."""
    head = sum(p.numel() for p in objective.parameters() if p.dim() >= 2)
    contrastive = 6 * micro_batch_tokens * model.config.n_embd if cwt else 0
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


def communication_bytes(model, objective, parallel, processes, micro_steps, param_bytes, keep_gathered=False,
                        group=None):
    """Bytes one process sends in one optimizer step (it receives as many), by collective: the
    buffer of each (the whole tensor gathered, scattered or reduced) x (N-1)/N, x 2 for an
    all-reduce (ring algorithms; the module's docstring). exposed: the part that no compute hides
    (exposed_between: hybrid sharding's, on the link between the groups).
    param_bytes: what FSDP gathers per parameter (gathered_bytes); gradients are reduced in fp32.
    keep_gathered (fsdp_keep_gathered): every unit gathered once per step.
    group (fsdp, hybrid sharding): FSDP's collectives run within groups of this many processes, and
    each process all-reduces its 1/group of the gradients with its twins in the other groups
    (all_reduce, between the groups: a slower link when a group is a node)."""
    group = group or processes
    share = (group - 1) / group
    shards = group if parallel == "fsdp" else 1  # FSDP's buffers: padded where no dimension divides
    blocks, root = fsdp_units(model, shards)
    head = sum(parallelism.padded_numel(p.shape, shards) for p in objective.parameters())  # NITP's head
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "exposed": 0.0,
           "exposed_between": 0.0}
    if parallel == "ddp":
        out["all_reduce"] = 2 * share * 4 * (root + sum(blocks) + head)
        embeddings = sum(m.weight.numel() for m in (model.wte, model.wpe) if m is not None)
        out["exposed"] = 2 * share * 4 * embeddings
    elif parallel == "fsdp":
        # every block twice per micro-step (forward, backward), each root once; kept gathered: once per step
        gathers = 1 if keep_gathered else micro_steps
        out["all_gather"] = (gathers * share * param_bytes
                             * ((1 if keep_gathered else 2) * sum(blocks) + root + head))
        out["reduce_scatter"] = share * 4 * (root + sum(blocks) + head)  # the last micro-step only
        out["exposed"] = share * (root + blocks[0]) * (gathers * param_bytes + 4)
        replicas = processes // group
        if replicas > 1:  # hybrid: the gradient shards averaged across the groups, after the reduce-scatter
            twins = 2 * (replicas - 1) / replicas * 4 / group
            out["all_reduce"] = twins * (root + sum(blocks) + head)
            out["exposed_between"] = twins * (root + blocks[0])
    out["total"] = out["all_gather"] + out["reduce_scatter"] + out["all_reduce"]
    return out


def link_of(gpu, processes, link_gbps=None):
    """(Gb/s each way per GPU, what the link is) for `processes` processes of `gpu` (LINK_GBPS)."""
    if link_gbps:
        return link_gbps, "--link_gbps"
    within, between, inside, outside = LINK_GBPS[gpu]
    return (within, inside) if processes <= GPUS_PER_NODE else (between, f"{outside}, between nodes")


def step_seconds(compute, communication, exposed):
    """Seconds of an optimizer step: the exposed communication, then the rest overlapped with compute."""
    return exposed + max(compute, communication - exposed)


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


def make_plan(config, processes=1, gpu="H100", mfu=0.4, measure=True, link_gbps=None):
    """The plan of `config` (a dict of train.py's keys) on `processes` processes, as a dict.
    link_gbps: the link's Gb/s each way per GPU; None = LINK_GBPS's figure for gpu and processes."""
    if not (isinstance(processes, int) and processes >= 1):
        raise ConfigError(f"processes must be a positive integer, got {processes}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"mfu must be in (0, 1] (a fraction of the GPU's peak), got {mfu}")
    # a plan needs no checkpoint, and it is for GPUs (not the device it is made on)
    problem = check_train_config({**config, "init_from": "scratch", "device": "cuda"}, processes)
    if problem:
        raise ConfigError(problem)
    if gpu not in GPU_PEAK_BF16_FLOPS:
        raise ConfigError(f"unknown gpu {gpu!r}: expected one of {', '.join(GPU_PEAK_BF16_FLOPS)}")
    if link_gbps is not None and not link_gbps > 0:
        raise ConfigError(f"link_gbps must be > 0, got {link_gbps}")
    config = {**config, "device": "cuda"}  # its step measured with the GPU's logits (step_peak_bytes)
    model, objective = meta_model(config, run_vocab(config))
    auto = config["batch_size"] == "auto"
    config, fits = resolve_batch_size(config, processes, run_vocab(config), GPU_MEMORY_GIB[gpu])
    B, T = config["batch_size"], config["block_size"]
    micro_steps = micro_steps_of(config, processes)
    tokens_per_step = micro_steps * B * T * processes
    flops_per_token = training_flops_per_token(model, objective, B * T, config["cwt_weight"] > 0)
    flops_per_step = flops_per_token * tokens_per_step
    evaluations = config["max_iters"] // config["eval_interval"] + 1  # at step 0 and every eval_interval
    flops_per_run = (flops_per_step * config["max_iters"]
                     + evaluations * evaluation_flops(model, config, processes))
    per_gpu, parts = memory_by_mode(model, config, processes, micro_steps, measure)
    link, link_name = link_of(gpu, processes, link_gbps)
    hours = flops_per_run / (mfu * GPU_PEAK_BF16_FLOPS[gpu] * processes) / 3600
    compute_s = flops_per_step / (mfu * GPU_PEAK_BF16_FLOPS[gpu] * processes)

    def communication(micro_steps, processes=processes, keep=config.get("fsdp_keep_gathered", False)):
        """bytes, and seconds at the links' Gb/s: FSDP's within its shard group's link; DDP's, and
        hybrid sharding's all-reduce between the groups, over the link between all the processes"""
        group = shard_group(config, processes) if config["parallel"] == "fsdp" else processes
        moved = communication_bytes(model, objective, config["parallel"], processes, micro_steps,
                                    gathered_bytes(config), keep, group)
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
            "gpu": gpu, "mfu": mfu, "hours": hours, "compute_seconds": compute_s,
            "communication": moved, "link_gbps": link, "link": link_name, "step_seconds": step_s,
            "shard_group": shard_group(config, processes) if config["parallel"] == "fsdp" else processes,
            "group_link": link_of(gpu, shard_group(config, processes), link_gbps),
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
    of_one_gpu = f"{AUTO_BATCH_MEMORY:.0%} of one {p['gpu']}'s {GPU_MEMORY_GIB[p['gpu']]} GiB"
    auto = {"fits": f" (batch_size='auto': the most that fits {of_one_gpu})",
            "nothing fits": f" (batch_size='auto': not even 1 fits {of_one_gpu} on {p['processes']} "
                            "process(es): see memory)",
            False: ""}[p["auto_batch"]]
    lines = [f"params: {p['params']:,}{active}{plus_objective}",
             f"batch: {p['processes']} process(es) x {p['micro_steps']} micro-step(s) x {p['micro_batch']}"
             f"{auto} x {p['seq_len']} = {p['tokens_per_step']:,} tokens/step; {p['steps']:,} steps = "
             f"{p['tokens_per_run']:,} tokens",
             f"compute: {p['flops_per_step']:.3e} FLOPs/step, {p['flops_per_run']:.3e} FLOPs/run "
             f"(evaluations included) = {p['hours']:,.1f} h on {p['processes']} x {p['gpu']} "
             f"at MFU {p['mfu']:.0%}",
             *communication_lines(p), *([p["padding"]] if p["padding"] else []),
             "memory per GPU (GiB; activations in the compute dtype):"]
    chosen = p["parallel"] if p["parallel"] != "none" else "ddp"
    for mode in ("ddp", "fsdp"):
        m = p["memory"][mode]
        def mark(ckpt):
            return " <- this config" if mode == chosen and ckpt == p["activation_checkpointing"] else ""
        lines.append(f"  {mode}: {m['plain']:.1f}{mark(False)}, "
                     f"with activation checkpointing {m['checkpointed']:.1f}{mark(True)}")
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


def communication_lines(p):
    """The plan's communication line, and one warning line when communication takes longer than compute."""
    c, mode, compute = p["communication"], p["parallel"], p["compute_seconds"]
    if c["total"] == 0:
        return [f"communication: none ({'one process' if p['processes'] == 1 else mode})"]
    kinds = ", ".join(f"{kind.replace('_', '-')} {c[kind] / 1e9:,.1f}"
                      for kind in ("all_gather", "reduce_scatter", "all_reduce") if c[kind])
    links = f"at {p['link_gbps']:,g} Gb/s ({p['link']})"
    if p["shard_group"] < p["processes"]:
        gbps, name = p["group_link"]
        mode, links = (f"fsdp sharded in groups of {p['shard_group']}",
                       f"within a group at {gbps:,g} Gb/s ({name}), all-reduce between them {links}")
    lines = [f"communication: {c['total'] / 1e9:,.1f} GB/step sent per process ({mode}: {kinds}) = "
             f"{c['seconds']:.2f} s {links} against {compute:.2f} s of compute; a step "
             f"{p['step_seconds']:.2f} s with overlap: {p['hours_with_communication']:,.1f} h for the run"]
    if c["seconds"] > compute:
        fewer, regathers = p["fewer_micro_steps"], mode == "fsdp" and not p["fsdp_keep_gathered"]
        if fewer:
            fix = (f"{fewer['keys']} ({fewer['micro_steps']} micro-step(s)) would bring it to "
                   f"{fewer['seconds']:.2f} s (check its memory with {fewer['keys']}), "
                   "as would a faster link")
        elif p["fewer_processes"]:
            f = p["fewer_processes"]
            fix = (f"on {f['processes']} processes, one micro-step of {f['keys']} each, compute would hide "
                   f"it (check their memory), as would a faster link")
        else:
            fix = "a larger global_batch_size (more compute per step) or a faster link would fix it"
        if p.get("keep_gathered"):
            k = p["keep_gathered"]
            fix += (f"; or --fsdp_keep_gathered=True: {k['seconds']:.2f} s, the weights gathered once "
                    f"per step, {k['gib']:.1f} GiB per GPU")
        why = " (FSDP gathers the weights twice in every micro-step)" if regathers else ""
        lines.append(f"warning: communication ({c['seconds']:.2f} s/step) exceeds compute "
                     f"({compute:.2f} s/step){why}; {fix}")
    return lines


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
    """train.py --dry_run=True: the plan of this run on these processes (nothing allocated, no data
    read, out_dir untouched), printed by rank 0; a config the plan cannot take is a ConfigError."""
    text = format_plan(make_plan(config, processes))
    if int(os.environ.get("RANK", 0)) == 0:
        print(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--gpu", default="H100",
                        help=f"one of {', '.join(GPU_PEAK_BF16_FLOPS)} (bf16 datasheet peak)")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="the model FLOPs utilisation assumed for the time")
    parser.add_argument("--link_gbps", type=float, default=None,
                        help="Gb/s each way per GPU of the collectives' link "
                             "(default: LINK_GBPS's for --gpu)")
    args, config_args = parser.parse_known_args(argv)
    try:
        config = parse_config(config_args, train_defaults())
        print(format_plan(make_plan(config, args.processes, args.gpu, args.mfu, link_gbps=args.link_gbps)))
    except ConfigError as e:  # a config, a key or an argument: the usage error's status
        end_with(e)


if __name__ == "__main__":
    main()
