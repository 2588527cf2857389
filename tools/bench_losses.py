"""
tools/bench.py's sections on what a training step costs, and what
every section shares: the report, child processes and timing in turn.
"""

import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import parallelism
from errors import UserError
from losses import cross_entropy, simreg
from model import GPT, GPTConfig, build_model
from objective import Objective
from optim import configure_optimizers
from speed import EFFICIENCY_SETTINGS, step_time
from utils import (autocast_context, keep_freed_memory, markdown_table, measure_matmul_flops,
                   seconds)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = [sys.executable, "-m", "tools.bench"]

LOSSES = {  # name -> Objective's settings on top of CE
    "CE": {},
    "CE + SimReg": {"simreg_weight": 1.0},
    "CE + SimReg chunk": {"simreg_weight": 1.0, "simreg_chunk_size": None},  # set per section
    "CE + dispersion (all layers)": {"dispersion_weight": 0.1},
    "CE + dispersion (all layers, 256 positions)": {"dispersion_weight": 0.1, "dispersion_positions": 256},
    "CE + NITP": {"nitp_weight": 1.0},
}
CWT = {"ce_weight": 0.0, "cwt_weight": 1.0}

REPORT = []  # the Markdown of every section run, for --out


def emit(text=""):
    print(text, flush=True)
    REPORT.append(text)


def table(title, header, rows, intro=None):
    emit(f"\n### {title}\n")
    if intro:
        emit(intro + "\n")
    for line in markdown_table(header, rows):
        emit(line)


def goal(what, value, limit, unit, higher_is_better=False):
    met = value >= limit if higher_is_better else value <= limit
    emit(f"- {what} {'≥' if higher_is_better else '≤'} {limit}{unit}: {value:.2f}{unit}, "
         f"{'met' if met else 'NOT met'}")


