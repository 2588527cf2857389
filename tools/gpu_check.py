"""
The GPU check: every CUDA path of the repository run and measured by one command, section by
section, each figure printed beside what plan.py predicts for it.

    python -m tools.gpu_check                      # on a GPU: appends each section to results/gpu.md
    python -m tools.gpu_check --smoke              # the same code at tiny sizes on the CPU (< 1 min)
    python -m tools.gpu_check --sections 3,5       # only these sections (a rerun after a fix)

Sections, in order (each one time-boxed; one that fails or runs out of time writes its figures
so far and its one-line error, and the next one runs):

    1 machine       bf16 matmul TFLOP/s (8192^3) against the datasheet dense peak
    2 correctness   every loss of losses.py under bf16 autocast on the device against float64 on
                    the CPU; the model's forward and backward likewise; each kind of block compiled
                    with fullgraph=True (graphs compiled, recompiles counted); fused AdamW against
                    the unfused one on the same gradients; the float16 path skipping an overflowing
                    step; which attention kernel scaled_dot_product_attention runs
    3 350M          config/baseline_350m.py on one device, batch_size='auto', compiled: ms per step,
                    tokens/s, MFU (goal >= 0.45 of 989 TFLOP/s), peak memory against the plan's
    4 loss cost     each loss's step at 350M against the CE step of section 3's model
    5 7B width      config/simreg_7b.py cut to 2 and 4 blocks (batch 8, T 2048, FSDP on one process,
                    weights kept gathered, activation checkpointing, 4 micro-steps): peak memory and
                    ms per micro-step against the plan, extrapolated to 32 blocks; the CUDA
                    cross-entropy's transient against the plan's (which measures the CPU path)
    6 MoE 8x1B      config/baseline_moe_8x1b.py cut to 2 blocks: ms per step, the router's loss, the
                    share of slots dropped
    7 checkpoint    DCP save and load at the 1.3B width (4 blocks): GB/s, and three steps with a
                    save and load after the first equal to three uninterrupted steps
    8 end to end    train.py config/c4_tiny.py for 200 steps, compiled, on data prepared beforehand,
                    then sample.py from its best.pt

On a lent GPU machine (which reaches nothing outside): prepare the data and tiktoken's cache here
first, in a folder .git/info/exclude ignores so that it travels only when carried,

    TIKTOKEN_CACHE_DIR=<tiktoken's cache> python prepare_c4.py --from_text input.txt --out_dir .gpu_data/c4_tiny
    cp -r <tiktoken's cache> .gpu_data/tiktoken

then run, carrying .gpu_data (timeout about 400 s; the check stops itself at --budget seconds):

    TIKTOKEN_CACHE_DIR=.gpu_data/tiktoken PYTHONUNBUFFERED=1 python -m tools.gpu_check \\
        --data_dir .gpu_data/c4_tiny --out $OUT/gpu.md

and copy $OUT/gpu.md to results/gpu.md. tests/test_gpu_check.py runs --smoke, so the code stays
working between GPU windows; --smoke writes nowhere unless --out is given.
"""

import argparse
import datetime
import gc
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

import checkpoint
import losses
import parallelism
import memory
import plan
from configurator import parse_config, train_defaults
from model import GPT, GPTConfig, build_model
from optim import apply_gradients, configure_optimizers
from utils import GPU_PEAK_BF16_FLOPS, autocast_context, measure_matmul_flops, save_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30
MFU_GOAL = 0.45
PLAN_MFU = 0.4  # the plan's assumed MFU for its step times (plan.py's default)

# Sizes: the GPU's (the issue's) and --smoke's (the same code in seconds on 2 CPU cores).
# `shrink` overrides every config's width so that the smoke run's models are tiny.
SIZES = {
    "gpu": {"matmul": 8192, "loss_shape": (4, 256, 256, 2048), "small": {"n_embd": 256, "n_head": 4, "block_size": 256,
                                                                         "ffn_hidden": 512, "vocab_size": 2048},
            "shrink": {}, "warmup": 3, "steps": 10, "loss_steps": 4, "wide_batch": 8, "wide_seq": 2048,
            "wide_micro": 4, "moe_batch": 8, "ckpt_layers": 4, "e2e_iters": 200, "e2e_compile": True, "e2e_args": [],
            "compile_backend": "inductor", "budget": {1: 20, 2: 75, 3: 80, 4: 40, 5: 75, 6: 45, 7: 45, 8: 90}},
    "smoke": {"matmul": 256, "loss_shape": (2, 16, 8, 32), "small": {"n_embd": 32, "n_head": 2, "block_size": 16,
                                                                     "ffn_hidden": 64, "vocab_size": 64},
              "shrink": {"n_embd": 32, "n_head": 2, "ffn_hidden": 64, "block_size": 32, "vocab_size": 128},
              "warmup": 1, "steps": 2, "loss_steps": 1, "wide_batch": 2, "wide_seq": 32, "wide_micro": 2,
              "moe_batch": 2, "ckpt_layers": 2, "e2e_iters": 4, "e2e_compile": False,
              "e2e_args": ["--eval_iters=1", "--final_eval=False", "--batch_size=2", "--n_layer=1", "--n_embd=32",
                           "--n_head=2", "--block_size=32", "--log_interval=1"],
              "compile_backend": "aot_eager", "budget": {n: 600 for n in range(1, 9)}},  # correctness, not speed, here
}


class SectionTimeout(Exception):
    pass


class SectionSkipped(Exception):
    """A section this torch or this run cannot do here (said in one line, not counted as a failure)."""


