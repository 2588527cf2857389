"""
The GPU check's (tools/gpu_check.py) sections 1 and 3-8, its measurements: each figure printed
beside what plan.py predicts for it.
"""

import math
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils._pytree import tree_flatten, tree_map_only

import checkpoint
import losses
import memory
import plan
from model import GPT
from objective import Objective, Trained
from tools.gpu_steps import (GiB, MFU_GOAL, PLAN_MFU, REPO, build, optimizers_of, random_batches,
                             time_step, train_step)
from utils import measure_matmul_flops, read_log, seconds


def machine(check):
    n = check.sizes["matmul"]
    flops = measure_matmul_flops(check.device, torch.bfloat16, n=n, repeats=10)
    check.table(["bf16 matmul", "TFLOP/s", "datasheet dense peak", "share"],
                [(f"{n}^3", f"{flops / 1e12:.0f}", f"{check.peak / 1e12:.0f}", f"{flops / check.peak:.2f}")])


def plan_gib(config):
    """The plan's memory for one process on a GPU (train.py's memory check), GiB."""
    return memory.process_gib({**config, "device": "cuda"}, 1, config["vocab_size"])[0]


def plan_ms(check, flops):
    return 1000 * flops / (PLAN_MFU * check.peak)


# Issue 62's changes to the 350M step, each switched back in turn to measure its gain on the same
# GPU in the same process: (row, config keys, residual stream in the compute dtype, batch divisor)
BEFORE = {"rope_layout": "interleaved", "ce_chunk_size": 0}
STEP_CHANGES = (
    ("as before (interleaved RoPE in fp32, whole fp32 logits, fp32 residual), half the batch",
     BEFORE, False, 2),
    ("as before, at the batch the bf16 plan picks", BEFORE, False, 1),
    ("+ RoPE in the half-split layout, in bf16", {"ce_chunk_size": 0}, False, 1),
    ("+ LM head and cross-entropy in chunks (ce_chunk_size)", {}, False, 1),
    ("+ residual stream in bf16: the config as it is", {}, True, 1))

LOSS_TOLERANCE = 2e-2  # bf16 autocast: the layouts and precisions round differently, the function is one


def throughput_350m(check):
    """baseline_350m.py, batch_size='auto', then each row of STEP_CHANGES."""
    config = check.config("config/baseline_350m.py", parallel="none", compile=True, dtype=check.dtype)
    if check.cuda:
        config["batch_size"] = memory.device_batch_size(config, 1, config["vocab_size"], check.device)
    else:
        config.update(global_batch_size=2, batch_size=2)
    B, T = config["batch_size"], config["block_size"]
    rows = []
    losses_seen = []
    for name, keys, residual, divisor in STEP_CHANGES:
        b = max(1, B // divisor)
        run = None  # the previous row's model and states go before the next is built
        torch._dynamo.reset()
        GPT.residual_in_compute_dtype = residual
        try:
            run = time_step(check, {**config, **keys, "batch_size": b}, b, 1, check.sizes["warmup"],
                            check.sizes["steps"])
        finally:
            GPT.residual_in_compute_dtype = True
        loss = run.terms[0]["ce"].item()  # the first step's: the same weights on the same batch
        if divisor == 1:
            losses_seen.append(loss)
        rows.append((name, f"{b} x {T}", f"{1000 * run.s:.1f}", f"{b * T / run.s:,.0f}",
                     f"{run.mfu:.3f}", f"{loss:.4f}", f"{run.allocated:.1f}"))
    kernels = top_kernels(check, run.step)  # the config as it is: the last row
    check.shared["350m"] = (config, run)
    check.line(f"baseline_350m.py, one {check.device}, batch_size='auto' -> {B} x {T} tokens per step, bf16 "
               f"autocast, blocks compiled; {check.sizes['steps']} timed steps after "
               f"{check.sizes['warmup']}.\n")
    check.table(["figure", "measured", "plan"], [
        ("ms per step", f"{1000 * run.s:.1f}", f"{plan_ms(check, run.flops):.1f} (at MFU {PLAN_MFU})"),
        ("tokens/s", f"{B * T / run.s:,.0f}", ""),
        (f"MFU of {check.peak / 1e12:.0f} TFLOP/s (goal >= {MFU_GOAL})", f"**{run.mfu:.3f}**"
         + ("" if run.mfu >= MFU_GOAL else " (below the goal)"), f"{PLAN_MFU}"),
        ("first step (compilation included), s", f"{run.first:.1f}", ""),
        ("max_memory_allocated, GiB", f"{run.allocated:.1f}",
         f"{plan_gib(config):.1f} (activations in bf16)"),
        ("max_memory_reserved, GiB", f"{check.peak_gib()[1]:.1f}", "")])
    spread = max(losses_seen) - min(losses_seen)
    check.line(f"\nEach change's gain: the step built and compiled afresh with the changes above it, on the "
               f"same batch of random tokens; the first step's CE is the same weights on the same batch "
               f"(rows at {B} x {T}: spread {spread:.2e}, tolerance {LOSS_TOLERANCE}"
               + ("" if spread <= LOSS_TOLERANCE else ", **FAILED**") + ").\n")
    check.table(["step", "batch", "ms per step", "tokens/s", "MFU", "first step's CE",
                 "max allocated GiB"], rows)
    check.line(f"\nWhere the step's device time goes (torch.profiler over 2 steps of {B} x {T}):\n")
    check.table(["kernel", "share of device time", "calls"], kernels)


# each kernel counts in the first kind whose words its name holds (cuDNN's attention is "wgmma")
KERNEL_KINDS = {
    "attention (SDPA)": ("sdpa", "flash", "fmha", "attention", "dot_do_o", "convert_dq"),
    "optimizer (fused AdamW)": ("adam",),
    "cross-entropy, softmax": ("softmax", "nll_loss", "cross_entropy"),
    "inductor's fused kernels (Triton)": ("triton",),
    "matmuls (cuBLAS / CUTLASS)": ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm",
                                   "aten::bmm")}


