"""
What does each loss cost? Times real training steps (forward, backward, AdamW) with each loss
switched on, as ratios to the cross-entropy step measured in the same process:

    python -m tools.bench                 # every section
    python -m tools.bench --section toy   # toy | 350m | cwt | memory | efficiency | gpu_memory | compile
                                          # | plan_memory | plan_comm | prepare | moe
    python -m tools.bench --steps 5 --out results/bench.md   # every section, written to results/bench.md

  toy     the low-resource toy model (4 x 128, T = 64, batch 12, V = 130)
  350m    the SimReg paper's 350M width cut to fit here: d = 1024, 16 heads, T = 2048, batch 1,
          V = 50304. The CE step is timed with 1 and 2 blocks and extrapolated to the full 24:
          t(24) = t(1) + 23 * (t(2) - t(1)). Each loss term is timed alone (forward, backward and
          AdamW on its own parameters) at the full depth -- dispersion on all 24 block outputs --
          and its share is term / t(24). (Subtracting two whole steps would bury a 0.1 s term in
          the steps' own jitter; the 2-block steps with each loss on are printed as a cross-check.)
  cwt     CWT vs CE at V = 50304 on a small model (4 x 128, T = 64, batch 12)
  memory  peak resident memory of SimReg forward + backward at T = 2048, C = 1024, full vs
          chunk 1024, each in a fresh process (Linux /proc peak RSS)
  efficiency  how close the grids' CE training step (lowres: the char model; bpe: the GPT-2 BPE
          toy) comes to the machine's arithmetic limit: model FLOPs per second (train.py's 6N +
          attention) / the 2048^2 fp32 matmul peak on all cores, for one process on all cores
          and for one 1-thread process per core running side by side (how tools/compare.py runs a grid)
  gpu_memory  tools/memory.py's table for the paper configs (c4_tiny and baseline_*) on 8 GPUs
  compile the lowres CE step with every block compiled (train.py's compile key) vs eager, alternating
  plan_memory  plan.py's memory per process (train.py's memory check) against the measured peak of
          real short runs: c4_tiny, the 350M width at 2 blocks, FSDP on 2 gloo processes
  plan_comm  plan.py's bytes sent per optimizer step and process against every collective's buffer
          in a real step of DDP and FSDP on 2 gloo processes (the 350M width at 2 blocks)
  prepare prepare_c4.py's throughput with 1 and 2 workers on C4-format shards made from tiny
          Shakespeare, against tiktoken's own single-core speed on the same documents, and what
          that predicts for 350 C4 shards on a 32-core node
  moe     one mixture-of-experts layer (half the 8x1B width, 2048 tokens), forward + backward: the
          per-expert loop it had before issue 31 against the static forward at capacity factors
          1, 1.25, 2 and 0 (no drop), in turn, with the share of slots dropped

Step times are medians over `--steps` timed steps after `--warmup` untimed ones. On CPU the
model runs in float32 (see utils.choose_dtype). Results print as a Markdown table.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import parallelism
import memory
import plan
from losses import Objective, cross_entropy, objective_step, simreg
from model import GPT, GPTConfig, MixtureOfExperts, build_model
from optim import configure_optimizers
from utils import (autocast_context, choose_device, choose_dtype, exit_on_bad_arguments, exit_unless_writable,
                   keep_freed_memory, measure_matmul_flops, save_text, seconds)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = [sys.executable, "-m", "tools.bench"]  # a child process of this benchmark


def step_time(model_config, objective_kwargs, batch_size, steps, warmup, device, dtype):
    """Median seconds of one training step with the given objective."""
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


LOSSES = {  # name -> Objective kwargs on top of CE
    "CE": {},
    "CE + SimReg": {"simreg": 1.0},
    "CE + SimReg chunk": {"simreg": 1.0, "simreg_chunk_size": None},  # chunk size set per section
    "CE + dispersion (all layers)": {"dispersion": 0.1},
    "CE + dispersion (all layers, 256 positions)": {"dispersion": 0.1, "dispersion_positions": 256},
    "CE + NITP": {"nitp": 1.0},
}


REPORT = []  # the Markdown of every section run, for --out


def emit(text=""):
    """Print a line of the report and keep it for --out."""
    print(text, flush=True)
    REPORT.append(text)


def table(title, header, rows, intro=None):
    emit(f"\n### {title}\n")
    if intro:
        emit(intro + "\n")
    emit("| " + " | ".join(header) + " |")
    emit("|" + "---|" * len(header))
    for row in rows:
        emit("| " + " | ".join(str(c) for c in row) + " |")


def goal(what, value, limit, unit="", higher_is_better=False):
    """One of the cost goals this repository sets for the losses, judged on the number just measured."""
    met = value >= limit if higher_is_better else value <= limit
    emit(f"- {what} {'≥' if higher_is_better else '≤'} {limit}{unit}: {value:.2f}{unit}, {'met' if met else 'NOT met'}")


def toy(args, device, dtype):
    config = GPTConfig(vocab_size=130, block_size=64, n_layer=4, n_head=4, n_embd=128)
    losses = {k: dict(v) for k, v in LOSSES.items() if "256" not in k}
    losses["CE + SimReg chunk"]["simreg_chunk_size"] = 32
    losses["CWT (headless)"] = {"ce": 0.0, "cwt": 1.0}
    times = {name: step_time(config, kw, 12, args.steps * 4, args.warmup, device, dtype) for name, kw in losses.items()}
    base = times["CE"]
    table("toy model (4 x 128, T 64, batch 12, V 130)", ["objective", "ms / step", "ratio to CE", "extra"],
          [(n, f"{1000 * t:.1f}", f"{t / base:.3f}", f"{100 * (t / base - 1):+.1f} %") for n, t in times.items()],
          intro="Whole training steps (forward, backward, AdamW) with each loss on. At this size every term is "
                "relatively dear because the model is so small; CWT's in-batch similarity matrix (768 x 768) is "
                "bigger than the 130-way head it replaces.")


def loss_time(objective_kwargs, n_layer, C, T, V, reps, device, dtype):
    """Median seconds of one loss term alone, forward + backward (+ AdamW on its own parameters,
    e.g. NITP's head), on hidden states of the real shape: the extra work that term adds to a
    training step. Timing the term by itself is far less noisy than subtracting two ~40 s steps."""
    torch.manual_seed(0)
    objective = Objective(n_layer, C, ce=0.0, **objective_kwargs).to(device)
    objective.init_weights()
    params = list(objective.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1) if params else None
    hidden = [torch.randn(1, T, C, device=device, requires_grad=True) for _ in range(n_layer + 2)]
    targets = torch.randint(0, V, (1, T), device=device)
    wte = torch.randn(V, C, device=device, requires_grad=True)
    autocast = autocast_context(device, dtype)

    def step():
        with autocast:
            loss, _ = objective(None, hidden, targets, {"input": wte, "output": wte})
        loss.backward()
        if optimizer:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    times = []
    for _ in range(1 + reps):
        times.append(seconds(step, device))
        for h in hidden:
            h.grad = None
    return statistics.median(times[1:])


def paper_350m(args, device, dtype):
    """The full-depth step is extrapolated from 1- and 2-block steps, t(24) = t(1) + 23 (t(2) - t(1));
    each loss's extra is timed on its own at the full depth (dispersion: all 24 block outputs) and
    set against t(24). A 2-block step with the loss on is timed too, as a cross-check."""
    C, T, V, L = 1024, 2048, 50304, 24
    losses = {k: dict(v) for k, v in LOSSES.items() if k != "CE"}
    losses["CE + SimReg chunk"]["simreg_chunk_size"] = 1024
    steps = {}
    for n_layer in (1, 2):
        config = GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=16, n_embd=C)
        steps["CE", n_layer] = step_time(config, {}, 1, args.steps, args.warmup, device, dtype)
        print(f"  CE step, {n_layer} block(s): {steps['CE', n_layer]:.2f} s", file=sys.stderr)
    config = GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=16, n_embd=C)
    for name, kw in losses.items():
        steps[name, 2] = step_time(config, kw, 1, args.steps, args.warmup, device, dtype)
        print(f"  {name} step, 2 blocks: {steps[name, 2]:.2f} s", file=sys.stderr)
    per_block = steps["CE", 2] - steps["CE", 1]
    full = steps["CE", 1] + (L - 1) * per_block
    # CE step FLOPs at 2 blocks (6 N per token + attention), for NITP's FLOP prediction at the CE step's rate
    ce_flops = 6 * (2 * 12 * C * C + V * C) * T + 2 * 12 * C * T * T
    rate = ce_flops / steps["CE", 2]
    rows, share = [("CE", f"{steps['CE', 2]:.2f}", "", f"{full:.1f}", "", "")], {}
    for name, kw in losses.items():
        extra = loss_time({k: v for k, v in kw.items()}, L, C, T, V, args.steps * 4, device, dtype)
        print(f"  {name}: the term alone {extra:.3f} s", file=sys.stderr)
        note = ""
        if name == "CE + NITP":
            # SwiGLU head C -> 4C -> C: 3 matrices of 4 C^2, 24 C^2 FLOPs per token forward, x3 with backward
            predicted = 3 * 24 * C * C * T / rate
            note = f"FLOP prediction {predicted:.2f} s at the CE step's {rate / 1e9:.0f} GFLOP/s: measured / predicted = {extra / predicted:.2f}"
            share["NITP / its FLOP prediction"] = extra / predicted
        share[name] = 100 * extra / full
        rows.append((name, f"{steps[name, 2]:.2f}", f"{extra:.3f}", f"{full + extra:.1f}", f"{100 * extra / full:.2f} %", note))
    table(f"350M width (d 1024, T 2048, batch 1, V 50304): CE step at 1 and 2 blocks extrapolated to 24 "
          f"(per block {per_block:.2f} s); each term timed alone at 24 blocks",
          ["objective", "s / step at 2 blocks", "the term alone, s", "s / step at 24 blocks", "extra at 24 blocks", "note"], rows,
          intro="The 2-block column is whole steps with each loss on; differences there are within the steps' own "
                "jitter, which is why each term is also timed alone. 24-block step = 1-block step + 23 x per-block "
                "time; extra = the term alone / that step.")
    emit("\nGoals at 350M width:\n")
    goal("SimReg, share of a full-depth step", share["CE + SimReg"], 1.0, " %")
    goal("SimReg chunk 1024, share", share["CE + SimReg chunk"], 0.6, " %")
    goal("dispersion over all layers with 256 positions each, share", share["CE + dispersion (all layers, 256 positions)"],
         1.0, " %")
    goal("NITP, measured / FLOP prediction", share["NITP / its FLOP prediction"], 1.5, "x")


def cwt_vs_ce(args, device, dtype):
    config = GPTConfig(vocab_size=50304, block_size=64, n_layer=4, n_head=4, n_embd=128)
    ce = step_time(config, {}, 12, args.steps * 2, args.warmup, device, dtype)
    cwt = step_time(config, {"ce": 0.0, "cwt": 1.0}, 12, args.steps * 2, args.warmup, device, dtype)
    table("CWT vs CE at V = 50304 (4 x 128, T 64, batch 12)", ["objective", "ms / step", "speed-up vs CE"],
          [("CE", f"{1000 * ce:.1f}", "1.00x"), ("CWT (headless)", f"{1000 * cwt:.1f}", f"{ce / cwt:.2f}x")])
    emit()
    goal("CWT step, speed-up over CE at V = 50304", ce / cwt, 2.0, "x", higher_is_better=True)


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_child(chunk_size):
    """Run in a fresh process: SimReg forward + backward at T 2048, C 1024; print how far the
    resident set grew above where it stood before (Linux: writing 5 to /proc/self/clear_refs
    resets the peak, VmHWM, so torch's own import peak does not hide the loss's)."""
    h = torch.randn(1, 2048, 1024, requires_grad=True)
    labels = torch.randint(0, 50304, (1, 2048))
    simreg(h[:, :8], labels[:, :8]).backward()  # load the kernels first
    h.grad = None
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    simreg(h, labels, chunk_size=chunk_size or None).backward()
    print(json.dumps({"peak_delta_mib": (_status_kib("VmHWM") - before) / 1024}))


def simreg_memory(args, device, dtype):
    rows = []
    for chunk in (0, 1024, 256):
        out = subprocess.run([*SELF, "--memory_child", str(chunk)], capture_output=True, text=True, check=True,
                             cwd=REPO).stdout
        rows.append(("full" if chunk == 0 else f"chunk {chunk}", f"{json.loads(out)['peak_delta_mib']:.0f}"))
    table("SimReg peak memory, forward + backward, T 2048, C 1024 (growth of the peak resident set)",
          ["SimReg", "peak MiB"], rows)


EFFICIENCY_SETTINGS = {  # name -> (model config, batch size): the CE runs of the comparison grids
    "lowres": (dict(vocab_size=130, block_size=64, n_layer=4, n_head=4, n_embd=128), 12),
    "bpe": (dict(vocab_size=50304, block_size=128, n_layer=4, n_head=4, n_embd=128), 8),
}


def efficiency_child(setting, steps, warmup):
    """In a fresh process (its thread count set by OMP_NUM_THREADS): the median CE step of a grid
    setting and its model FLOPs, as JSON."""
    keep_freed_memory()
    config, batch_size = EFFICIENCY_SETTINGS[setting]
    config = GPTConfig(**config)
    seconds = step_time(config, {}, batch_size, steps, warmup, "cpu", "float32")
    with torch.device("meta"):
        flops = GPT(config).flops_per_token() * batch_size * config.block_size
    print(json.dumps({"seconds": seconds, "flops": flops}))


def efficiency(args, device, dtype):
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    peak = measure_matmul_flops("cpu", torch.float32, repeats=20)  # as tools/runner.py: a best of 3 can read low
    rows = []
    for setting in EFFICIENCY_SETTINGS:
        steps = args.steps * (20 if setting == "lowres" else 4)
        command = [*SELF, "--efficiency_child", setting, "--steps", str(steps), "--warmup", "3"]
        alone = json.loads(subprocess.run(command, capture_output=True, text=True, check=True,
                                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(cores))).stdout)
        children = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
                    for _ in range(cores)]
        side_by_side = [json.loads(child.communicate()[0]) for child in children]
        rate = sum(r["flops"] / r["seconds"] for r in side_by_side)
        rows += [(setting, f"1 process x {cores} threads", f"{1000 * alone['seconds']:.1f}",
                  f"{alone['flops'] / alone['seconds'] / peak:.2f}"),
                 (setting, f"{cores} processes x 1 thread", " / ".join(f"{1000 * r['seconds']:.1f}" for r in side_by_side),
                  f"{rate / peak:.2f}")]
    table(f"CE training step vs the {peak / 1e9:.0f} GFLOP/s fp32 matmul peak of {cores} cores",
          ["grid", "processes", "ms / step", "model FLOP/s / peak"], rows)


def compile_step(args, device, dtype):
    """train.py's compile key: torch.compile of every block (parallelism.compile_blocks) on the
    lowres CE step. An eager and a compiled copy of the same model take training steps in turn,
    so a background load slows both alike; the first steps (compilation) are not timed."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=130, block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False)
    models = {"eager": build_model(config, device), "compiled (inductor)": build_model(config, device)}
    models["compiled (inductor)"].load_state_dict(models["eager"].state_dict())
    parallelism.compile_blocks(models["compiled (inductor)"])
    optimizers = {name: configure_optimizers(m, 1e-3, 0.1, (0.9, 0.99)) for name, m in models.items()}
    x = torch.randint(0, 130, (12, 64), device=device)
    autocast, times = autocast_context(device, dtype), {name: [] for name in models}

    def step(name):
        with autocast:
            loss = cross_entropy(models[name](x), x)
        loss.backward()
        for opt in optimizers[name]:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for i in range(max(args.warmup, 3) + 10 * args.steps):
        for name in models:
            elapsed = seconds(lambda: step(name), device)
            if i >= max(args.warmup, 3):
                times[name].append(elapsed)
    base = statistics.median(times["eager"])
    table(f"toy CE step (4 x 128, T 64, batch 12), eager vs compiled blocks, {torch.get_num_threads()} thread(s)",
          ["model", "median ms", "ratio to eager"],
          [(name, f"{1000 * statistics.median(t):.1f}", f"{statistics.median(t) / base:.2f}") for name, t in times.items()])


def expert_loop(moe, x):
    """MixtureOfExperts.forward before issue 31, for timing: a loop over the experts, each on the
    tokens routed to it (torch.where: a data-dependent shape, a host sync on a GPU), nothing dropped."""
    probs = F.softmax(moe.router(x), dim=-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(moe.gate.size(0)):
        token, slot = torch.where(top_e == e)
        h = F.silu(F.linear(x[token], moe.gate[e])) * F.linear(x[token], moe.up[e])
        out.index_add_(0, token, F.linear(h, moe.down[e]) * top_p[token, slot, None])
    return out


def moe_times(C, H, N, steps, warmup, device, factors=(1.0, 1.25, 2.0, 0.0)):
    """{way: (median seconds of one MoE layer's forward + backward, median share of slots dropped)}
    for the per-expert loop and the static forward at each capacity factor, in turn (a background
    load slows all alike). 8 experts, top-2, weights N(0, 0.01): a near-uniform router."""
    torch.manual_seed(0)
    moe = MixtureOfExperts(GPTConfig(arch="llama", n_embd=C, n_head=1, ffn_hidden=H, n_expert=8, top_k=2)).to(device)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.01)
    x = torch.randn(N, C, device=device)
    ways = {"loop over experts (before)": lambda: expert_loop(moe, x)}
    for factor in factors:
        ways[f"static, capacity_factor {factor}"] = (lambda f: lambda: setattr(moe, "capacity_factor", f) or moe(x))(factor)
    times, dropped = {name: [] for name in ways}, {name: [] for name in ways}
    for i in range(warmup + steps):
        for name, forward in ways.items():
            moe.zero_grad(set_to_none=True)
            elapsed = seconds(lambda: forward().square().mean().backward(), device)
            if i >= warmup:
                times[name].append(elapsed)
                dropped[name].append(moe.dropped_fraction.item() if name.startswith("static") else 0.0)
    return {name: (statistics.median(times[name]), statistics.median(dropped[name])) for name in ways}


def moe(args, device, dtype):
    """One MoE layer at half the 8x1B width (C 1024, H 2816, 8 experts, top-2) on one 2048-token
    sequence, float32: the per-expert loop against the static forward (model.py)."""
    times = moe_times(1024, 2816, 2048, args.steps, args.warmup, device)
    base = times["loop over experts (before)"][0]
    table("one MoE layer, forward + backward (C 1024, H 2816, 8 experts, top-2, 2048 tokens, float32)",
          ["forward", "median ms", "ratio to the loop", "slots dropped"],
          [(name, f"{1000 * t:.0f}", f"{t / base:.2f}", f"{100 * d:.1f} %") for name, (t, d) in times.items()])


PAPER_CONFIGS = ["config/c4_tiny.py", "config/baseline_350m.py", "config/baseline_1b3.py", "config/baseline_3b.py",
                 "config/baseline_7b.py", "config/baseline_moe_8x1b.py"]


def gpu_memory(args, device, dtype):
    """tools/memory.py's table for the paper configs on 8 GPUs, and what it means for the biggest."""
    from tools import memory as gpu
    emit("\n### GPU memory of the paper configs (tools/memory.py, 8 GPUs)\n")
    for line in gpu.table_lines([os.path.join(REPO, p) for p in PAPER_CONFIGS], gpus=8):
        emit(line)
    config = gpu.read_config(os.path.join(REPO, "config/baseline_7b.py"))
    n = plan.make_plan(config, 8, measure=False)["params"]
    emit(f"\nWeights, gradients and AdamW moments are fp32, 16 bytes per parameter: on one GPU the 7B model's "
         f"states alone are {16 * n / memory.GiB:.0f} GiB. With several micro-steps per step FSDP2 also keeps the "
         f"gradients unsharded between them (4 bytes per parameter, {4 * n / memory.GiB:.0f} GiB at 7B), counted in the "
         "table. Activations are per micro-batch, measured in fp32 (bf16 autocast stores most at half size). "
         "`python train.py CONFIG --dry_run=True` prints the whole plan of a run (plan.py).")


# (name, train.py arguments, processes): real runs whose peak memory is set against the plan's figure
PLAN_MEMORY_RUNS = [
    ("c4_tiny", ["config/c4_tiny.py"], 1),
    ("c4_tiny, activation checkpointing", ["config/c4_tiny.py", "--activation_checkpointing=True"], 1),
    ("350M width, 2 blocks", ["config/baseline_350m.py", "--n_layer=2", "--parallel=none", "--global_batch_size=0"], 1),
    ("c4_tiny, DDP on 2 gloo processes", ["config/c4_tiny.py", "--parallel=ddp"], 2),
    ("c4_tiny, FSDP on 2 gloo processes", ["config/c4_tiny.py", "--parallel=fsdp"], 2),
]


def peak_rss_gib(command):
    """Peak resident memory of a command's largest process (the command or any process it waited
    for, e.g. torchrun's workers), GiB; the command must succeed."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {' '.join(command)} failed: {process.stderr.read()[-2000:]}")
    return usage.ru_maxrss * 1024 / memory.GiB  # Linux: KiB


def plan_memory(args, device, dtype):
    """The plan's memory for a process (memory.process_gib: what train.py's memory check uses)
    against the peak resident memory of the same run, --steps training steps with an evaluation
    every 2 and a checkpoint, on this machine, --repeats times: the peak moves from run to run
    (glibc's heap, kept at its peak by utils.keep_freed_memory, fragments differently with the
    address-space layout). The process's own footprint (Python, torch, the data's memmap
    untouched) is measured apart, as the peak of a process that imports what train.py imports,
    and taken off: the plan counts the run's tensors, and on the CPU the heap's allowance
    (memory.CPU_HEAP_ALLOWANCE x the step's transient tensors), which this table calibrates: its
    last column is that fraction as each row's median peak implies it."""
    from configurator import parse_config, train_defaults
    data_dir = os.environ.get("PLAN_MEMORY_DATA", "data/c4_tiny")
    if not os.path.exists(os.path.join(REPO, data_dir, "meta.json")):
        sys.exit(f"error: plan_memory needs C4-format data in {data_dir}: python prepare_c4.py --from_text "
                 f"input.txt --out_dir {data_dir} (or set PLAN_MEMORY_DATA)")
    imports = "import numpy, torch, tqdm, checkpoint, evaluate, metrics, parallelism, plan, prepare_shakespeare, tracking"
    base = peak_rss_gib([sys.executable, "-c", imports])
    short = [f"--max_iters={args.steps}", "--eval_interval=2", "--eval_iters=1", "--log_interval=1",
             "--final_eval=False", f"--data_dir={data_dir}", "--overwrite=True"]
    rows = []
    for name, train_args, processes in PLAN_MEMORY_RUNS:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"] \
            if processes > 1 else [sys.executable]
        out_dir = os.path.join(REPO, "out", "bench_plan_memory")
        peaks = sorted(peak_rss_gib([*launcher, "train.py", *train_args, *short, f"--out_dir={out_dir}"]) - base
                       for _ in range(args.repeats))
        median = statistics.median(peaks)
        config = {**parse_config([*train_args, *short], train_defaults()), "dtype": "float32"}
        vocab = plan.run_vocab(config)
        tensors, states = memory.process_gib(config, processes, vocab)
        heap = memory.cpu_heap_allowance(processes)
        planned = memory.process_gib(config, processes, vocab, heap=heap)[0]
        implied = (median - tensors) / (tensors - states)
        rows.append((name, str(processes), f"{states:.3f}", f"{tensors:.3f}", f"{planned:.3f}",
                     " / ".join(f"{p:.3f}" for p in (peaks[0], median, peaks[-1])),
                     f"{100 * (planned - median) / median:+.0f} %", f"{implied:.2f}"))
    table(f"The plan's memory per process against the measured peak (CPU, float32, {args.steps} steps, "
          f"{args.repeats} runs each)",
          ["run", "processes", "plan: states GiB", "plan: tensors GiB", "plan: with heap GiB",
           "measured peak GiB, min / median / max", "plan error (median)", "heap fraction implied"], rows,
          intro=f"Measured peak: the run's largest process's peak resident set minus {base:.3f} GiB, the peak of a "
                f"process that only imports what train.py imports. Heap: memory.CPU_HEAP_ALLOWANCE = "
                f"{memory.CPU_HEAP_ALLOWANCE}, as fractions of the step's transient tensors.")


# plan_comm: the runs whose collectives are counted, on 2 gloo processes in one process group: the 350M
# width (d = 1024, 16 heads, SwiGLU 2371) cut to 2 blocks with a 4096-token vocabulary, so that the blocks
# and the roots (embedding and head; NITP's head, the objective's own unit) weigh alike, 64-token sequences
COMM_MODEL = ["config/baseline_350m.py", "--n_layer=2", "--vocab_size=4096", "--block_size=64", "--batch_size=1",
              "--nitp_weight=1.0", "--grad_clip_mode=norm"]
# (the FSDP runs differ in micro-steps and in the all-gathers' dtype, and neither product is the other's)
COMM_RUNS = {
    "DDP, 2 micro-steps": ["--parallel=ddp", "--global_batch_size=4", "--dtype=float32"],
    "DDP, 4 micro-steps": ["--parallel=ddp", "--global_batch_size=8", "--dtype=float32"],
    "FSDP, 4 micro-steps, activation checkpointing": ["--parallel=fsdp", "--global_batch_size=8", "--dtype=float32",
                                                      "--activation_checkpointing=True"],
    "FSDP, 2 micro-steps, bf16 all-gathers": ["--parallel=fsdp", "--global_batch_size=4", "--dtype=bfloat16"],
    "FSDP, 4 micro-steps, kept gathered": ["--parallel=fsdp", "--global_batch_size=8", "--dtype=float32",
                                           "--fsdp_keep_gathered=True"],
}


class CollectiveBytes(TorchDispatchMode):
    """Sums, by kind, the buffer of every collective the operations run under it call (c10d's ops,
    which DDP's reducer and FSDP2 call, and the functional ones): the whole tensor gathered
    (all-gather), scattered (reduce-scatter's input) or reduced (all-reduce). Calls of other
    collectives are counted by name. Not seen: what a DTensor runs inside the dispatch of an
    operation on it (under FSDP, clipping's all-reduce of the gradient norm, one scalar)."""

    KINDS = {"gather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
             "all_reduce": "all_reduce"}

    def __init__(self):
        super().__init__()
        self.buffers = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce"), 0)
        self.calls, self.other = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and func._opname != "wait_tensor":
            kind = next((k for name, k in self.KINDS.items() if name in func._opname), None)
            functional = func.namespace == "_c10d_functional"
            if kind is None:
                self.other[str(func)] = self.other.get(str(func), 0) + 1
                return out
            # c10d's in-place ops name the gathered tensor first and the tensor to scatter second
            buffer = {"all_gather": out if functional else args[0],
                      "reduce_scatter": args[0] if functional else args[1], "all_reduce": args[0]}[kind]
            self.buffers[kind] += sum(t.numel() * t.element_size() for t in tree_flatten(buffer)[0]
                                      if isinstance(t, torch.Tensor))
            self.calls[str(func)] = self.calls.get(str(func), 0) + 1
        return out


def comm_child():
    """Under torchrun: one optimizer step of each of COMM_RUNS, counted (CollectiveBytes), as train.py
    steps: gradient sync in the last micro-step only, then its global-norm clipping and AdamW. Rank 0
    prints a JSON line per run: the bytes each process sent by plan.py's ring convention, the calls
    counted, and the calls of other collectives."""
    from configurator import parse_config, train_defaults
    from optim import apply_gradients
    rank, _, world = parallelism.init_distributed("cpu")
    for name, keys in COMM_RUNS.items():
        config = parse_config([*COMM_MODEL, *keys], train_defaults())
        if config["parallel"] == "fsdp" and parallelism.fsdp_unavailable("cpu"):
            if rank == 0:
                print(json.dumps({"run": name, "skipped": parallelism.fsdp_unavailable("cpu")}), flush=True)
            continue
        torch.manual_seed(0)
        model = build_model(GPTConfig.from_config(config, plan.run_vocab(config)))
        objective = Objective.from_config(config)
        objective.init_weights()
        if config["activation_checkpointing"]:
            parallelism.apply_activation_checkpointing(model)
        param_dtype = None if config["dtype"] == "float32" else getattr(torch, config["dtype"])
        keep = config["fsdp_keep_gathered"]
        train_model, train_objective = parallelism.parallelize(model, objective, config["parallel"], "cpu", param_dtype,
                                                               keep_gathered=keep)
        optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), extra_modules=[objective])
        micro_steps = memory.micro_steps_of(config, world)
        x = torch.randint(0, model.config.vocab_size, (config["batch_size"], config["block_size"]))
        with CollectiveBytes() as counter:
            for micro_step in range(micro_steps):
                with parallelism.gradient_sync((train_model, train_objective), micro_step == micro_steps - 1, keep):
                    loss, *_ = objective_step(model, objective, x, x, train_model, train_objective)
                    (loss / micro_steps).backward()
            apply_gradients(optimizers, torch.amp.GradScaler("cpu", enabled=False),
                            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"]))
        share = (world - 1) / world
        sent = {kind: buffer * share * (2 if kind == "all_reduce" else 1) for kind, buffer in counter.buffers.items()}
        if rank == 0:
            print(json.dumps({"run": name, "processes": world, "micro_steps": micro_steps, "sent": sent,
                              "calls": counter.calls, "other": counter.other}), flush=True)
    parallelism.shutdown()


def plan_comm(args, device, dtype):
    """plan.py's bytes per optimizer step and process (plan.communication_bytes) against the bytes every
    collective of a real step moved (comm_child, 2 gloo processes)."""
    from configurator import parse_config, train_defaults
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tools.bench",
               "--comm_child"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed: {result.stderr[-2000:]}")
    rows = []
    for record in (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")):
        if "skipped" in record:
            rows.append((record["run"], "skipped: " + record["skipped"], "", "", "", ""))
            continue
        config = parse_config([*COMM_MODEL, *COMM_RUNS[record["run"]]], train_defaults())
        planned = plan.make_plan(config, record["processes"], measure=False)["communication"]
        counted = sum(record["sent"].values())
        rows.append((record["run"], ", ".join(f"{n} {op.split('.')[1]}" for op, n in record["calls"].items()),
                     ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in record["sent"].items() if v),
                     f"{counted / 1e6:,.1f}", f"{planned['total'] / 1e6:,.1f}",
                     f"{100 * (planned['total'] - counted) / counted:+.1f} %"))
    table("The plan's communication per optimizer step and process against the collectives of a real step "
          "(2 gloo processes)", ["run", "calls", "counted MB, by kind", "counted MB", "plan MB", "plan error"], rows,
          intro="MB sent per process (1e6 bytes), ring convention: all-gather and reduce-scatter (N-1)/N of the "
                "whole buffer, all-reduce twice that (plan.py). The 350M width at 2 blocks, vocabulary 4096, "
                "NITP's head, T = 64, batch 1 per process.")


PREPARE_COPIES = 16          # tiny Shakespeare x 16: 4 train shards of ~4 MB of JSON + 1 val shard
PREPARE_DOC_PARAGRAPHS = 12  # speeches per document: ~2 KB, about a C4 document's length
C4_SHARD_TOKENS = 150e6      # GPT-2 tokens in one C4 "en" train shard, roughly (plan.C4_TOKENS_PER_SHARD)
C4_SHARD_GZ_BYTES = 320e6    # the compressed shard a worker waits for: ~305 GB / 1024 shards (allenai/c4 en)


def _child_cpu_seconds():
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # finished children and what they waited for
    return usage.ru_utime + usage.ru_stime


def prepare_throughput(args, device, dtype):
    """prepare_c4.py end to end (the real script in a subprocess: worker start-up, gzip, JSON,
    tokenising, writing, the index) with 1 and 2 workers, alternating with tiktoken on 1 thread
    over the same documents in this process, so a background load slows both alike. Wall time
    and CPU time (the script's processes, getrusage) are both given: the wall-clock share of
    tiktoken x workers needs idle cores; the CPU-time share (the work per token, whatever the
    load) is what a 32-core node with a core per worker gets, and the prediction uses it, with
    the tokens per CPU-second measured here (Shakespeare's text; C4's web text has longer tokens)."""
    import gzip
    import re
    import shutil
    import tempfile

    import tiktoken
    from data import BPE_ENCODING

    text_path = os.environ.get("PREPARE_TEXT", os.path.join(REPO, "data", "shakespeare_char", "input.txt"))
    if not os.path.isfile(text_path):
        sys.exit(f"error: the prepare section needs tiny Shakespeare at {text_path}: python prepare_shakespeare.py "
                 "(or set PREPARE_TEXT to a plain-text file)")
    work = tempfile.mkdtemp(prefix="bench_prepare_")
    try:
        with open(text_path, encoding="utf-8") as f:
            speeches = [s.strip("\n") for s in re.split(r"\n\s*\n", f.read()) if s.strip()] * PREPARE_COPIES
        big = os.path.join(work, "input.txt")  # documents of 12 speeches, as --from_text cuts them
        with open(big, "w", encoding="utf-8") as out:
            out.write("\n\n".join("\n".join(speeches[i:i + PREPARE_DOC_PARAGRAPHS])
                                  for i in range(0, len(speeches), PREPARE_DOC_PARAGRAPHS)) + "\n")
        out_dir = os.path.join(work, "c4")
        # PREPARE_SCRIPT: another version of the script to time the same way (e.g. an older commit's)
        script = os.environ.get("PREPARE_SCRIPT", os.path.join(REPO, "prepare_c4.py"))
        command = [sys.executable, script, "--from_text", big, "--shards", "4", "--out_dir", out_dir]
        env = {**os.environ, "PYTHONPATH": REPO}
        subprocess.run(command + ["--workers", "1"], check=True, capture_output=True, env=env)  # makes the shards
        docs, json_bytes = [], 0
        for name in sorted(os.listdir(out_dir)):
            if name.endswith(".json.gz"):
                with gzip.open(os.path.join(out_dir, name), "rb") as f:
                    for line in f:
                        docs.append(json.loads(line)["text"])
                        json_bytes += len(line)
        enc = tiktoken.get_encoding(BPE_ENCODING)
        n_tokens = sum(len(ids) + 1 for ids in enc.encode_ordinary_batch(docs, num_threads=1))  # + EOT each
        runs = {1: [], 2: []}
        tiktoken_runs, loop_runs, parse_runs = [], [], []
        for _ in range(max(args.steps, 1)):
            for workers in runs:
                for old in ("train", "val", "meta.json", "train.bin", "val.bin"):
                    path = os.path.join(out_dir, old)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path) if os.path.exists(path) else None
                t0, c0 = time.perf_counter(), _child_cpu_seconds()
                subprocess.run(command + ["--workers", str(workers)], check=True, capture_output=True, env=env)
                runs[workers].append((time.perf_counter() - t0, _child_cpu_seconds() - c0))
                t0, c0 = time.perf_counter(), time.process_time()
                enc.encode_ordinary_batch(docs, num_threads=1)
                tiktoken_runs.append((time.perf_counter() - t0, time.process_time() - c0))
            t0, c0 = time.perf_counter(), time.process_time()
            for doc in docs:
                enc.encode_ordinary(doc)
            loop_runs.append((time.perf_counter() - t0, time.process_time() - c0))
            t0, c0 = time.perf_counter(), time.process_time()  # what the main process did twice per shard before
            for name in sorted(os.listdir(out_dir)):
                if name.endswith(".json.gz"):
                    with gzip.open(os.path.join(out_dir, name), "rb") as f:
                        for line in f:
                            json.loads(line)
            parse_runs.append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall, cpu = (statistics.median(r[i] for r in tiktoken_runs) for i in (0, 1))
    rows = [("tiktoken encode_ordinary_batch, 1 thread", "-", f"{wall:.1f}", f"{json_bytes / 1e6 / wall:.1f}",
             f"{n_tokens / wall / 1e6:.2f}", "1.00", f"{cpu:.1f}", "1.00")]
    for what, measured in (("tiktoken encode_ordinary, a loop", loop_runs),
                           ("gzip + JSON of the shards alone (no tokenising)", parse_runs)):
        w, c = (statistics.median(r[i] for r in measured) for i in (0, 1))
        rows.append((what, "-", f"{w:.1f}", f"{json_bytes / 1e6 / w:.1f}", "", f"{wall / w:.2f}", f"{c:.1f}",
                     f"{cpu / c:.2f}"))
    parse_cpu = statistics.median(r[1] for r in parse_runs)
    cpu_share = {}
    for workers, measured in runs.items():
        w, c = (statistics.median(r[i] for r in measured) for i in (0, 1))
        cpu_share[workers] = cpu / c
        rows.append((f"{os.path.basename(script)} --workers {workers}", workers, f"{w:.1f}", f"{json_bytes / 1e6 / w:.1f}",
                     f"{n_tokens / w / 1e6:.2f}", f"{wall / w / workers:.2f}", f"{c:.1f}", f"{cpu / c:.2f}"))
    table(f"prepare_c4.py against tiktoken, {json_bytes / 1e6:.0f} MB of JSON ({n_tokens / 1e6:.1f}M tokens, "
          f"{len(docs):,} documents, 5 shards), {os.cpu_count()} cores",
          ["", "workers", "wall s", "MB/s of JSON", "M tokens/s", "/ (tiktoken x workers)", "CPU s",
           "tiktoken CPU s / CPU s"], rows,
          intro=f"Whole script runs, medians of {max(args.steps, 1)} alternating runs. Wall: the throughput over "
                "tiktoken's single-core speed times the workers (needs that many idle cores). CPU: all the "
                "script's processes (main, workers, their start-up) against tiktoken's CPU time for the same "
                "tokens.")
    per_core = n_tokens / cpu * cpu_share[1]  # tokens per CPU-second of the script's one process
    startup = (statistics.median(r[1] for r in runs[2]) - statistics.median(r[1] for r in runs[1]))
    shard_s = C4_SHARD_TOKENS / per_core
    rounds = math.ceil(350 / 32)
    emit(f"- before issue 31 the main process decompressed and parsed every shard twice (a checking pass, then "
         f"the batches it sent to the pool): it keeps at most tiktoken CPU s / (2 x gzip + JSON CPU s) = "
         f"{cpu / (2 * parse_cpu):.1f} workers busy on this text, whatever the cores (less the pickling of the "
         f"batches); now each worker reads its own shards and the main process only downloads and writes the index.")
    emit(f"- predicted for 350 C4 shards (~{C4_SHARD_TOKENS / 1e6:.0f}M tokens each) with 32 workers: "
         f"{shard_s:.0f} s of tokenising per shard and worker, {rounds} rounds of 32 shards = "
         f"{rounds * shard_s / 60:.0f} min (plus about {startup:.1f} CPU-s to start each worker: the 2-worker run's "
         f"extra CPU time), if the downloads keep up: 32 shards per {shard_s:.0f} s is "
         f"{32 * C4_SHARD_GZ_BYTES / shard_s / 1e6:.0f} MB/s of gzipped shards; below that the download "
         f"(one stream, in the main process) sets the pace: 350 x {C4_SHARD_GZ_BYTES / 1e6:.0f} MB at the link's speed.")


