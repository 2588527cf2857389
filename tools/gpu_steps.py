"""
What the GPU check's (tools/gpu_check.py) sections share: Check, and
train.py's step built (build), run (train_step) and timed (time_step)
on the device.
"""

import gc
import os
import statistics
import time
from types import SimpleNamespace

import torch

import parallelism
import plan
from configurator import parse_config, train_defaults
from model import GPT, GPTConfig
from objective import Objective, Trained
from optim import apply_gradients, configure_optimizers
from utils import (GPU_PEAK_BF16_FLOPS, autocast_context, markdown_table, measure_matmul_flops,
                   save_text, seconds)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30
MFU_GOAL = 0.45
PLAN_MFU = 0.4  # plan.py's default
# the check trains in bf16: the loss is never scaled (apply_gradients' pass-through)
NO_SCALING = torch.amp.GradScaler("cpu", enabled=False)


class SectionSkipped(Exception):
    """A section this torch cannot do here (one line, not a failure)."""


class Check:
    """The device, the sizes, the report so far and its file."""

    def __init__(self, device, sizes, out, data_dir, budget):
        self.device = device
        self.sizes = sizes
        self.out = out
        self.data_dir = data_dir
        self.cuda = device == "cuda"
        self.dtype = "bfloat16"  # train.py's dtype=auto on a GPU with bf16
        self.autocast = autocast_context(device, self.dtype)
        if self.cuda:
            self.peak = GPU_PEAK_BF16_FLOPS["H100"]
        else:
            self.peak = measure_matmul_flops(device, torch.bfloat16)
        self.deadline = time.monotonic() + budget
        self.text = []
        self.shared = {}  # section 3's run, for section 4

    def line(self, text):
        print(text, flush=True)
        self.text.append(text)

    def table(self, header, rows):
        for line in markdown_table(header, rows):
            self.line(line)

    def save(self):
        if self.out:
            save_text("\n".join(self.text) + "\n", self.out)

    def step_times(self, step, warmup, steps):
        """(first step's seconds, compilation included; median of the
        `steps` after `warmup`)."""
        times = [seconds(step, self.device) for _ in range(warmup + steps)]
        return times[0], statistics.median(times[warmup:])

    def reset_memory(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        """(max allocated, max reserved) GiB since reset_memory; NaN
        off CUDA."""
        if not self.cuda:
            return float("nan"), float("nan")
        return torch.cuda.max_memory_allocated() / GiB, torch.cuda.max_memory_reserved() / GiB

    def profiled(self, work):
        """torch.profiler's events of work(): the device's kernels (the
        CPU's operators off CUDA)."""
        from torch.profiler import ProfilerActivity, profile
        activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        with profile(activities=[activity]) as p:
            work()
            if self.cuda:
                torch.cuda.synchronize()
        return p.key_averages()

    def config(self, path, **overrides):
        """A config file as train.py reads it, at --smoke's width."""
        config = parse_config([os.path.join(REPO, path)], train_defaults())
        return {**config, **self.sizes["shrink"], **overrides}


def train_step(check, trained, optimizers, batches, keep_gathered=False):
    """One optimizer step over the micro-batches [(x, y), ...]; -> the
    last micro-batch's terms."""
    for i, (x, y) in enumerate(batches):
        with parallelism.gradient_sync(trained, i == len(batches) - 1, keep_gathered):
            with check.autocast:
                loss, terms, logits, hidden = trained(x, y)
            (loss / len(batches)).backward()
            del logits, hidden, loss
    apply_gradients(optimizers, NO_SCALING)
    return terms


def random_batches(config, batch, micro_steps, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, config["block_size"])

    def tokens():
        return torch.randint(0, config["vocab_size"], shape, generator=generator).to(device)
    return [(tokens(), tokens()) for _ in range(micro_steps)]


def build(check, config, fsdp=False):
    """(objective.Trained, optimizers) of a config on the device, as
    train.py builds them (FSDP on this one process if asked)."""
    torch.manual_seed(config["seed"])
    with torch.device("meta"):
        trained = Trained(GPT(GPTConfig.from_config(config, config["vocab_size"])),
                          Objective.from_config(config))
    # in train.py's order: compile, checkpointing, FSDP
    if config["compile"] is True:
        parallelism.compile_blocks(trained.model, backend=check.sizes["compile_backend"],
                                   fullgraph=True)
    if config["activation_checkpointing"]:
        parallelism.apply_activation_checkpointing(trained.model)
    if fsdp:
        if reason := parallelism.fsdp_unavailable(check.device):
            raise SectionSkipped(reason)
        if not torch.distributed.is_initialized():
            parallelism.init_distributed(check.device)
    # FSDP2 shards `trained` in place: no other wrapper here
    parallelism.parallelize(trained, "fsdp" if fsdp else "none", check.device,
                            param_dtype=torch.bfloat16, keep_gathered=config["fsdp_keep_gathered"])
    return trained, optimizers_of(trained)


def optimizers_of(trained):
    return configure_optimizers(trained.model, 1e-4, 0.1, (0.9, 0.95),
                                extra_modules=[trained.objective])


def time_step(check, config, batch, micro_steps, warmup, steps, fsdp=False):
    """config's step built afresh (FSDP: weights kept gathered) and
    timed on random micro-batches of `batch` sequences; -> trained,
    batches, step, first and s (step_times), each step's terms, peak
    GiB allocated and reserved, a micro-step's flops (train.py's count)
    and the step's mfu."""
    check.reset_memory()
    trained, optimizers = build(check, config, fsdp)
    batches = random_batches(config, batch, micro_steps, check.device)
    terms = []

    def step():
        last = train_step(check, trained, optimizers, batches, keep_gathered=fsdp)
        terms.append({k: v.detach() for k, v in last.items()})
    first, s = check.step_times(step, warmup, steps)
    allocated, reserved = check.peak_gib()
    tokens = batch * config["block_size"]
    flops = plan.training_flops_per_token(trained.model, trained.objective, tokens) * tokens
    return SimpleNamespace(trained=trained, batches=batches, step=step, first=first, s=s,
                           terms=terms, allocated=allocated, reserved=reserved, flops=flops,
                           mfu=flops * micro_steps / s / check.peak)