def top_kernels(check, step):
    """[(kernel, share of the device time, calls)] of two steps: the top 8 kernels, then each
    kind's total."""
    def two_steps():
        step()
        step()

    def own_time(e):
        return e.self_device_time_total if check.cuda else e.self_cpu_time_total

    def kind_of(e):
        return next((kind for kind, words in KERNEL_KINDS.items()
                     if any(w in e.key.lower() for w in words)), "other")
    events = [e for e in check.profiled(two_steps)
              if own_time(e) > 0 and (check.cuda or e.key.startswith("aten::"))]
    total = sum(own_time(e) for e in events) or 1
    events.sort(key=own_time, reverse=True)
    rows = [(f"`{e.key[:80]}`", f"{own_time(e) / total:.3f}", e.count) for e in events[:8]]
    for kind in [*KERNEL_KINDS, "other"]:
        share = sum(own_time(e) for e in events if kind_of(e) == kind) / total
        rows.append((f"all {kind}", f"{share:.3f}", ""))
    return rows


LOSS_COSTS = {  # name -> config keys on top of the CE baseline (the papers' weights)
    "SimReg": {"simreg_weight": 10.0},
    "SimReg, chunks of 1024": {"simreg_weight": 10.0, "simreg_chunk_size": 1024},
    "dispersion (paper form, all layers, 256 positions)": {"dispersion_weight": 0.1,
                                                           "dispersion_positions": 256},
    "dispersion (paper form, all layers, all positions)": {"dispersion_weight": 0.1},
    "NITP": {"nitp_weight": 1.0},
    "CWT (headless)": {"ce_weight": 0.0, "cwt_weight": 1.0},
}


