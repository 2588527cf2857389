"""
What does each loss cost? Times real training steps (forward, backward, AdamW) with each loss
switched on, as ratios to the cross-entropy step measured in the same process:

    python bench.py                 # every section
    python bench.py --section toy   # toy | 350m | cwt | memory

  toy     the low-resource toy model (4 x 128, T = 64, batch 12, V = 130)
  350m    the SimReg paper's 350M width cut to fit here: d = 1024, 16 heads, T = 2048, batch 1,
          V = 50304, with 1 and 2 blocks; the per-block cost from the two is extrapolated to the
          full 24 blocks: t(24) = t(1) + 23 * (t(2) - t(1)). A loss on the final state costs the
          same at any depth; dispersion over all layers costs 24x its per-layer extra time.
  cwt     CWT vs CE at V = 50304 on a small model (4 x 128, T = 64, batch 12)
  memory  peak resident memory of SimReg forward + backward at T = 2048, C = 1024, full vs
          chunk 1024, each in a fresh process (Linux /proc peak RSS)

Step times are medians over `--steps` timed steps after `--warmup` untimed ones. On CPU the
model runs in float32 (see utils.choose_dtype). Results print as a Markdown table.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from losses import Objective, simreg
from model import GPTConfig, build_model
from optim import configure_optimizers
from utils import autocast_context, choose_device, choose_dtype


def step_time(model_config, objective_kwargs, batch_size, steps, warmup, device, dtype):
    """Median seconds of one training step with the given objective."""
    torch.manual_seed(0)
    model = build_model(model_config, device)
    objective = Objective(model_config.n_layer, model_config.n_embd, **objective_kwargs).to(device)
    objective.init_weights()
    optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), device_type=device, extra_modules=[objective])
    T, V = model_config.block_size, model_config.vocab_size
    x = torch.randint(0, V, (batch_size, T), device=device)
    y = torch.randint(0, V, (batch_size, T), device=device)
    autocast = autocast_context(device, dtype)
    times = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            logits, hidden = model(x, return_hidden_states=True, compute_logits=objective.needs_logits)
            loss, _ = objective(logits, hidden, y, model.input_embedding())
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


LOSSES = {  # name -> Objective kwargs on top of CE
    "CE": {},
    "CE + SimReg": {"simreg": 1.0},
    "CE + SimReg chunk": {"simreg": 1.0, "simreg_chunk_size": None},  # chunk size set per section
    "CE + dispersion (all layers)": {"dispersion": 0.1},
    "CE + dispersion (all layers, 256 positions)": {"dispersion": 0.1, "dispersion_positions": 256},
    "CE + NITP": {"nitp": 1.0},
}


def table(title, header, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def toy(args, device, dtype):
    config = GPTConfig(vocab_size=130, block_size=64, n_layer=4, n_head=4, n_embd=128)
    losses = {k: dict(v) for k, v in LOSSES.items() if "256" not in k}
    losses["CE + SimReg chunk"]["simreg_chunk_size"] = 32
    losses["CWT (headless)"] = {"ce": 0.0, "cwt": 1.0}
    times = {name: step_time(config, kw, 12, args.steps * 4, args.warmup, device, dtype) for name, kw in losses.items()}
    base = times["CE"]
    table("toy model (4 x 128, T 64, batch 12, V 130)", ["objective", "ms / step", "ratio to CE", "extra"],
          [(n, f"{1000 * t:.1f}", f"{t / base:.3f}", f"{100 * (t / base - 1):+.1f} %") for n, t in times.items()])


def paper_350m(args, device, dtype):
    losses = {k: dict(v) for k, v in LOSSES.items()}
    losses["CE + SimReg chunk"]["simreg_chunk_size"] = 1024
    times = {}
    for n_layer in (1, 2):
        config = GPTConfig(vocab_size=50304, block_size=2048, n_layer=n_layer, n_head=16, n_embd=1024)
        for name, kw in losses.items():
            times[name, n_layer] = step_time(config, kw, 1, args.steps, args.warmup, device, dtype)
            print(f"  {name}, {n_layer} block(s): {times[name, n_layer]:.2f} s", file=sys.stderr)
    per_block = times["CE", 2] - times["CE", 1]
    full = times["CE", 1] + 23 * per_block  # t(24): 1 block + 23 more
    C, T = 1024, 2048
    rows = [("CE", f"{times['CE', 2]:.2f}", f"{full:.1f}", "", "")]
    for name in losses:
        if name == "CE":
            continue
        extra2 = times[name, 2] - times["CE", 2]
        if name.startswith("CE + dispersion"):
            extra1 = times[name, 1] - times["CE", 1]
            extra24 = extra1 + 23 * (extra2 - extra1)  # its cost grows with the number of layers
        else:
            extra24 = extra2  # a loss on the final state costs the same at any depth
        note = ""
        if name == "CE + NITP":
            # the SwiGLU head: 3 matrices C x 4C -> 24 C^2 FLOPs per token forward, x3 with backward,
            # plus AdamW; predicted time at the CE step's achieved FLOP rate
            ce_flops = 6 * (2 * 12 * C * C + 50304 * C) * T + 12 * 2 * C * T * T
            predicted = 3 * 24 * C * C * T / (ce_flops / times["CE", 2])
            note = f"FLOP prediction {predicted:.2f} s: measured / predicted = {extra2 / predicted:.2f}"
        rows.append((name, f"{times[name, 2]:.2f}", f"{full + extra24:.1f}", f"{100 * extra24 / full:.2f} %", note))
    table(f"350M width (d 1024, T 2048, batch 1, V 50304), measured at 2 blocks, extrapolated to 24 "
          f"(per block {per_block:.2f} s)", ["objective", "s / step at 2 blocks", "s / step at 24 blocks (extrap.)",
                                             "extra at 24 blocks", "note"], rows)


def cwt_vs_ce(args, device, dtype):
    config = GPTConfig(vocab_size=50304, block_size=64, n_layer=4, n_head=4, n_embd=128)
    ce = step_time(config, {}, 12, args.steps * 2, args.warmup, device, dtype)
    cwt = step_time(config, {"ce": 0.0, "cwt": 1.0}, 12, args.steps * 2, args.warmup, device, dtype)
    table("CWT vs CE at V = 50304 (4 x 128, T 64, batch 12)", ["objective", "ms / step", "speed-up vs CE"],
          [("CE", f"{1000 * ce:.1f}", "1.00x"), ("CWT (headless)", f"{1000 * cwt:.1f}", f"{ce / cwt:.2f}x")])


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


def memory(args, device, dtype):
    rows = []
    for chunk in (0, 1024, 256):
        out = subprocess.run([sys.executable, __file__, "--memory_child", str(chunk)], capture_output=True, text=True,
                             check=True).stdout
        rows.append(("full" if chunk == 0 else f"chunk {chunk}", f"{json.loads(out)['peak_delta_mib']:.0f}"))
    table("SimReg peak memory, forward + backward, T 2048, C 1024 (growth of the peak resident set)",
          ["SimReg", "peak MiB"], rows)


SECTIONS = {"toy": toy, "350m": paper_350m, "cwt": cwt_vs_ce, "memory": memory}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--memory_child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        return memory_child(args.memory_child)
    device = choose_device(args.device)
    dtype = choose_dtype("auto", device)
    print(f"device {device}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.section or list(SECTIONS):
        SECTIONS[name](args, device, dtype)


if __name__ == "__main__":
    main()
