"""
What a data-parallel run sends between its processes in one optimizer
step, over which link, and how long that takes: plan.py's communication
line. Bytes as ring collectives count them: an all-gather or
reduce-scatter of S bytes sends S (N-1)/N from each of N processes, an
all-reduce twice that. Design notes: docs/parallelism.md.
"""

from memory import fsdp_units, gathered_bytes, held_numel, shard_group
from utils import duration

GPUS_PER_NODE = 8  # processes sharing a node's NVLink (or PCIe)
NVLINK4 = "NVLink 4, 450 GB/s each way"
NVLINK = "NVLink, 200 GB/s each way"
PCIE4 = "PCIe 4.0 x16, 32 GB/s each way"
# datasheet Gb/s each way per GPU, gpu: (within a node, between nodes,
# the link within, the link between)
LINK_GBPS = {
    "H100": (3600, 400, NVLINK4, "InfiniBand NDR"),
    "H200": (3600, 400, NVLINK4, "InfiniBand NDR"),
    "H800": (1600, 400, NVLINK, "InfiniBand NDR"),
    "A100": (2400, 200, "NVLink 3, 300 GB/s each way", "InfiniBand HDR"),
    "A800": (1600, 200, NVLINK, "InfiniBand HDR"),
    "L40S": (256, 200, PCIE4, "200 Gb/s Ethernet"),
    "A10G": (256, 100, PCIE4, "100 Gb/s Ethernet"),
    "4090": (256, 100, PCIE4, "100 Gb/s Ethernet"),
}


def communication_bytes(model, objective, parallel, processes,
                        micro_steps, param_bytes, keep_gathered=False,
                        group=None):
    """Bytes one process sends in one optimizer step, by collective,
    and "exposed": what no compute hides ("exposed_between": on the
    link between hybrid sharding's groups). param_bytes: what FSDP
    gathers per parameter; gradients are reduced in fp32. group: FSDP
    runs within groups of this many processes (hybrid sharding)."""
    group = group or processes
    share = (group - 1) / group
    # FSDP's buffers: padded where no dimension divides
    shards = group if parallel == "fsdp" else 1
    blocks, root = fsdp_units(model, shards)
    head = held_numel(objective.parameters(), shards)
    weights = root + sum(blocks) + head
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0,
           "exposed": 0.0, "exposed_between": 0.0}
    if parallel == "ddp":
        out["all_reduce"] = 2 * share * 4 * weights
        embeddings = sum(m.weight.numel() for m in (model.wte, model.wpe)
                         if m is not None)
        out["exposed"] = 2 * share * 4 * embeddings
    elif parallel == "fsdp":
        # a block gathered in each forward and backward, a root once,
        # in every micro-step; kept gathered: once per step
        gathers = 1 if keep_gathered else micro_steps
        block_gathers = 1 if keep_gathered else 2
        out["all_gather"] = (gathers * share * param_bytes
                             * (block_gathers * sum(blocks) + root + head))
        out["reduce_scatter"] = share * 4 * weights
        out["exposed"] = (share * (root + blocks[0])
                          * (gathers * param_bytes + 4))
        replicas = processes // group
        if replicas > 1:
            twins = 2 * (replicas - 1) / replicas * 4 / group
            out["all_reduce"] = twins * weights
            out["exposed_between"] = twins * (root + blocks[0])
    out["total"] = (out["all_gather"] + out["reduce_scatter"]
                    + out["all_reduce"])
    return out


