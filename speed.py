"""
How fast a run goes here, before it starts: the speed measured on this
machine (a CPU or MPS has no datasheet: plan.py's time), a training
step timed on random tokens (the benchmarks'), and the lines train.py
prints before its loop. Design notes: docs/performance.md.
"""

import statistics

import torch

from model import GPT, GPTConfig, build_model
from objective import Objective, Trained
from optim import configure_optimizers
from utils import (autocast_context, measure_matmul_flops, peak_flops,
                   seconds)


# name -> (model config, batch size): the CE runs of the comparison
# grids; a CPU plan times the first
EFFICIENCY_SETTINGS = {
    "lowres": (dict(vocab_size=130, block_size=64,
                    n_layer=4, n_head=4, n_embd=128), 12),
    "bpe": (dict(vocab_size=50304, block_size=128,
                 n_layer=4, n_head=4, n_embd=128), 8),
}


def step_time(model_config, objective_kwargs, batch_size, steps, warmup,
              device, dtype):
    """Median seconds of a training step on random tokens with the
    objective of objective_kwargs, after `warmup` untimed steps."""
    torch.manual_seed(0)
    model = build_model(model_config, device)
    objective = Objective(model_config.n_layer, model_config.n_embd,
                          **objective_kwargs).to(device)
    objective.init_weights()
    trained = Trained(model, objective)
    optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95),
                                      extra_modules=[objective])
    shape = (batch_size, model_config.block_size)
    x = torch.randint(0, model_config.vocab_size, shape, device=device)
    y = torch.randint(0, model_config.vocab_size, shape, device=device)
    autocast = autocast_context(device, dtype)

    def step():
        with autocast:
            loss, *_ = trained(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    times = [seconds(step, device) for _ in range(warmup + steps)]
    return statistics.median(times[warmup:])


def measured_speed(device, dtype):
    """(peak FLOP/s, MFU) of this machine's `device` (a CPU, MPS: no
    datasheet): the matmul peak, and the MFU the lowres toy's CE step
    reaches here (docs/performance.md)."""
    peak = peak_flops(device, dtype)
    settings, batch_size = EFFICIENCY_SETTINGS["lowres"]
    toy = GPTConfig(**settings)
    # 10 steps timed after 3 untimed (allocation, the kernels' set-up)
    step_s = step_time(toy, {}, batch_size, 10, 3, device, dtype)
    with torch.device("meta"):
        per_token = GPT(toy).flops_per_token()
    flops = per_token * batch_size * toy.block_size
    return peak, flops / step_s / peak


def long_work_notice(flops_per_step, flops_per_eval, peak, mfu=0.4,
                     threshold_s=120):
    """The line train.py prints before its loop when one step or one
    evaluation would take more than threshold_s at the plan's MFU of
    `peak` (FLOP/s of all processes); None when both are short."""
    long = []
    for what, flops in (("one step", flops_per_step),
                        ("one evaluation", flops_per_eval)):
        time_s = flops / (mfu * peak)
        if time_s > threshold_s:
            long.append(f"{what} will take about {time_s / 60:,.0f} min")
    if not long:
        return None
    return (f"note: {' and '.join(long)} on this device "
            f"(plan: {flops_per_step / 1e12:,.1f} TFLOP per step, "
            f"{flops_per_eval / 1e12:,.1f} per evaluation, "
            f"at MFU {mfu:.0%} of {peak / 1e9:,.0f} GFLOP/s); "
            "the first log line comes after it")


def slow_dtype_notice(device, dtype, peak):
    """The line train.py prints when a CPU runs the chosen dtype's matmuls
    (peak: their measured FLOP/s) slower than float32's, as most CPUs do
    float16 and some bfloat16. None on a GPU, in float32, or where the
    dtype is faster."""
    if device != "cpu" or dtype == "float32":
        return None
    float32 = measure_matmul_flops(device, torch.float32)
    if float32 <= peak:
        return None
    return (f"note: {dtype} matmuls run at {peak / 1e9:,.0f} GFLOP/s on "
            f"this CPU and float32's at {float32 / 1e9:,.0f}: --dtype=float32 "
            f"would train about {float32 / peak:,.0f}x faster")


def start_lines(params, config, device, dtype, tokens_per_iter,
                flops_per_iter, flops_per_eval, peak, processes):
    """What train.py prints before its loop: the model's size, the
    device, a step's tokens and FLOPs, the peak (all processes') and how
    the processes share the work; then the notices, if any."""
    parallel = config["parallel"]
    how = ""
    if parallel != "none":
        plural = "es" if processes > 1 else ""
        how = f" | {processes} process{plural}, {parallel}"
        shard_size = config["fsdp_shard_size"]
        if parallel == "fsdp" and 0 < shard_size < processes:
            how += f" sharded in groups of {shard_size}"
    summary = (f"params: {params:,} | device {device} {dtype} | "
               f"{tokens_per_iter} tokens/iter | "
               f"{flops_per_iter / 1e9:.2f} GFLOP/iter | "
               f"peak {peak / 1e9:.0f} GFLOP/s{how}")
    notices = [long_work_notice(flops_per_iter, flops_per_eval, peak),
               slow_dtype_notice(device, dtype, peak / processes)]
    return "\n".join([summary, *filter(None, notices)])