def loss_costs(check):
    if "350m" not in check.shared:
        raise RuntimeError("needs section 3's model (run sections 3 and 4 together)")
    config, run = check.shared.pop("350m")
    model = run.trained.model
    B, T = config["batch_size"], config["block_size"]
    base_flops = plan.training_flops_per_token(model, run.trained.objective, B * T)
    rows = [("CE", f"{1000 * run.s:.1f}", "1.000", "1.000", "")]
    for name, keys in LOSS_COSTS.items():
        keys = {k: (min(v, T // 2) if k in ("simreg_chunk_size", "dispersion_positions") else v)
                for k, v in keys.items()}
        trained = Trained(model, Objective.from_config({**config, **keys}).to(check.device))
        trained.objective.init_weights()
        optimizers = optimizers_of(trained)
        ratio = f"{plan.training_flops_per_token(model, trained.objective, B * T) / base_flops:.3f}"
        check.reset_memory()
        try:
            _, s = check.step_times(lambda: train_step(check, trained, optimizers, run.batches), 2,
                                    check.sizes["loss_steps"])
            rows.append((name, f"{1000 * s:.1f}", f"{s / run.s:.3f}", ratio,
                         f"{check.peak_gib()[0]:.1f}"))
        except torch.OutOfMemoryError:
            rows.append((name, "out of memory", "", ratio, ""))
        trained = optimizers = None
    check.line(f"Each loss's training step on section 3's model and batch ({B} x {T}), against the CE step; "
               "the plan's FLOP ratio counts the matmul FLOPs train.py counts for MFU (not the losses' "
               "similarity products). The papers: SimReg 2.296 against 2.295 s/iter at 7B (SimReg paper, "
               "Table 3), NITP about 2 %.\n")
    check.table(["objective", "ms per step", "ratio to CE", "plan's FLOP ratio", "max allocated GiB"], rows)


def wide_7b(check):
    B = check.sizes["wide_batch"]
    T = check.sizes["wide_seq"]
    micro = check.sizes["wide_micro"]
    measured = []
    rows = []
    for layers in (2, 4):
        config = check.config("config/simreg_7b.py", n_layer=layers, batch_size=B, block_size=T,
                              global_batch_size=B * micro, compile=True, dtype=check.dtype)
        run = time_step(check, config, B, micro, 1, 2, fsdp=True)
        m = {"allocated": run.allocated, "plan": plan_gib(config), "micro_s": run.s / micro,
             "flops": run.flops}
        measured.append(m)
        rows.append((f"{layers} blocks", f"{m['allocated']:.2f}", f"{run.reserved:.2f}",
                     f"{m['plan']:.2f}", f"{1000 * m['micro_s']:.1f}", f"{run.mfu:.3f}",
                     f"{run.first:.1f}"))
        run = None  # freed before the next depth is built
    two, four = measured
    per_block = {k: (four[k] - two[k]) / 2 for k in two}
    at_32 = {k: two[k] + 30 * per_block[k] for k in two}
    p7b = plan.make_plan(check.config("config/simreg_7b.py"), processes=64, gpu="H100")
    check.line(f"simreg_7b.py's width (4096, 32 heads, SwiGLU 11008, V 50304) at 2 and 4 blocks: batch {B} x "
               f"{T}, {micro} micro-steps, bf16, blocks compiled, activation checkpointing, SimReg, FSDP on "
               "one process with the weights kept gathered. Plan: train.py's memory check for the same "
               "config on one process.\n")
    rows.append(("per block (4 - 2)", f"{per_block['allocated']:.3f}", "", f"{per_block['plan']:.3f}",
                 f"{1000 * per_block['micro_s']:.1f}", "", ""))
    rows.append(("32 blocks, extrapolated", f"{at_32['allocated']:.1f}", "", f"{at_32['plan']:.1f}",
                 f"{1000 * at_32['micro_s']:.0f}", f"{at_32['flops'] / at_32['micro_s'] / check.peak:.3f}",
                 ""))
    check.table(["depth", "max allocated GiB", "max reserved GiB", "plan GiB", "ms per micro-step", "MFU",
                 "first step s"], rows)
    # the measured time per sequence, for the sequences one GPU takes per step in the plan
    step_s = at_32["micro_s"] / B * p7b["micro_steps"] * p7b["micro_batch"]
    check.line(f"\nThe plan's 7B on 64 H100s: {p7b['memory']['fsdp']['checkpointed']:.1f} GiB per GPU "
               f"(states sharded 64 ways; the extrapolation above holds them whole), compute "
               f"{p7b['compute_seconds']:.2f} s per step at MFU {PLAN_MFU}; at the measured time per "
               f"sequence its {p7b['micro_steps']} micro-step(s) of {p7b['micro_batch']} sequences take "
               f"{step_s:.2f} s (MFU {p7b['flops_per_step'] / 64 / step_s / check.peak:.3f} without "
               "communication).")
    cross_entropy_transient(check)


def cross_entropy_transient(check):
    """The LM head and cross-entropy's peak above its inputs at the 7B's width, whole and in
    chunks (losses.linear_cross_entropy): on the device, and as the plan counts it on meta."""
    B, T = check.sizes["wide_batch"], check.sizes["wide_seq"]
    C, V = (4096, 50304) if check.cuda else (64, 512)
    chunk = check.config("config/simreg_7b.py")["ce_chunk_size"]
    ways = {"whole logits": lambda h, w, y: losses.cross_entropy(h @ w.t(), y),
            f"chunks of {chunk}": lambda h, w, y: losses.linear_cross_entropy(h, w, y, chunk_size=chunk)}
    for name, loss in ways.items():
        check.reset_memory()
        h = torch.randn(B, T, C, device=check.device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(V, C, device=check.device, dtype=torch.bfloat16) * 0.02).requires_grad_()
        y = torch.randint(0, V, (B, T), device=check.device)
        base = torch.cuda.memory_allocated() / GiB if check.cuda else 0
        loss(h, w, y).backward()
        device_gib = check.peak_gib()[0] - base
        del h, w
        with memory.PeakTensorBytes() as counter:
            h, w = (torch.empty(*shape, device="meta", dtype=torch.bfloat16, requires_grad=True)
                    for shape in ((B, T, C), (V, C)))
            loss(h, w, torch.zeros(B, T, dtype=torch.long, device="meta")).backward()
        planned = counter.peak / GiB
        check.line(f"- LM head and cross-entropy, {name}, on {B} x {T} bf16 states (C {C}, V {V}), forward + "
                   f"backward: {device_gib:.2f} GiB above the inputs on {check.device}; the plan counts "
                   f"{planned:.2f} GiB (on meta): {device_gib - planned:+.2f} GiB unplanned")


def moe_figures(check, B, routing):
    """One routing at 2 blocks: (ms per step, the plan's, rows of (figure, measured, plan))."""
    torch._dynamo.reset()
    config = check.config("config/baseline_moe_8x1b.py", n_layer=2, batch_size=B, global_batch_size=B,
                          parallel="none", compile=True, dtype=check.dtype, moe_routing=routing,
                          capacity_factor=0.0)
    run = time_step(check, config, B, 1, 2, check.sizes["steps"] // 2 or 1)
    aux = float(run.terms[-1]["moe_aux"])
    if not math.isfinite(aux):
        raise RuntimeError(f"the router's loss is not finite ({routing})")
    ms = 1000 * run.s
    planned = plan_ms(check, run.flops)
    return ms, planned, [
        ("ms per step", f"{ms:.1f}", f"{planned:.1f} (MFU {PLAN_MFU})"),
        ("MFU (the work each path does)", f"{run.mfu:.3f}", ""),
        ("router load-balancing loss (1 = balanced, 8 = one expert)", f"{aux:.4f}", ""),
        ("share of routed slots dropped", f"{float(run.trained.model.dropped_fraction):.4f}", "0"),
        ("max allocated GiB", f"{run.allocated:.1f}", f"{plan_gib(config):.1f}"),
        ("first step (compilation included), s", f"{run.first:.1f}", "")]


def moe_8x1b(check):
    B = check.sizes["moe_batch"]
    T = check.config("config/baseline_moe_8x1b.py")["block_size"]
    d_ms, d_plan, dropless = moe_figures(check, B, "dropless")
    c_ms, c_plan, capacity = moe_figures(check, B, "capacity")
    check.line(f"baseline_moe_8x1b.py at 2 blocks (8 experts of 2048 -> 5632, top 2), batch {B} x "
               f"{T}, bf16, compiled, activation checkpointing, one process. Two routings, "
               "one after the other: the config's 'dropless' (each token through its 2 experts, "
               "torch._grouped_mm where this torch has it) and 'capacity' at capacity_factor 0 (every "
               "expert computes every token, the padded work counted in its plan and MFU).\n")
    check.table(["figure", "dropless", "plan", "capacity N", "plan"],
                [(*d, *c[1:]) for d, c in zip(dropless, capacity)])
    check.line(f"\ndropless / capacity N, ms per step: {d_ms / c_ms:.2f} "
               f"(the plan: {d_plan / c_plan:.2f})")


def whole_copy(state):
    """state (nested dicts, lists, tuples), each tensor gathered whole and copied."""
    from torch.distributed.tensor import DTensor

    def whole(tensor):
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
    return tree_map_only(torch.Tensor, whole, state)


def largest_difference(a, b):
    """max |a - b| over two states' tensors; inf where their structure or other leaves differ."""
    a, a_spec = tree_flatten(a)
    b, b_spec = tree_flatten(b)
    pairs = list(zip(a, b))
    if a_spec != b_spec or any(x != y for x, y in pairs if not isinstance(x, torch.Tensor)):
        return math.inf
    return max(((x.float() - y.float()).abs().max().item() for x, y in pairs
                if isinstance(x, torch.Tensor)), default=0.0)


def checkpoint_dcp(check):
    """Save and load through DCP; what is judged: docs/devices.md, "The GPU check"."""
    layers = check.sizes["ckpt_layers"]
    config = check.config("config/baseline_1b3.py", n_layer=layers, batch_size=2, global_batch_size=2,
                          compile=False)
    config["block_size"] = min(512, config["block_size"])
    batches = [random_batches(config, 2, 1, check.device, seed=s) for s in range(3)]

    def weights_after(trained, optimizers, steps):
        for b in steps:
            train_step(check, trained, optimizers, b)
        return whole_copy(trained.model.state_dict())
    uninterrupted = weights_after(*build(check, config, fsdp=True), batches)
    again = weights_after(*build(check, config, fsdp=True), batches)

    trained, optimizers = build(check, config, fsdp=True)
    train_step(check, trained, optimizers, batches[0])
    written = whole_copy(get_state_dict(trained, optimizers))
    with tempfile.TemporaryDirectory() as directory:
        save_s = seconds(lambda: checkpoint.save_sharded(directory, trained, optimizers),
                         check.device)
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        del trained, optimizers
        trained, optimizers = build(check, config, fsdp=True)
        load_s = seconds(lambda: checkpoint.load_sharded(directory, trained, optimizers),
                         check.device)
    read_back = largest_difference(written, whole_copy(get_state_dict(trained, optimizers)))
    del written
    resumed = weights_after(trained, optimizers, batches[1:])
    noise = largest_difference(again, uninterrupted)
    difference = largest_difference(resumed, uninterrupted)

    def exactly(d):
        return f"{d:.1e}" + (" (bit-identical)" if d == 0 else "")
    check.line(f"baseline_1b3.py's width (2048) at {layers} blocks, FSDP on one process: model and AdamW "
               "states through torch.distributed.checkpoint (checkpoint.save_sharded / load_sharded) on "
               "local disk.\n")
    check.table(["figure", "measured"], [
        ("checkpoint size, GB", f"{size / 1e9:.2f}"), ("save, GB/s", f"{size / 1e9 / save_s:.2f}"),
        ("load, GB/s", f"{size / 1e9 / load_s:.2f}"),
        ("states read back vs written (weights, AdamW moments, step counts): max |difference|",
         exactly(read_back)),
        ("3 steps with a save and load after the first vs 3 uninterrupted: max |difference| of the "
         "weights", exactly(difference)),
        ("two uninterrupted runs of 3 steps: max |difference| of the weights (the device's run-to-run "
         "noise)", exactly(noise))])
    if read_back != 0:
        raise RuntimeError(f"the states read back differ from those written by {read_back:.1e}")


def script(name, *args):
    """The stdout of a repository script run in a fresh process; one line if it fails."""
    result = subprocess.run([sys.executable, name, *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    return result.stdout


def end_to_end(check):
    if not check.data_dir:
        raise RuntimeError("needs --data_dir: a GPT-2 BPE dataset prepared by prepare_c4.py (the docstring "
                           "says how)")
    iters = check.sizes["e2e_iters"]
    with tempfile.TemporaryDirectory() as out_dir:
        wall = seconds(lambda: script(
            "train.py", "config/c4_tiny.py", f"--data_dir={check.data_dir}", f"--out_dir={out_dir}",
            f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--eval_interval={max(iters // 2, 1)}",
            f"--warmup_iters={min(100, iters // 2)}", f"--compile={check.sizes['e2e_compile']}",
            f"--device={check.device}", *check.sizes["e2e_args"]), check.device)
        log = read_log(os.path.join(out_dir, "log.jsonl"))
        evals = [r for r in log if "val" in r]
        ms = statistics.median(r["ms_per_iter"] for r in log if "ms_per_iter" in r)
        sample = script("sample.py", os.path.join(out_dir, "best.pt"), "--max_new_tokens=40",
                        "--num_samples=1", f"--device={check.device}")
    text = sample.strip().split("\n---")[0].replace("\n", " ")[:160]
    check.line(f"`python train.py config/c4_tiny.py --max_iters={iters} "
               f"--compile={check.sizes['e2e_compile']}` on {check.device} with data prepared by "
               "prepare_c4.py --from_text (tiny Shakespeare as C4-format shards), then `sample.py "
               "best.pt`.\n")
    check.table(["figure", "measured"], [
        ("wall time of train.py, s (start, compilation, evaluations included)", f"{wall:.1f}"),
        ("validation loss at step 0 -> last", f"{evals[0]['val']:.3f} -> {evals[-1]['val']:.3f}"),
        ("median ms per step (logged)", f"{ms:.1f}"),
        ("sample.py", f"`{text}`")])
    if not evals[-1]["val"] < evals[0]["val"]:
        raise RuntimeError("the validation loss did not fall")
