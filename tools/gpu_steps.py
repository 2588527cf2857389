"""
What every section of the GPU check (tools/gpu_check.py) shares: Check, the device, the sizes and
the report so far; and train.py's step built (build), run (train_step) and timed (timed,
step_times) on the device.
"""

import gc
import os
import statistics
import time

import torch

import parallelism
from configurator import parse_config, train_defaults
from model import GPT, GPTConfig
from objective import Objective, Trained
from optim import apply_gradients, configure_optimizers
from utils import GPU_PEAK_BF16_FLOPS, autocast_context, measure_matmul_flops, save_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30
MFU_GOAL = 0.45
PLAN_MFU = 0.4  # the plan's assumed MFU for its step times (plan.py's default)


class SectionSkipped(Exception):
    """A section this torch or this run cannot do here (said in one line, not counted as a failure)."""


class Check:
    """What every section shares: the device, the sizes, the report so far and the file it goes to."""

    def __init__(self, device, sizes, out, data_dir, budget):
        self.device = device
        self.sizes = sizes
        self.out = out
        self.data_dir = data_dir
        self.cuda = device.startswith("cuda")
        self.dtype = "bfloat16"  # the GPU runs' autocast (train.py's dtype=auto on a GPU with bf16)
        self.autocast = autocast_context(device, self.dtype)
        if self.cuda:
            self.peak = GPU_PEAK_BF16_FLOPS["H100"]
        else:
            self.peak = measure_matmul_flops(device, torch.bfloat16)
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

    def profile(self):
        """torch.profiler over the device's kernels (the CPU's operators off CUDA)."""
        from torch.profiler import ProfilerActivity, profile
        return profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU])

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


def step_times(check, step, warmup, steps):
    """(first step's seconds: compilation included, median of the `steps` after `warmup`)."""
    seconds = [timed(check, step)[0] for _ in range(warmup + steps)]
    return seconds[0], statistics.median(seconds[warmup:])


def train_step(model, objective, optimizers, scaler, batches, autocast, keep_gathered=False):
    """One optimizer step over the micro-batches [(x, y), ...] as train.py takes it; -> (stepped, terms)."""
    trained = Trained(model, objective)  # FSDP2 (or none): its own wrapper
    for i, (x, y) in enumerate(batches):
        with parallelism.gradient_sync(trained, i == len(batches) - 1, keep_gathered):
            with autocast:
                loss, terms, logits, hidden = trained(x, y)
            scaler.scale(loss / len(batches)).backward()
            del logits, hidden, loss
    return apply_gradients(optimizers, scaler), terms


def random_batches(config, batch, micro_steps, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    T, V = config["block_size"], config["vocab_size"]
    return [tuple(torch.randint(0, V, (batch, T), generator=generator).to(device) for _ in "xy")
            for _ in range(micro_steps)]


def build(check, config, fsdp=False):
    """(model, objective, optimizers, scaler) of a config on the device as train.py builds them
    (activation checkpointing, compile, FSDP on this one process if asked)."""
    torch.manual_seed(config["seed"])
    with torch.device("meta"):
        model = GPT(GPTConfig.from_config(config, config["vocab_size"]))
        objective = Objective.from_config(config)
    if config["compile"] is True:  # in train.py's order: compile, checkpointing, FSDP
        parallelism.compile_blocks(model, backend=check.sizes["compile_backend"], fullgraph=True)
    if config["activation_checkpointing"]:
        parallelism.apply_activation_checkpointing(model)
    if fsdp:
        if reason := parallelism.fsdp_unavailable(check.device):
            raise SectionSkipped(reason)
        if not torch.distributed.is_initialized():
            parallelism.init_distributed("cuda" if check.cuda else "cpu")
    parallelism.parallelize(Trained(model, objective), "fsdp" if fsdp else "none", check.device,
                            param_dtype=torch.bfloat16 if fsdp else None,
                            keep_gathered=config["fsdp_keep_gathered"])
    optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), extra_modules=[objective])
    scaler = torch.amp.GradScaler(torch.device(check.device).type, enabled=False)
    return model, objective, optimizers, scaler