SECTIONS = {"toy": toy, "350m": paper_350m, "cwt": cwt_vs_ce, "memory": simreg_memory, "efficiency": efficiency,
            "gpu_memory": gpu_memory, "compile": compile_step,
            "plan_memory": plan_memory, "plan_comm": plan_comm, "prepare": prepare_throughput, "moe": moe}


def write_report(path, argv):
    """results/bench.md: every table of this call under a header that says how and where it was made."""
    from tools.identity import cpu_name
    header = ["# What each loss costs, and what each paper config needs", "",
              f"Generated by `python -m tools.bench {' '.join(argv)}` on {cpu_name()} ({os.cpu_count()} cores), "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. Step times are medians of timed steps "
              "after untimed warm-up steps, as ratios to the CE step measured in the same process; the goals are "
              "judged on the numbers measured in this call. Rerun it on an otherwise idle machine to regenerate "
              "this file."]
    save_text("\n".join(header + REPORT) + "\n", path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="plan_memory: runs of each row (the peak moves)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="also write the report there (e.g. results/bench.md)")
    parser.add_argument("--memory_child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--efficiency_child", choices=sorted(EFFICIENCY_SETTINGS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--comm_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    exit_on_bad_arguments((args.steps < 1, f"--steps must be >= 1, got {args.steps}"),
                          (args.warmup < 0, f"--warmup must be >= 0, got {args.warmup}"),
                          (args.repeats < 1, f"--repeats must be >= 1, got {args.repeats}"))
    if args.out:
        exit_unless_writable(args.out, "--out")  # before minutes of measuring
    if args.comm_child:
        return comm_child()
    if args.memory_child is not None:
        return memory_child(args.memory_child)
    if args.efficiency_child is not None:
        return efficiency_child(args.efficiency_child, args.steps, args.warmup)
    try:
        device = choose_device(args.device)
    except ValueError as e:
        sys.exit(f"error: {e}")
    dtype = choose_dtype("auto", device)
    print(f"device {device}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.section or list(SECTIONS):
        SECTIONS[name](args, device, dtype)
    if args.out:
        write_report(args.out, sys.argv[1:])
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