def run_child(command, **env):
    """The JSON lines a command prints, run in the repository with `env`
    added to the environment; a failure ends the benchmark."""
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, **env})
    if result.returncode != 0:
        raise UserError(f"{' '.join(command)} failed: {result.stderr[-2000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def alternate(ways, steps, warmup, device):
    """{name: median seconds of a call} of `ways` called in turn (a load
    slows all alike), after `warmup` untimed rounds."""
    times = {name: [] for name in ways}
    for i in range(warmup + steps):
        for name, work in ways.items():
            elapsed = seconds(work, device)
            if i >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def toy(args, device, dtype):
    config = GPTConfig(vocab_size=130, block_size=64, n_layer=4, n_head=4, n_embd=128)
    terms = {k: dict(v) for k, v in LOSSES.items() if "256" not in k}
    terms["CE + SimReg chunk"]["simreg_chunk_size"] = 32
    terms["CWT (headless)"] = CWT
    times = {name: step_time(config, kw, 12, args.steps * 4, args.warmup, device, dtype)
             for name, kw in terms.items()}
    base = times["CE"]
    table("toy model (4 x 128, T 64, batch 12, V 130)", ["objective", "ms / step", "ratio to CE", "extra"],
          [(n, f"{1000 * t:.1f}", f"{t / base:.3f}", f"{100 * (t / base - 1):+.1f} %")
           for n, t in times.items()],
          intro="Whole training steps (forward, backward, AdamW) with each loss on. At this size every term "
                "is relatively dear because the model is so small; CWT's in-batch similarity matrix (768 x "
                "768) is bigger than the 130-way head it replaces.")


def loss_time(objective_kwargs, n_layer, C, T, V, reps, device, dtype):
    """Median seconds of one loss term alone, forward + backward (+ AdamW on its own parameters),
    on hidden states of the real shape."""
    torch.manual_seed(0)
    objective = Objective(n_layer, C, ce_weight=0.0, **objective_kwargs).to(device)
    objective.init_weights()
    params = list(objective.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1) if params else None
    hidden = [torch.randn(1, T, C, device=device, requires_grad=True) for _ in range(n_layer + 2)]
    targets = torch.randint(0, V, (1, T), device=device)
    wte = torch.randn(V, C, device=device, requires_grad=True)
    autocast = autocast_context(device, dtype)

    def step():
        for h in hidden:
            h.grad = None
        with autocast:
            loss, _ = objective(None, hidden, targets, {"input": wte, "output": wte})
        loss.backward()
        if optimizer:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return alternate({"term": step}, reps, 1, device)["term"]


def paper_350m(args, device, dtype):
    C = 1024
    T = 2048
    V = 50304
    L = 24
    terms = {k: dict(v) for k, v in LOSSES.items() if k != "CE"}
    terms["CE + SimReg chunk"]["simreg_chunk_size"] = 1024
    steps = {}
    for n_layer, name, kw in [(1, "CE", {}), (2, "CE", {}), *((2, *term) for term in terms.items())]:
        config = GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=16, n_embd=C)
        steps[name, n_layer] = step_time(config, kw, 1, args.steps, args.warmup, device, dtype)
        print(f"  {name} step, {n_layer} block{'(s)' if name == 'CE' else 's'}: "
              f"{steps[name, n_layer]:.2f} s", file=sys.stderr)
    per_block = steps["CE", 2] - steps["CE", 1]
    full = steps["CE", 1] + (L - 1) * per_block
    # the CE step's FLOPs at 2 blocks (6 N per token + attention): the rate NITP's FLOPs are timed at
    rate = (6 * (2 * 12 * C * C + V * C) * T + 2 * 12 * C * T * T) / steps["CE", 2]
    rows = [("CE", f"{steps['CE', 2]:.2f}", "", f"{full:.1f}", "", "")]
    share = {}
    for name, kw in terms.items():
        extra = loss_time(kw, L, C, T, V, args.steps * 4, device, dtype)
        print(f"  {name}: the term alone {extra:.3f} s", file=sys.stderr)
        share[name] = 100 * extra / full
        note = ""
        if name == "CE + NITP":
            # SwiGLU head C -> 4C -> C: 3 matrices of 4 C^2, 24 C^2 FLOPs per token forward, x3 with backward
            predicted = 3 * 24 * C * C * T / rate
            share["NITP / its FLOP prediction"] = extra / predicted
            note = (f"FLOP prediction {predicted:.2f} s at the CE step's {rate / 1e9:.0f} GFLOP/s: "
                    f"measured / predicted = {extra / predicted:.2f}")
        rows.append((name, f"{steps[name, 2]:.2f}", f"{extra:.3f}", f"{full + extra:.1f}",
                     f"{share[name]:.2f} %", note))
    table(f"350M width (d 1024, T 2048, batch 1, V 50304): CE step at 1 and 2 blocks extrapolated to 24 "
          f"(per block {per_block:.2f} s); each term timed alone at 24 blocks",
          ["objective", "s / step at 2 blocks", "the term alone, s", "s / step at 24 blocks",
           "extra at 24 blocks", "note"], rows,
          intro="The 2-block column is whole steps with each loss on; differences there are within the "
                "steps' own jitter, which is why each term is also timed alone. 24-block step = 1-block "
                "step + 23 x per-block time; extra = the term alone / that step.")
    emit("\nGoals at 350M width:\n")
    goal("SimReg, share of a full-depth step", share["CE + SimReg"], 1.0, " %")
    goal("SimReg chunk 1024, share", share["CE + SimReg chunk"], 0.6, " %")
    goal("dispersion over all layers with 256 positions each, share",
         share["CE + dispersion (all layers, 256 positions)"], 1.0, " %")
    goal("NITP, measured / FLOP prediction", share["NITP / its FLOP prediction"], 1.5, "x")


