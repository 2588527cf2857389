"""
What a data-parallel run sends between its processes in one optimizer step, over which link, and
how long that takes: plan.py's communication line.

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

import parallelism
from memory import fsdp_units
from utils import duration

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


def communication_lines(p):
    """The plan's communication line, and one warning line when communication takes longer than compute."""
    c, mode, compute = p["communication"], p["parallel"], p["compute_seconds"]
    if c["total"] == 0:
        return [f"communication: none ({'one process' if p['processes'] == 1 else mode})"]
    kinds = ", ".join(f"{kind.replace('_', '-')} {c[kind] / 1e9:,.1f}"
                      for kind in ("all_gather", "reduce_scatter", "all_reduce") if c[kind])
    if p["link_gbps"] is None:
        return [f"communication: {c['total'] / 1e9:,.1f} GB/step sent per process ({mode}: {kinds}); "
                f"not timed: no link figure for {p['device']} processes (gloo)"]
    links = f"at {p['link_gbps']:,g} Gb/s ({p['link']})"
    if p["shard_group"] < p["processes"]:
        gbps, name = p["group_link"]
        mode, links = (f"fsdp sharded in groups of {p['shard_group']}",
                       f"within a group at {gbps:,g} Gb/s ({name}), all-reduce between them {links}")
    run = duration(p["hours_with_communication"] * 3600)
    lines = [f"communication: {c['total'] / 1e9:,.1f} GB/step sent per process ({mode}: {kinds}) = "
             f"{c['seconds']:.2f} s {links} against {compute:.2f} s of compute; a step "
             f"{p['step_seconds']:.2f} s with overlap: {run} for the run"]
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