def communication_plan(model, objective, config, processes, micro_steps,
                       compute_s, gpu, link_gbps, timed, kept_gib=None):
    """The plan's communication keys: a step's bytes by collective,
    their seconds, the step's seconds with compute overlapped, and what
    would let compute hide them: fewer micro-steps, fewer processes, or
    (FSDP; kept_gib: its memory per GPU) the weights kept gathered.
    link_gbps None: the gpu's (link_of); timed False: bytes only."""
    B = config["batch_size"]
    sequences = config["global_batch_size"]

    def communication(micro_steps, n=processes,
                      keep=config.get("fsdp_keep_gathered", False)):
        """Bytes, and seconds at the links' Gb/s: FSDP's within its
        shard group, all-reduces between all the processes."""
        group = shard_group(config, n)
        moved = communication_bytes(model, objective, config["parallel"], n,
                                    micro_steps, gathered_bytes(config),
                                    keep, group)
        if not timed:  # nothing to set against compute
            return {**moved, "seconds": 0.0, "exposed_seconds": 0.0}
        within = link_of(gpu, group, link_gbps)[0] * 1e9 / 8
        between = link_of(gpu, n, link_gbps)[0] * 1e9 / 8
        sharded = moved["all_gather"] + moved["reduce_scatter"]
        exposed = (moved["exposed"] / within
                   + moved["exposed_between"] / between)
        return {**moved,
                "seconds": sharded / within + moved["all_reduce"] / between,
                "exposed_seconds": exposed}

    def batch_keys(k):
        keys = f"--batch_size={B * micro_steps // k}"
        if not sequences:
            keys += f" --gradient_accumulation_steps={k}"
        return keys

    moved = communication(micro_steps)
    # fewer micro-steps (a larger batch_size, the same tokens per step)
    # gather FSDP's units fewer times: the most whose communication the
    # compute would hide
    fewer = next(({"micro_steps": k, "seconds": communication(k)["seconds"],
                   "keys": batch_keys(k)}
                  for k in range(micro_steps - 1, 0, -1)
                  if micro_steps % k == 0
                  and communication(k)["seconds"] <= compute_s), None)
    # failing that, the most processes (fewer than now, one micro-step
    # each) on which the step's compute would hide it
    fewer_processes = next(
        ({"processes": n, "keys": f"--batch_size={sequences // n}"}
         for n in range(processes - 1, 0, -1)
         if sequences and sequences % n == 0
         and communication(1, n)["seconds"] <= compute_s * processes / n),
        None)
    kept = None
    if kept_gib is not None:
        kept = {"seconds": communication(micro_steps, keep=True)["seconds"],
                "gib": kept_gib}
    group = shard_group(config, processes)
    links = (link_of(gpu, processes, link_gbps) if timed
             else (None, None))
    return {"communication": moved, "link_gbps": links[0],
            "link": links[1], "shard_group": group,
            "group_link": link_of(gpu, group, link_gbps) if timed else None,
            "step_seconds": step_seconds(compute_s, moved["seconds"],
                                         moved["exposed_seconds"]),
            "fewer_micro_steps": fewer, "fewer_processes": fewer_processes,
            "keep_gathered": kept}


def link_of(gpu, processes, link_gbps=None):
    """(Gb/s each way per GPU, the link) for `processes` of `gpu`."""
    if link_gbps:
        return link_gbps, "--link_gbps"
    within, between, inside, outside = LINK_GBPS[gpu]
    if processes <= GPUS_PER_NODE:
        return within, inside
    return between, f"{outside}, between nodes"


def step_seconds(compute, communication, exposed):
    """Seconds of a step: the exposed communication, then the rest
    overlapped with compute."""
    return exposed + max(compute, communication - exposed)


def communication_lines(p):
    """The plan's communication line, and a warning when it takes
    longer than compute."""
    c = p["communication"]
    mode = p["parallel"]
    compute = p["compute_seconds"]
    if c["total"] == 0:
        alone = "one process" if p["processes"] == 1 else mode
        return [f"communication: none ({alone})"]
    kinds = ", ".join(f"{kind.replace('_', '-')} {c[kind] / 1e9:,.1f}"
                      for kind in ("all_gather", "reduce_scatter",
                                   "all_reduce")
                      if c[kind])
    def sent(mode):
        return (f"communication: {c['total'] / 1e9:,.1f} GB/step sent "
                f"per process ({mode}: {kinds})")
    if p["link_gbps"] is None:
        return [f"{sent(mode)}; not timed: no link figure for "
                f"{p['device']} processes (gloo)"]
    links = f"at {p['link_gbps']:,g} Gb/s ({p['link']})"
    if p["shard_group"] < p["processes"]:
        gbps, name = p["group_link"]
        mode = f"fsdp sharded in groups of {p['shard_group']}"
        links = (f"within a group at {gbps:,g} Gb/s ({name}), "
                 f"all-reduce between them {links}")
    run = duration(p["hours_with_communication"] * 3600)
    lines = [f"{sent(mode)} = {c['seconds']:.2f} s {links} against "
             f"{compute:.2f} s of compute; a step "
             f"{p['step_seconds']:.2f} s with overlap: {run} for the run"]
    if c["seconds"] <= compute:
        return lines
    if fewer := p["fewer_micro_steps"]:
        fix = (f"{fewer['keys']} ({fewer['micro_steps']} micro-step(s)) "
               f"would bring it to {fewer['seconds']:.2f} s (check its "
               f"memory with {fewer['keys']}), as would a faster link")
    elif f := p["fewer_processes"]:
        fix = (f"on {f['processes']} processes, one micro-step of "
               f"{f['keys']} each, compute would hide it (check their "
               "memory), as would a faster link")
    else:
        fix = ("a larger global_batch_size (more compute per step) or a "
               "faster link would fix it")
    if k := p.get("keep_gathered"):
        fix += (f"; or --fsdp_keep_gathered=True: {k['seconds']:.2f} s, "
                f"the weights gathered once per step, {k['gib']:.1f} GiB "
                "per GPU")
    why = ""
    if mode == "fsdp" and not p["fsdp_keep_gathered"]:
        why = " (FSDP gathers the weights twice in every micro-step)"
    lines.append(f"warning: communication ({c['seconds']:.2f} s/step) "
                 f"exceeds compute ({compute:.2f} s/step){why}; {fix}")
    return lines