class Check:
    """What every section shares: the device, the sizes, the report so far and the file it goes to."""

    def __init__(self, device, sizes, out, data_dir, budget):
        self.device, self.sizes, self.out, self.data_dir = device, sizes, out, data_dir
        self.cuda = device.startswith("cuda")
        self.dtype = "bfloat16"  # the GPU runs' autocast (train.py's dtype=auto on a GPU with bf16)
        self.autocast = autocast_context(device, self.dtype)
        self.peak = GPU_PEAK_BF16_FLOPS["H100"] if self.cuda else measure_matmul_flops(device, torch.bfloat16)
        self.deadline = time.monotonic() + budget
        self.text = []
        self.shared = {}  # what a later section reuses (section 3's model for section 4)

    def line(self, text=""):
        print(text, flush=True)
        self.text.append(text)

    def table(self, header, rows):
        self.line("| " + " | ".join(header) + " |")
        self.line("|" + "---|" * len(header))
        for row in rows:
            self.line("| " + " | ".join(str(c) for c in row) + " |")

    def save(self):
        if self.out:
            save_text("\n".join(self.text) + "\n", self.out)

    def synchronize(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_memory(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        """(max allocated, max reserved) GiB since the last reset_memory; NaN off CUDA."""
        if not self.cuda:
            return float("nan"), float("nan")
        return torch.cuda.max_memory_allocated() / GiB, torch.cuda.max_memory_reserved() / GiB

    def config(self, path, **overrides):
        """A config file as train.py reads it, at --smoke's tiny width, with overrides."""
        config = parse_config([os.path.join(REPO, path)], train_defaults())
        return {**config, **self.sizes["shrink"], **overrides}


def timed(check, work):
    """Seconds of work(), the device synchronized before and after."""
    check.synchronize()
    t0 = time.perf_counter()
    result = work()
    check.synchronize()
    return time.perf_counter() - t0, result


def train_step(model, objective, optimizers, scaler, batches, autocast, keep_gathered=False):
    """One optimizer step over the micro-batches [(x, y), ...] as train.py takes it; -> (stepped, terms)."""
    for i, (x, y) in enumerate(batches):
        with parallelism.gradient_sync((model, objective), i == len(batches) - 1, keep_gathered):
            with autocast:
                loss, terms, logits, hidden = losses.objective_step(model, objective, x, y)
            scaler.scale(loss / len(batches)).backward()
            del logits, hidden, loss
    return apply_gradients(optimizers, scaler), terms


def random_batches(config, batch, micro_steps, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    T, V = config["block_size"], config["vocab_size"]
    return [tuple(torch.randint(0, V, (batch, T), generator=generator).to(device) for _ in "xy")
            for _ in range(micro_steps)]


def dynamo_graphs():
    """(graphs compiled, graph breaks) so far in this process (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compile_blocks(check, model):
    parallelism.compile_blocks(model, backend=check.sizes["compile_backend"], fullgraph=True)


def build(check, config, fsdp=False):
    """(model, objective, optimizers, scaler) of a config on the device as train.py builds them
    (activation checkpointing, compile, FSDP on this one process if asked)."""
    torch.manual_seed(config["seed"])
    with torch.device("meta"):
        model, objective = GPT(GPTConfig.from_config(config, config["vocab_size"])), losses.Objective.from_config(config)
    if config["compile"] is True:  # in train.py's order: compile, checkpointing, FSDP
        compile_blocks(check, model)
    if config["activation_checkpointing"]:
        parallelism.apply_activation_checkpointing(model)
    if fsdp:
        if reason := parallelism.fsdp_unavailable(check.device):
            raise SectionSkipped(reason)
        ensure_process_group(check)
    model, objective = parallelism.parallelize(model, objective, "fsdp" if fsdp else "none", check.device,
                                               param_dtype=torch.bfloat16 if fsdp else None,
                                               keep_gathered=config["fsdp_keep_gathered"])
    optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), extra_modules=[objective])
    scaler = torch.amp.GradScaler(torch.device(check.device).type, enabled=False)
    return model, objective, optimizers, scaler


def ensure_process_group(check):
    if not torch.distributed.is_initialized():
        parallelism.init_distributed("cuda" if check.cuda else "cpu")


def step_times(check, step, warmup, steps):
    """(first step's seconds: compilation included, median of the timed ones)."""
    first = timed(check, step)[0]
    for _ in range(warmup - 1):
        timed(check, step)
    return first, statistics.median(timed(check, step)[0] for _ in range(steps))


def plan_gib(config, processes=1):
    """The plan's memory for this process (train.py's memory check), GiB."""
    return memory.process_gib(config, processes, config["vocab_size"])[0]


# 1 -------------------------------------------------------------------------------------------

def machine(check):
    n = check.sizes["matmul"]
    flops = measure_matmul_flops(check.device, torch.bfloat16, n=n, repeats=10)
    check.table(["bf16 matmul", "TFLOP/s", "datasheet dense peak", "share"],
                [(f"{n}^3", f"{flops / 1e12:.0f}", f"{check.peak / 1e12:.0f}", f"{flops / check.peak:.2f}")])


# 2 -------------------------------------------------------------------------------------------

LOSS_TOLERANCE = 2e-2  # relative, value and gradient, bf16 autocast on the device vs float64 on the CPU


def relative_error(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def loss_cases(B, T, C, V):
    """name -> fn(tensors) -> scalar, on inputs drawn here: every loss of losses.py."""
    cases = {"cross_entropy": lambda t: losses.cross_entropy(t["logits"], t["y"]),
             "cross_entropy, margin 0.6": lambda t: losses.cross_entropy(t["logits"], t["y"], margin=0.6),
             "simreg": lambda t: losses.simreg(t["h_condensed"], t["y_small"]),
             "simreg, chunks of T/4": lambda t: losses.simreg(t["h_condensed"], t["y_small"], chunk_size=T // 4),
             "nitp": lambda t: losses.nitp(t["h"], t["h2"]),
             "cwt": lambda t: losses.cwt(t["h"], t["y"], t["wte"])}
    for variant in losses.DISPERSION_VARIANTS:
        for form in losses.DISPERSION_FORMS:
            cases[f"dispersion {variant}, {form}"] = (
                lambda t, variant=variant, form=form: losses.dispersion([t["h"], t["h2"]], 1.0, variant, form))
    return cases


def loss_inputs(B, T, C, V, device, dtype):
    generator = torch.Generator().manual_seed(0)
    t = {"logits": 3 * torch.randn(B, T, V, generator=generator), "h": torch.randn(B, T, C, generator=generator),
         "h2": torch.randn(B, T, C, generator=generator),
         # condensed states (cosines near 1): SimReg at tau 0.01 is O(1) there, ~1e-34 on random ones
         "h_condensed": torch.randn(B, 1, C, generator=generator) + 0.1 * torch.randn(B, T, C, generator=generator), "wte": torch.randn(V, C, generator=generator) / math.sqrt(C),
         "y": torch.randint(0, V, (B, T), generator=generator),
         "y_small": torch.randint(0, 8, (B, T), generator=generator)}  # repeated labels: SimReg has positives
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)).requires_grad_(v.is_floating_point())
            for k, v in t.items()}


def correctness(check):
    B, T, C, V = check.sizes["loss_shape"]
    rows = []
    for name, fn in loss_cases(B, T, C, V).items():
        reference = loss_inputs(B, T, C, V, "cpu", torch.float64)
        value64 = fn(reference)
        value64.backward()
        device_inputs = loss_inputs(B, T, C, V, check.device, torch.float32)
        with check.autocast:
            value = fn(device_inputs)
        value.backward()
        errors = [relative_error(value, value64)] + [relative_error(device_inputs[k].grad, reference[k].grad)
                                                     for k in reference if reference[k].grad is not None]
        worst = max(errors)
        rows.append((name, f"{value64.item():.6f}", f"{value.item():.6f}", f"{errors[0]:.1e}", f"{max(errors[1:]):.1e}",
                     "ok" if worst <= LOSS_TOLERANCE else "**FAILED**"))
    check.line(f"Each loss on (B, T, C, V) = {(B, T, C, V)}: float32 inputs on {check.device} under bf16 autocast "
               f"against the same inputs in float64 on the CPU; relative error (L2) of the value and of the worst "
               f"input gradient, tolerance {LOSS_TOLERANCE:g}. (T <= {losses.AUTHORS_MAX_POSITIONS}: beyond it the "
               "authors' dispersion draws a random subset of positions, a different one on each device.)\n")
    check.table(["loss", "float64 (CPU)", f"bf16 autocast ({check.device})", "value error", "gradient error", ""], rows)

    # the model's forward and backward (LLaMA and GPT-2 blocks, and the MoE) against float64 on the CPU
    rows = []
    for arch, extra in (("gpt2", {}), ("llama", {}), ("llama", {"n_expert": 4})):
        config = {**check.config("config/c4_tiny.py"), **check.sizes["small"], "arch": arch, "n_layer": 2, **extra,
                  "tie_weights": arch == "gpt2", "compile": False}
        cfg = GPTConfig.from_config(config, config["vocab_size"])
        torch.manual_seed(0)
        reference = build_model(cfg, "cpu").double()
        model = build_model(cfg, "cpu").to(check.device)
        model.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
        x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
        loss64 = losses.cross_entropy(reference(x), x)
        loss64.backward()
        with check.autocast:
            loss = losses.cross_entropy(model(x.to(check.device)), x.to(check.device))
        loss.backward()
        grads = dict(model.named_parameters())
        errors = {n: relative_error(grads[n].grad, p.grad) for n, p in reference.named_parameters()}
        worst = max(errors, key=errors.get)
        whole = relative_error(torch.cat([grads[n].grad.flatten().cpu() for n in errors]),
                               torch.cat([p.grad.flatten() for p in reference.parameters()]))
        name = f"{arch}{' MoE' if extra else ''}"
        rows.append((name, f"{loss64.item():.5f}", f"{loss.item():.5f}", f"{relative_error(loss, loss64):.1e}",
                     f"{whole:.1e}", f"{errors[worst]:.1e} (`{worst}`)",
                     "ok" if max(whole, relative_error(loss, loss64)) <= 5e-2 else "**FAILED**"))
    check.line("\nThe model (2 blocks, width " f"{check.sizes['small']['n_embd']}): CE forward and backward under bf16 "
               "autocast against float64 on the CPU, same weights; tolerance 5e-2 on the loss and on all the "
               "gradients together (a router's gradient alone can move more: bf16 may flip a near-tie top-2 choice).\n")
    check.table(["model", "loss float64", "loss bf16", "loss error", "gradient error", "worst single parameter", ""],
                rows)

    # each kind of block compiled whole: graphs compiled on the first steps, none on later ones
    rows = []
    for arch, extra in (("gpt2", {}), ("llama", {}), ("llama", {"n_expert": 4})):
        config = {**check.config("config/c4_tiny.py"), **check.sizes["small"], "arch": arch, "n_layer": 2, **extra,
                  "tie_weights": arch == "gpt2", "compile": True}
        torch._dynamo.reset()  # as a fresh train.py process: no earlier block's graphs to reuse
        graphs0, breaks0 = dynamo_graphs()
        model, objective, optimizers, scaler = build(check, config)
        batches = random_batches(config, 2, 1, check.device)
        step = lambda: train_step(model, objective, optimizers, scaler, batches, check.autocast)  # noqa: E731
        first, _ = timed(check, step)
        graphs1, breaks1 = dynamo_graphs()
        later = statistics.median(timed(check, step)[0] for _ in range(3))
        graphs2, breaks2 = dynamo_graphs()
        ok = breaks2 == breaks0 and graphs2 == graphs1 and graphs1 > graphs0
        rows.append((f"{arch}{' MoE' if extra else ''}", graphs1 - graphs0, breaks2 - breaks0, graphs2 - graphs1,
                     f"{first:.1f}", f"{1000 * later:.1f}", "ok" if ok else "**FAILED**"))
        model = objective = optimizers = None
    check.line(f"\nEach kind of block compiled with fullgraph=True ({check.sizes['compile_backend']}; "
               "parallelism.compile_blocks): graphs compiled in the first step, graph breaks, graphs compiled "
               "in 3 later steps (a recompile).\n")
    check.table(["block", "graphs", "graph breaks", "recompiles", "first step s", "later step ms", ""], rows)

    # fused AdamW (configure_optimizers') against the unfused one on the same gradients
    torch.manual_seed(0)
    params = [torch.randn(64, 64, device=check.device) for _ in range(3)]
    results = {}
    for fused in (True, False):
        ps = [p.clone().requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        for step in range(3):
            for i, p in enumerate(ps):
                p.grad = torch.sin(params[i] * (step + 1 + i))
            opt.step()
        results[fused] = torch.cat([p.detach().flatten() for p in ps])
    difference = (results[True] - results[False]).abs().max().item()
    moved = (results[False] - torch.cat([p.flatten() for p in params])).abs().max().item()
    check.line(f"\n- fused AdamW against unfused, 3 steps on the same gradients: max |difference| {difference:.1e} "
               f"(the steps moved the weights by up to {moved:.1e}): {'ok' if difference <= 1e-6 else '**FAILED**'}")

    # float16 with loss scaling: an overflowing step is skipped and the scale halves (optim.apply_gradients)
    config = {**check.config("config/c4_tiny.py"), **check.sizes["small"], "n_layer": 1, "compile": False}
    model = build_model(GPTConfig.from_config(config, config["vocab_size"]), check.device)
    optimizers = configure_optimizers(model, 1e-3, 0.1, (0.9, 0.95))
    scaler = torch.amp.GradScaler(torch.device(check.device).type, init_scale=2.0 ** 16)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, config["vocab_size"], (2, 8), device=check.device)
    with torch.autocast(torch.device(check.device).type, dtype=torch.float16):
        loss = losses.cross_entropy(model(x), x) * 1e30  # fp16's largest is 65504: the gradients overflow
    scaler.scale(loss).backward()
    stepped = apply_gradients(optimizers, scaler)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    check.line(f"- float16 + loss scaling, an overflowing step: stepped {stepped}, weights unchanged {unchanged}, "
               f"scale {2.0 ** 16:g} -> {scaler.get_scale():g}: "
               f"{'ok' if not stepped and unchanged and scaler.get_scale() < 2.0 ** 16 else '**FAILED**'}")

    # which kernel scaled_dot_product_attention runs at the 350M shape (LLaMA blocks, causal, bf16)
    check.line(f"- scaled_dot_product_attention, causal, bf16: {attention_kernels(check)}")


def attention_kernels(check):
    """The kernels that one causal attention forward + backward runs (profiler), at the 350M shape."""
    from torch.profiler import ProfilerActivity, profile
    heads, T = (16, 2048) if check.cuda else (2, 32)
    q, k, v = (torch.randn(1, heads, T, 64, device=check.device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    activities = [ProfilerActivity.CUDA] if check.cuda else [ProfilerActivity.CPU]
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    with profile(activities=activities) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        check.synchronize()
    names = [e.key for e in prof.key_averages() if any(w in e.key.lower() for w in ("flash", "fmha", "attention", "cudnn",
                                                                                   "efficient", "attn"))]
    return ", ".join(f"`{n[:90]}`" for n in names[:4]) or "no attention kernel found in the profile"


# 3, 4 ----------------------------------------------------------------------------------------

def model_350m(check):
    """Section 3's config: baseline_350m.py on this one device, batch_size='auto' as train.py resolves it."""
    config = check.config("config/baseline_350m.py", parallel="none", compile=True, dtype=check.dtype)
    if check.cuda:
        config["batch_size"] = memory.device_batch_size(config, 1, config["vocab_size"], check.device)
    else:
        config["global_batch_size"], config["batch_size"] = 2, 2
    return config


def throughput_350m(check):
    config = model_350m(check)
    B, T = config["batch_size"], config["block_size"]
    # the plan counts fp32 activations (an upper bound under bf16), so 'auto' may leave memory unused:
    # twice its batch, measured first in a process state of its own (no graphs shared with the run below)
    doubled = {**config, "batch_size": 2 * B, "global_batch_size": max(config["global_batch_size"], 2 * B)}
    try:
        check.reset_memory()
        model, objective, optimizers, scaler = build(check, doubled)
        batches = random_batches(doubled, 2 * B, 1, check.device)
        _, ms2 = step_times(check, lambda: train_step(model, objective, optimizers, scaler, batches, check.autocast),
                            check.sizes["warmup"], check.sizes["steps"] // 2)
        flops2 = plan.training_flops_per_token(model, objective, 2 * B * T, False) * 2 * B * T
        double_row = (f"{1000 * ms2:.1f} ms, MFU {flops2 / ms2 / check.peak:.3f}, {check.peak_gib()[0]:.1f} GiB "
                      "allocated", f"{plan_gib(doubled):.1f} GiB")
    except torch.OutOfMemoryError:
        double_row = ("out of memory", f"{plan_gib(doubled):.1f} GiB")
    model = objective = optimizers = batches = None
    torch._dynamo.reset()

    check.reset_memory()
    model, objective, optimizers, scaler = build(check, config)
    batches = random_batches(config, B, 1, check.device)
    step = lambda: train_step(model, objective, optimizers, scaler, batches, check.autocast)  # noqa: E731
    first, ms = step_times(check, step, check.sizes["warmup"], check.sizes["steps"])
    allocated, reserved = check.peak_gib()
    flops = plan.training_flops_per_token(model, objective, B * T, False) * B * T
    mfu = flops / ms / check.peak
    planned = plan_gib(config)
    kernels = top_kernels(check, step)
    check.shared["350m"] = (config, model, objective, optimizers, scaler, batches, ms)
    check.line(f"baseline_350m.py, one {check.device}, batch_size='auto' -> {B} x {T} tokens per step, bf16 autocast, "
               f"blocks compiled; {check.sizes['steps']} timed steps after {check.sizes['warmup']}.\n")
    check.table(["figure", "measured", "plan"], [
        ("ms per step", f"{1000 * ms:.1f}", f"{1000 * flops / (PLAN_MFU * check.peak):.1f} (at MFU {PLAN_MFU})"),
        ("tokens/s", f"{B * T / ms:,.0f}", ""),
        (f"MFU of {check.peak / 1e12:.0f} TFLOP/s (goal >= {MFU_GOAL})", f"**{mfu:.3f}**"
         + ("" if mfu >= MFU_GOAL else " (below the goal)"), f"{PLAN_MFU}"),
        ("first step (compilation included), s", f"{first:.1f}", ""),
        ("max_memory_allocated, GiB", f"{allocated:.1f}", f"{planned:.1f} (fp32 activations: an upper bound)"),
        ("max_memory_reserved, GiB", f"{reserved:.1f}", ""),
        (f"twice the batch ({2 * B} x {T})", *double_row)])
    check.line(f"\nWhere the step's device time goes (torch.profiler over 2 steps of {B} x {T}):\n")
    check.table(["kernel", "share of device time", "calls"], kernels)


KERNEL_KINDS = (  # each kernel counts in the first kind whose words its name holds (cuDNN's attention is "wgmma")
    ("attention (SDPA)", ("sdpa", "flash", "fmha", "attention", "dot_do_o", "convert_dq")),
    ("optimizer (fused AdamW)", ("adam",)),
    ("cross-entropy, softmax", ("softmax", "nll_loss", "cross_entropy")),
    ("inductor's fused kernels (Triton)", ("triton",)),
    ("matmuls (cuBLAS / CUTLASS)", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::bmm")))


def top_kernels(check, step, top=8):
    """[(kernel, share of the device time, calls)] of two steps: the top kernels, then each kind's total."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA] if check.cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        check.synchronize()

    def own_time(e):
        if not check.cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    events = [e for e in prof.key_averages() if own_time(e) > 0 and (check.cuda or e.key.startswith("aten::"))]
    total = sum(own_time(e) for e in events) or 1
    events.sort(key=own_time, reverse=True)
    rows = [(f"`{e.key[:80]}`", f"{own_time(e) / total:.3f}", e.count) for e in events[:top]]
    kind_of = {e.key: next((kind for kind, words in KERNEL_KINDS if any(w in e.key.lower() for w in words)), "other")
               for e in events}
    for kind in [k for k, _ in KERNEL_KINDS] + ["other"]:
        share = sum(own_time(e) for e in events if kind_of[e.key] == kind) / total
        rows.append((f"all {kind}", f"{share:.3f}", ""))
    return rows


LOSS_COSTS = {  # name -> config keys on top of the CE baseline (the papers' weights)
    "SimReg": {"simreg_weight": 10.0},
    "SimReg, chunks of 1024": {"simreg_weight": 10.0, "simreg_chunk_size": 1024},
    "dispersion (paper form, all layers, 256 positions)": {"dispersion_weight": 0.1, "dispersion_positions": 256},
    "dispersion (paper form, all layers, all positions)": {"dispersion_weight": 0.1},
    "NITP": {"nitp_weight": 1.0},
    "CWT (headless)": {"ce_weight": 0.0, "cwt_weight": 1.0},
}


def loss_costs(check):
    if "350m" not in check.shared:
        raise RuntimeError("needs section 3's model (run sections 3 and 4 together)")
    config, model, _, optimizers, scaler, batches, base = check.shared.pop("350m")
    del optimizers
    B, T = config["batch_size"], config["block_size"]
    rows = [("CE", f"{1000 * base:.1f}", "1.000", "1.000", "")]
    for name, keys in LOSS_COSTS.items():
        keys = {k: (min(v, T // 2) if k in ("simreg_chunk_size", "dispersion_positions") else v) for k, v in keys.items()}
        objective = losses.Objective.from_config({**config, **keys}).to(check.device)
        objective.init_weights()
        optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), extra_modules=[objective])
        flops = plan.training_flops_per_token(model, objective, B * T, keys.get("cwt_weight", 0) > 0)
        base_flops = plan.training_flops_per_token(model, losses.Objective.from_config(config), B * T, False)
        check.reset_memory()
        try:
            step = lambda: train_step(model, objective, optimizers, scaler, batches, check.autocast)  # noqa: E731
            _, ms = step_times(check, step, 1, check.sizes["loss_steps"])
            rows.append((name, f"{1000 * ms:.1f}", f"{ms / base:.3f}", f"{flops / base_flops:.3f}",
                         f"{check.peak_gib()[0]:.1f}"))
        except torch.OutOfMemoryError:
            rows.append((name, "out of memory", "", f"{flops / base_flops:.3f}", ""))
        objective = optimizers = None
    check.line(f"Each loss's training step on section 3's model and batch ({B} x {T}), against the CE step; the "
               "plan's FLOP ratio counts the matmul FLOPs train.py counts for MFU (not the losses' similarity "
               "products). The papers: SimReg 2.296 against 2.295 s/iter at 7B (SimReg paper, Table 3), NITP "
               "about 2 %.\n")
    check.table(["objective", "ms per step", "ratio to CE", "plan's FLOP ratio", "max allocated GiB"], rows)


# 5 -------------------------------------------------------------------------------------------

def wide_7b(check):
    B, T, micro = check.sizes["wide_batch"], check.sizes["wide_seq"], check.sizes["wide_micro"]
    measured = {}
    for layers in (2, 4):
        config = check.config("config/simreg_7b.py", n_layer=layers, batch_size=B, block_size=T,
                              global_batch_size=B * micro, compile=True, dtype=check.dtype)
        check.reset_memory()
        model, objective, optimizers, scaler = build(check, config, fsdp=True)
        batches = random_batches(config, B, micro, check.device)
        step = lambda: train_step(model, objective, optimizers, scaler, batches, check.autocast,  # noqa: E731
                                  keep_gathered=True)
        first, s = step_times(check, step, 1, 2)
        allocated, reserved = check.peak_gib()
        flops = plan.training_flops_per_token(model, objective, B * T, False) * B * T
        measured[layers] = {"allocated": allocated, "reserved": reserved, "micro_s": s / micro, "first": first,
                            "plan": plan_gib(config), "flops": flops}
        model = objective = optimizers = step = None  # freed before the next depth is built
    two, four = measured[2], measured[4]
    per_block = {k: (four[k] - two[k]) / 2 for k in ("allocated", "plan", "micro_s", "flops")}
    at_32 = {k: two[k] + 30 * per_block[k] for k in per_block}
    p7b = plan.make_plan(check.config("config/simreg_7b.py"), processes=64, gpu="H100")
    mode = "checkpointed"
    check.line(f"simreg_7b.py's width (4096, 32 heads, SwiGLU 11008, V 50304) at 2 and 4 blocks: batch {B} x {T}, "
               f"{micro} micro-steps, bf16, blocks compiled, activation checkpointing, SimReg, FSDP on one process "
               "with the weights kept gathered. Plan: train.py's memory check for the same config on one process.\n")
    rows = []
    for layers, m in measured.items():
        rows.append((f"{layers} blocks", f"{m['allocated']:.2f}", f"{m['reserved']:.2f}", f"{m['plan']:.2f}",
                     f"{1000 * m['micro_s']:.1f}", f"{m['flops'] / m['micro_s'] / check.peak:.3f}", f"{m['first']:.1f}"))
    rows.append(("per block (4 - 2)", f"{per_block['allocated']:.3f}", "", f"{per_block['plan']:.3f}",
                 f"{1000 * per_block['micro_s']:.1f}", "", ""))
    rows.append(("32 blocks, extrapolated", f"{at_32['allocated']:.1f}", "", f"{at_32['plan']:.1f}",
                 f"{1000 * at_32['micro_s']:.0f}", f"{at_32['flops'] / at_32['micro_s'] / check.peak:.3f}", ""))
    check.table(["depth", "max allocated GiB", "max reserved GiB", "plan GiB", "ms per micro-step", "MFU",
                 "first step s"], rows)
    step_s = at_32["micro_s"] * p7b["micro_steps"]  # (the plan's micro-batch is this section's batch on an H100)
    check.line(f"\nThe plan's 7B on 64 H100s: {p7b['memory']['fsdp'][mode]:.1f} GiB per GPU (states sharded 64 ways; "
               f"the extrapolation above holds them whole), compute {p7b['compute_seconds']:.2f} s per step at MFU "
               f"{PLAN_MFU}; at the measured ms per micro-step its {p7b['micro_steps']} micro-steps of "
               f"{p7b['micro_batch']} sequences take {step_s:.2f} s (MFU "
               f"{p7b['flops_per_step'] / 64 / step_s / check.peak:.3f} without communication).")
    cross_entropy_transient(check)


def cross_entropy_transient(check):
    """losses.cross_entropy's forward + backward on (8 x 2048, 50304) bf16 logits: the device's
    peak above the logits themselves, against what the plan counts for it (memory.PeakTensorBytes on
    the meta device, where the CPU path runs)."""
    B, T, V = (check.sizes["wide_batch"], check.sizes["wide_seq"], 50304 if check.cuda else 512)
    check.reset_memory()
    logits = torch.randn(B, T, V, device=check.device, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (B, T), device=check.device)
    base = torch.cuda.memory_allocated() if check.cuda else 0
    losses.cross_entropy(logits, y).backward()
    check.synchronize()
    device_gib = (torch.cuda.max_memory_allocated() - base) / GiB if check.cuda else float("nan")
    del logits
    meta_logits = torch.empty(B, T, V, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with memory.PeakTensorBytes() as counter:
        losses.cross_entropy(meta_logits, torch.zeros(B, T, dtype=torch.long, device="meta")).backward()
    check.line(f"- cross-entropy on {B} x {T} x {V} bf16 logits, forward + backward: {device_gib:.2f} GiB above the "
               f"logits on {check.device}; the plan counts {counter.peak / GiB:.2f} GiB (the CPU path, on meta): "
               f"{device_gib - counter.peak / GiB:+.2f} GiB unplanned")


# 6 -------------------------------------------------------------------------------------------

def moe_8x1b(check):
    B = check.sizes["moe_batch"]
    config = check.config("config/baseline_moe_8x1b.py", n_layer=2, batch_size=B, global_batch_size=B,
                          parallel="none", compile=True, dtype=check.dtype)
    check.reset_memory()
    model, objective, optimizers, scaler = build(check, config)
    batches = random_batches(config, B, 1, check.device)
    terms = {}

    def step():
        terms.update(train_step(model, objective, optimizers, scaler, batches, check.autocast)[1])
    first, s = step_times(check, step, 2, check.sizes["steps"] // 2 or 1)
    flops = plan.training_flops_per_token(model, objective, B * config["block_size"], False) * B * config["block_size"]
    dropped = float(model.dropped_fraction)
    check.line(f"baseline_moe_8x1b.py at 2 blocks (8 experts of 2048 -> 5632, top 2, capacity_factor "
               f"{config['capacity_factor']}: every expert computes every token), batch {B} x {config['block_size']}, "
               "bf16, compiled, activation checkpointing, one process. The dropless grouped-matmul path is not "
               "built yet.\n")
    check.table(["figure", "measured", "plan"], [
        ("ms per step", f"{1000 * s:.1f}", f"{1000 * flops / (PLAN_MFU * check.peak):.1f} (at MFU {PLAN_MFU})"),
        ("MFU (the capacity's padded work counted)", f"{flops / s / check.peak:.3f}", ""),
        ("router load-balancing loss (1 = balanced, 8 = one expert)", f"{float(terms['moe_aux'].detach()):.4f}", ""),
        ("share of routed slots dropped", f"{dropped:.4f}", "0 at capacity N"),
        ("max allocated GiB", f"{check.peak_gib()[0]:.1f}", f"{plan_gib(config):.1f}"),
        ("first step (compilation included), s", f"{first:.1f}", "")])
    if not math.isfinite(float(terms["moe_aux"].detach())):
        raise RuntimeError("the router's loss is not finite")


# 7 -------------------------------------------------------------------------------------------

def checkpoint_dcp(check):
    layers = check.sizes["ckpt_layers"]
    config = check.config("config/baseline_1b3.py", n_layer=layers, batch_size=2, global_batch_size=2, compile=False)
    config["block_size"] = min(512, config["block_size"])
    batches = [random_batches(config, 2, 1, check.device, seed=s) for s in range(3)]

    def fresh():
        return build(check, config, fsdp=True)
    model, objective, optimizers, scaler = fresh()
    for b in batches:
        train_step(model, objective, optimizers, scaler, b, check.autocast)
    uninterrupted = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    del model, objective, optimizers

    model, objective, optimizers, scaler = fresh()
    train_step(model, objective, optimizers, scaler, batches[0], check.autocast)
    modules = torch.nn.ModuleDict({"model": model, "objective": objective})
    with tempfile.TemporaryDirectory() as directory:
        save_s, _ = timed(check, lambda: checkpoint.save_sharded(directory, modules, optimizers))
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        del model, objective, optimizers, modules
        model, objective, optimizers, scaler = fresh()
        modules = torch.nn.ModuleDict({"model": model, "objective": objective})
        load_s, _ = timed(check, lambda: checkpoint.load_sharded(directory, modules, optimizers))
    for b in batches[1:]:
        train_step(model, objective, optimizers, scaler, b, check.autocast)
    resumed = {k: v.full_tensor().detach() for k, v in model.state_dict().items()}
    difference = max((resumed[k].float() - uninterrupted[k].float()).abs().max().item() for k in resumed)
    identical = all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    check.line(f"baseline_1b3.py's width (2048) at {layers} blocks, FSDP on one process: model and AdamW states "
               f"through torch.distributed.checkpoint (checkpoint.save_sharded / load_sharded) on local disk.\n")
    check.table(["figure", "measured"], [
        ("checkpoint size, GB", f"{size / 1e9:.2f}"), ("save, GB/s", f"{size / 1e9 / save_s:.2f}"),
        ("load, GB/s", f"{size / 1e9 / load_s:.2f}"),
        ("3 steps with a save and load after the first vs 3 uninterrupted: max |difference|",
         f"{difference:.1e} ({'bit-identical' if identical else 'NOT bit-identical'})")])
    if difference > 1e-6:
        raise RuntimeError(f"the resumed weights differ from the uninterrupted run's by {difference:.1e}")


# 8 -------------------------------------------------------------------------------------------

def end_to_end(check):
    if not check.data_dir:
        raise RuntimeError("needs --data_dir: a GPT-2 BPE dataset prepared by prepare_c4.py (the docstring says how)")
    iters = check.sizes["e2e_iters"]
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, "train.py", "config/c4_tiny.py", f"--data_dir={check.data_dir}", f"--out_dir={out_dir}",
                   f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--eval_interval={max(iters // 2, 1)}",
                   f"--warmup_iters={min(100, iters // 2)}", f"--compile={check.sizes['e2e_compile']}",
                   f"--device={check.device}", *check.sizes["e2e_args"]]
        seconds, result = timed(check, lambda: subprocess.run(command, cwd=REPO, capture_output=True, text=True))
        if result.returncode != 0:
            raise RuntimeError(f"train.py exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
        import json
        log = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl")) if line.strip()]
        evals = [r for r in log if "val" in r]
        steps = [r for r in log if "ms_per_iter" in r]
        sample = subprocess.run([sys.executable, "sample.py", os.path.join(out_dir, "best.pt"), "--max_new_tokens=40",
                                 "--num_samples=1", f"--device={check.device}"], cwd=REPO, capture_output=True, text=True)
        if sample.returncode != 0:
            raise RuntimeError(f"sample.py exited {sample.returncode}: {sample.stderr.strip().splitlines()[-1:]}")
    text = sample.stdout.strip().split("\n---")[0].replace("\n", " ")[:160]
    check.line(f"`python train.py config/c4_tiny.py --max_iters={iters} --compile={check.sizes['e2e_compile']}` on "
               f"{check.device} with data prepared by prepare_c4.py --from_text (tiny Shakespeare as C4-format "
               "shards), then `sample.py best.pt`.\n")
    check.table(["figure", "measured"], [
        ("wall time of train.py, s (start, compilation, evaluations included)", f"{seconds:.1f}"),
        ("validation loss at step 0 -> last", f"{evals[0]['val']:.3f} -> {evals[-1]['val']:.3f}"),
        ("median ms per step (logged)", f"{statistics.median(r['ms_per_iter'] for r in steps):.1f}"),
        ("sample.py", f"`{text}`")])
    if not evals[-1]["val"] < evals[0]["val"]:
        raise RuntimeError("the validation loss did not fall")


SECTIONS = {1: ("Machine", machine), 2: ("Correctness on the device", correctness),
            3: ("Throughput at 350M", throughput_350m), 4: ("Each loss's cost at 350M", loss_costs),
            5: ("The 7B recipe's width at 2 and 4 blocks", wide_7b), 6: ("MoE 8x1B at 2 blocks", moe_8x1b),
            7: ("Checkpoint (DCP)", checkpoint_dcp), 8: ("End to end", end_to_end)}


def run_section(check, number):
    """One section under its time box; its figures so far and a one-line error if it fails."""
    title, fn = SECTIONS[number]
    left = check.deadline - time.monotonic()
    check.line(f"\n## {number}. {title}\n")
    if left < 5:
        check.line("not run: the check's time budget (--budget) was spent")
        return False
    limit = min(check.sizes["budget"][number], left)
    t0 = time.monotonic()
    ok = True
    if number != 4:  # each section compiles as a fresh train.py process would (section 4 reuses section 3's model)
        torch._dynamo.reset()

    def alarm(signum, frame):
        raise SectionTimeout(f"stopped after its {limit:.0f} s time box")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    start = len(check.text)
    try:
        fn(check)
        failed_checks = sum("**FAILED**" in line for line in check.text[start:])
        if failed_checks:
            ok = False
            check.line(f"\n**FAILED**: {failed_checks} of this section's checks (marked above)")
    except SectionSkipped as e:
        check.line(f"\nskipped: {e}")
    except Exception as e:  # noqa: BLE001 -- the next section must run whatever this one hit
        ok = False
        where = traceback.extract_tb(e.__traceback__)[-1]
        check.line(f"\n**FAILED**: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} "
                   f"({os.path.basename(where.filename)}:{where.lineno})")
        if not isinstance(e, SectionTimeout):
            traceback.print_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    check.line(f"\n_section time: {time.monotonic() - t0:.1f} s_")
    check.reset_memory()
    check.save()
    return ok


def header(check, argv):
    if check.cuda:
        props = torch.cuda.get_device_properties(check.device)
        gpu = f"{props.name}, {props.total_memory / GiB:.1f} GiB, {props.multi_processor_count} SMs"
    else:
        gpu = f"none: --smoke on the CPU ({os.cpu_count()} cores)"
    check.line("# The GPU check (tools/gpu_check.py)\n")
    check.line(f"- device: {gpu}")
    check.line(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}")
    check.line(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    check.line(f"- command: `python -m tools.gpu_check {' '.join(argv)}`".rstrip() + "")
    check.line(f"- MFU is against {check.peak / 1e12:.0f} TFLOP/s (the H100/H200 bf16 dense datasheet peak); the plan's "
               f"times assume MFU {PLAN_MFU}" if check.cuda else "- MFU is against this CPU's measured bf16 matmul")
    check.save()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, nothing written unless --out")
    parser.add_argument("--out", default=None, help="the report (default results/gpu.md; none with --smoke)")
    parser.add_argument("--sections", default="1,2,3,4,5,6,7,8", help="which sections, e.g. 3,4")
    parser.add_argument("--data_dir", default="", help="section 8's dataset (prepare_c4.py; the docstring says how)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole check, each section also "
                                                                    "time-boxed (default 330; --smoke: 3600)")
    parser.add_argument("--device", default="cuda", help="the device (--smoke: cpu)")
    args = parser.parse_args(argv)
    try:
        sections = [int(s) for s in args.sections.split(",")]
        assert sections and all(s in SECTIONS for s in sections)
    except (ValueError, AssertionError):
        parser.error(f"--sections must be numbers from 1 to {len(SECTIONS)} separated by commas, got {args.sections!r}")
    device = "cpu" if args.smoke else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: use --smoke to run the check at tiny sizes on the CPU")
    out = args.out if args.out is not None else (None if args.smoke else os.path.join(REPO, "results", "gpu.md"))
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # as train.py does on CUDA
    budget = args.budget if args.budget is not None else 3600 if args.smoke else 330
    check = Check(device, SIZES["smoke" if args.smoke else "gpu"], out, args.data_dir, budget)
    header(check, argv)
    t0 = time.monotonic()
    failed = [n for n in sections if not run_section(check, n)]
    check.line(f"\nTotal: {time.monotonic() - t0:.0f} s; sections failed: {', '.join(map(str, failed)) or 'none'}")
    check.save()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