def cwt_vs_ce(args, device, dtype):
    config = GPTConfig(vocab_size=50304, block_size=64, n_layer=4, n_head=4, n_embd=128)
    ce, cwt = (step_time(config, kw, 12, args.steps * 2, args.warmup, device, dtype) for kw in ({}, CWT))
    table("CWT vs CE at V = 50304 (4 x 128, T 64, batch 12)", ["objective", "ms / step", "speed-up vs CE"],
          [("CE", f"{1000 * ce:.1f}", "1.00x"), ("CWT (headless)", f"{1000 * cwt:.1f}", f"{ce / cwt:.2f}x")])
    emit()
    goal("CWT step, speed-up over CE at V = 50304", ce / cwt, 2.0, "x", higher_is_better=True)


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_child(chunk_size):
    """In a fresh process: SimReg forward + backward at T 2048, C 1024;
    prints how far the peak resident set grew."""
    h = torch.randn(1, 2048, 1024, requires_grad=True)
    labels = torch.randint(0, 50304, (1, 2048))
    simreg(h[:, :8], labels[:, :8]).backward()  # load the kernels first
    h.grad = None
    before = _status_kib("VmRSS")
    # resets the peak (VmHWM), past torch's own import peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    simreg(h, labels, chunk_size=chunk_size or None).backward()
    print(json.dumps({"peak_delta_mib": (_status_kib("VmHWM") - before) / 1024}))


def simreg_memory(args, device, dtype):
    rows = []
    for chunk in (0, 1024, 256):
        (out,) = run_child([*SELF, "--memory_child", str(chunk)])
        rows.append(("full" if chunk == 0 else f"chunk {chunk}", f"{out['peak_delta_mib']:.0f}"))
    table("SimReg peak memory, forward + backward, T 2048, C 1024 (growth of the peak resident set)",
          ["SimReg", "peak MiB"], rows)


def efficiency_child(setting, steps, warmup):
    keep_freed_memory()
    config, batch_size = EFFICIENCY_SETTINGS[setting]
    config = GPTConfig(**config)
    step = step_time(config, {}, batch_size, steps, warmup, "cpu", "float32")
    with torch.device("meta"):
        flops = GPT(config).flops_per_token() * batch_size * config.block_size
    print(json.dumps({"seconds": step, "flops": flops}))


def efficiency(args, device, dtype):
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    # 20 repeats, as tools/runner.py: a best of 3 can read low
    peak = measure_matmul_flops("cpu", torch.float32, repeats=20)
    rows = []
    for setting in EFFICIENCY_SETTINGS:
        steps = args.steps * (20 if setting == "lowres" else 4)
        command = [*SELF, "--efficiency_child", setting, "--steps", str(steps), "--warmup", "3"]
        (alone,) = run_child(command, OMP_NUM_THREADS=str(cores))
        with ThreadPoolExecutor(cores) as pool:  # one 1-thread process per core, side by side
            children = [pool.submit(run_child, command, OMP_NUM_THREADS="1") for _ in range(cores)]
        side_by_side = [child.result()[0] for child in children]
        rate = sum(r["flops"] / r["seconds"] for r in side_by_side)
        rows += [(setting, f"1 process x {cores} threads", f"{1000 * alone['seconds']:.1f}",
                  f"{alone['flops'] / alone['seconds'] / peak:.2f}"),
                 (setting, f"{cores} processes x 1 thread",
                  " / ".join(f"{1000 * r['seconds']:.1f}" for r in side_by_side), f"{rate / peak:.2f}")]
    table(f"CE training step vs the {peak / 1e9:.0f} GFLOP/s fp32 matmul peak of {cores} cores",
          ["grid", "processes", "ms / step", "model FLOP/s / peak"], rows)


def compile_step(args, device, dtype):
    """The lowres CE step of an eager and a compiled copy of one model,
    in turn; the first steps (compilation) are not timed."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=130, block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False)
    eager = build_model(config, device)
    compiled = build_model(config, device)
    compiled.load_state_dict(eager.state_dict())
    parallelism.compile_blocks(compiled)
    x = torch.randint(0, 130, (12, 64), device=device)
    autocast = autocast_context(device, dtype)

    def training_step(model):
        optimizers = configure_optimizers(model, 1e-3, 0.1, (0.9, 0.99))

        def step():
            with autocast:
                loss = cross_entropy(model(x), x)
            loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return step
    times = alternate({"eager": training_step(eager), "compiled (inductor)": training_step(compiled)},
                      10 * args.steps, max(args.warmup, 3), device)
    table(f"toy CE step (4 x 128, T 64, batch 12), eager vs compiled blocks, {torch.get_num_threads()} "
          "thread(s)", ["model", "median ms", "ratio to eager"],
          [(name, f"{1000 * t:.1f}", f"{t / times['eager']:.2f}") for name, t in times.items()])
