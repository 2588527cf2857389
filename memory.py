"""
What one process of a run needs in memory, before anything is allocated, and whether it fits:
train.py's memory check and batch_size = 'auto', and plan.py's memory table.

States: fp32 weights, gradients and AdamW's two moments are 16 bytes per parameter, all on every
GPU with DDP (plus DDP's gradient buckets, another 4 bytes) and 1/N of them with FSDP (plus the
largest unit FSDP gathers whole while it runs, and the unsharded gradient that FSDP keeps between
micro-steps when there are several: 4 bytes per parameter).

Activations are measured, not guessed: the model at its real width with 1 and 2 blocks runs one
training micro-step (forward, the run's objective, backward) on the meta device (nothing
allocated) at the run's batch and sequence length, PeakTensorBytes keeps the peak of the tensors
it creates, and the difference of the two is extrapolated to the run's depth (activation_gib).
For a GPU in bf16 (fp16) they are measured in that dtype, as autocast stores them (the residual
stream, the matmuls' outputs; model.GPT.residual_in_compute_dtype), the norms and losses still in
float32; elsewhere in float32. tools/bench.py --section
plan_memory sets the figures against the measured peak of real runs (docs/performance.md).
"""

import functools
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import parallelism
from model import GPT, GPTConfig
from errors import UserError
from objective import Objective, objective_step
from utils import available_memory

GiB = 2 ** 30
# On the CPU, utils.keep_freed_memory keeps glibc's heap at its peak, and the heap fragments: a run's
# resident peak is its tensors' peak plus a fraction of the step's transient tensors (activations,
# logits and their softmax). Under torchrun more: gloo's collectives run in threads of their own,
# whose heaps keep their own peaks. Calibrated on this repository's runs by `python -m tools.bench
# --section plan_memory` (its last column); docs/performance.md has the measurement. The CUDA
# caching allocator's own margin is not measured here.
CPU_HEAP_ALLOWANCE = {"one process": 0.2, "torchrun": 0.8}


# GiB of each GPU (the memory nvidia-smi reports; the 80 GB A100 and SXM parts), for batch_size = 'auto'
# in a plan made for a GPU named (train.py asks the device itself)
GPU_MEMORY_GIB = {"H100": 79.6, "H200": 140.4, "H800": 79.6, "A100": 80.0, "A800": 80.0, "L40S": 45.0,
                  "A10G": 22.5, "4090": 24.0}
# the share of it batch_size = 'auto' fills: the CUDA context and the collectives' buffers are not in the
# plan. Measured margin (one H100, results/gpu.md section 5: the 7B width at 2 and 4 blocks, batch 8 x 2048,
# bf16, activation checkpointing): the plan, with the GPU's logits (step_peak_bytes), is 38.0 and 46.8 GiB
# where the device peaked at 25.4 and 32.4 GiB allocated, 33.6 and 41.1 GiB reserved (the caching
# allocator's whole footprint): 4.4 and 5.7 GiB above reserved, plus the 10 % (8.0 GiB of an H100) here
AUTO_BATCH_MEMORY = 0.9


def meta_model(config, vocab):
    """(model, objective) of the config on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return GPT(GPTConfig.from_config(config, vocab)), Objective.from_config(config)


class PeakTensorBytes(TorchDispatchMode):
    """Counts the bytes of the tensors that the operations run under it create, as long as they
    live, and keeps the peak: a step's activations together with the transient buffers around
    them (a big vocabulary's logits, their softmax and gradient), which the saved tensors alone
    miss. A storage counts once, however many views of it there are."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.storages:  # (meta tensors have no address: identity)
                    self.storages.add(storage._cdata)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out

    def _freed(self, key, nbytes):
        self.live -= nbytes
        self.storages.discard(key)


def cpu_flash_attention_on_meta(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """The attention of a step measured on the meta device (GPT.use_attention): there
    scaled_dot_product_attention takes its math form, which holds the T x T scores that the flash
    kernels of the CPU and of GPUs never do; a causal attention runs the CPU flash kernel's own meta
    function instead, so a step measured on meta holds what the same step holds on the CPU."""
    if q.device.type == "meta" and attn_mask is None and is_causal and not kwargs:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, True)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, **kwargs)


def compute_dtype(config):
    """The dtype a run's activations are stored in: on a GPU, bf16 under autocast (dtype 'auto'
    too: every GPU plan.py names has bf16; an older GPU's fp16 is the same size), fp16, or float32;
    float32 elsewhere (an upper bound for a CPU run under bf16)."""
    if not str(config.get("device", "")).startswith("cuda"):
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16}.get(config.get("dtype"), torch.bfloat16)


def objective_on_blocks(config, n_layer):
    """The run's objective on its model cut to n_layer blocks: a loss that reads block l's state
    (simreg_layer, nitp_layer) reads the last block the cut model has when l is beyond it. Every
    block's state has the same shape, so the loss costs what it costs in the run."""
    cut = {"n_layer": n_layer}
    if config.get("simreg_layer", -1) > n_layer:
        cut["simreg_layer"] = n_layer
    if config.get("nitp_layer", 0) > n_layer:
        cut["nitp_layer"] = n_layer
    return Objective.from_config({**config, **cut})


@functools.lru_cache(maxsize=64)
def _step_peak_bytes(config_items, model_config_items, n_layer, batch_size, seq_len, device):
    config, model_config = dict(config_items), GPTConfig(**dict(model_config_items))
    cfg = GPTConfig(**{**model_config.__dict__, "n_layer": n_layer, "block_size": seq_len})
    with torch.device("meta"):
        model, objective = GPT(cfg), objective_on_blocks(config, n_layer)
    if device != "meta":
        model.to_empty(device=device)  # sizes are all we need: leave the memory uninitialised...
        objective.to_empty(device=device)
        with torch.no_grad():
            for p in [*model.parameters(), *objective.parameters()]:
                # ...but finite: sizes do not depend on the values (a router sends each token to
                # top_k experts)
                p.fill_(0.02)
    for p in [*model.parameters(), *objective.parameters()]:
        p.grad = torch.zeros_like(p)  # the gradients are the plan's states, not the step's
    x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=device)
    model.use_attention(cpu_flash_attention_on_meta)
    # in the compute dtype, as autocast's matmuls store the activations (the weights' own dtype does
    # not matter here: their memory is the plan's states, not the step's)
    model.to(compute_dtype(config))
    objective.to(compute_dtype(config))
    with PeakTensorBytes() as counter:
        loss, _, logits, hidden = objective_step(model, objective, x, x)
        loss.backward()
        del loss, logits, hidden
    return counter.peak


def step_peak_bytes(config, model_config, n_layer, batch_size, seq_len, device="meta"):
    """Peak bytes of the tensors one training micro-step creates (forward, the run's objective,
    backward into gradients that already exist) with the model cut to n_layer blocks, in the
    activations' dtype (compute_dtype). On
    the meta device by default: nothing is allocated, any width takes a fraction of a second, and
    the attention is the CPU flash kernel's (cpu_flash_attention_on_meta).
    A mixture of experts runs there too (static shapes: its capacity buffers are counted; dropless
    routing with the k N routed rows spread evenly over the experts, moe.balanced_sizes).
    Cached: a plan asks for the same step often."""
    keys = tuple(sorted((k, v) for k, v in config.items()
                        if isinstance(v, (int, float, str, bool, type(None)))))
    return _step_peak_bytes(keys, tuple(sorted(model_config.__dict__.items())), n_layer, batch_size, seq_len,
                            device)


def activation_gib(config, model_config, batch_size, seq_len, device="meta"):
    """GiB of one micro-step's activations and transient buffers: act (all stored), act_ckpt
    (activation checkpointing: each block's input kept, one block recomputed at a time) and one
    block. Measured (step_peak_bytes) with 1 and 2 blocks at the run's own batch and sequence
    length: the difference is one block, the rest is embedding, head, loss and the gradients'
    transients. (Not extrapolated from a shorter sequence: the CPU's attention changes kernel
    between 1024 and 2048 tokens, and a 350M block's peak grows 2.4x there instead of 2x.)"""
    one, two = (step_peak_bytes(config, model_config, n, batch_size, seq_len, device) for n in (1, 2))
    block, rest = max(two - one, 0), max(2 * one - two, 0)
    block_input = batch_size * seq_len * model_config.n_embd * compute_dtype(config).itemsize
    return {"act": (rest + model_config.n_layer * block) / GiB,
            "act_ckpt": (rest + model_config.n_layer * block_input + block) / GiB, "block": block / GiB}


def gathered_bytes(config):
    """Bytes per parameter FSDP gathers: train.py's param_dtype, bf16 (fp16) on a GPU, fp32 with
    dtype=float32."""
    return 4 if config["dtype"] == "float32" else 2


def memory_by_mode(model, config, processes, micro_steps, measure=True):
    """GiB per GPU: {ddp, fsdp} x {plain, checkpointed}, and the parts they are made of.
    DDP (one process: the same without buckets) holds everything on every GPU. FSDP holds 1/N of
    the states (hybrid sharding, fsdp_shard_size = k: 1/k), plus the largest unit it gathers whole
    while that unit runs (fsdp_keep_gathered: every unit, for the whole step), plus, with several
    micro-steps, the whole fp32 gradient between them (gradient sync is off until the last).
    measure: True (step_peak_bytes' device), False (activations NaN) or a device to measure them on."""
    n, group = model.num_params(), shard_group(config, processes)
    blocks, root = fsdp_units(model, group)  # as FSDP holds them: padded where no dimension divides
    padded = sum(blocks) + root
    param_bytes = gathered_bytes(config)  # what FSDP gathers (its mixed-precision policy)
    largest = max(max(blocks), root)
    gathered = (padded if config.get("fsdp_keep_gathered") else largest) * param_bytes
    parts = {"ddp": (16 + (4 if processes > 1 else 0)) * n / GiB,
             "fsdp": (16 * padded / group + gathered + largest * 4
                      + (4 * n if micro_steps > 1 else 0)) / GiB}
    parts.update(activation_gib(config, model.config, config["batch_size"], config["block_size"],
                                **({} if measure is True else {"device": measure})) if measure
                 else {"act": float("nan"), "act_ckpt": float("nan"), "block": float("nan")})
    table = {mode: {"plain": parts[mode] + parts["act"], "checkpointed": parts[mode] + parts["act_ckpt"]}
             for mode in ("ddp", "fsdp")}
    return table, parts


def fsdp_units(model, shards):
    """(elements of each block, of the root: embeddings, final norm, LM head) as FSDP holds them on
    `shards` ranks: each parameter padded where no dimension divides (parallelism.padded_numel; the
    whole count on 1). A tied matrix counts once."""
    blocks = [sum(parallelism.padded_numel(p.shape, shards) for p in block.parameters()) for block in model.h]
    in_blocks = {id(p) for block in model.h for p in block.parameters()}
    root = sum(parallelism.padded_numel(p.shape, shards) for p in model.parameters()
               if id(p) not in in_blocks)
    return blocks, root


def shard_group(config, processes):
    """The processes FSDP shards the states over: all of them, or fsdp_shard_size's groups (hybrid)."""
    k = config.get("fsdp_shard_size", 0)
    return k if 0 < k < processes else processes


def micro_steps_of(config, processes):
    """Micro-steps per optimizer step on `processes` processes (global_batch_size fixes the batch)."""
    return (config["global_batch_size"] // (config["batch_size"] * processes) if config["global_batch_size"]
            else config["gradient_accumulation_steps"])


def process_gib(config, processes, vocab, measure=True, heap=0.0):
    """(GiB one process of the run needs, GiB of its weights, gradients and optimizer states):
    the plan's memory for the run's own parallel mode and activation checkpointing, plus `heap`
    times the step's transient tensors (CPU_HEAP_ALLOWANCE on the CPU)."""
    model, _ = meta_model(config, vocab)
    mode = "fsdp" if config["parallel"] == "fsdp" else "ddp"
    table, parts = memory_by_mode(model, config, processes, micro_steps_of(config, processes), measure)
    tensors = table[mode]["checkpointed" if config["activation_checkpointing"] else "plain"]
    return tensors + heap * (tensors - parts[mode]), parts[mode]


def memory_problem(config, processes, vocab, available_gib, where, heap=0.0):
    """None when the run fits in available_gib per process (the plan's figure), else one line: what
    it needs, what `where` has, and what the plan says would fit: activation checkpointing, a
    smaller batch_size (more micro-steps when global_batch_size fixes the batch), or FSDP on N
    processes with this much memory each. Nothing is allocated (step_peak_bytes runs on meta).
    heap: process_gib's allowance for the allocator."""
    need = process_gib(config, processes, vocab, heap=heap)[0]
    if need <= available_gib:
        return None

    def fits(**changes):
        changed = {**config, **changes}
        return process_gib(changed, changed.pop("processes", processes), vocab, heap=heap)[0] <= available_gib

    options = []
    if not config["activation_checkpointing"] and fits(activation_checkpointing=True):
        options.append("--activation_checkpointing=True")
    batch = config["batch_size"] // 2
    while batch >= 1 and not options:
        if (not config["global_batch_size"] or config["global_batch_size"] % (batch * processes) == 0) \
                and fits(batch_size=batch):
            options.append(f"--batch_size={batch}")
        batch //= 2
    # FSDP on more processes: as configured, with activation checkpointing, and without keeping the
    # weights gathered over the step (the whole model per GPU, however many processes there are)
    variants = [{}, {"activation_checkpointing": True}]
    if config.get("fsdp_keep_gathered"):
        variants += [{**v, "fsdp_keep_gathered": False} for v in variants]

    def fsdp_fits(n):
        return next((v for v in variants if fits(parallel="fsdp", processes=n, **v)), None)
    n = 2 * processes
    global_batch = config["global_batch_size"]
    while n <= 4096 and ((global_batch and global_batch % (config["batch_size"] * n))
                         or fsdp_fits(n) is None):
        n *= 2
    if n <= 4096:
        flags = "".join(f" --{key}={value}" for key, value in fsdp_fits(n).items())
        options.append(f"--parallel=fsdp{flags} on {n} processes (torchrun) of {available_gib:.1f} GiB each")
    would = (("; it would fit with " + ", or with ".join(options)) if options
             else "; nothing the plan tries fits")
    what = "weights, gradients, AdamW states and activations"
    return (f"this run needs {need:.1f} GiB per process ({what}; `python plan.py <config>` gives the parts) "
            f"but {where} has {available_gib:.1f} GiB{would}; to start it anyway: --check_memory=False")


def largest_batch_size(config, processes, vocab, available_gib, heap=0.0):
    """batch_size = 'auto': the most sequences per process and micro-step whose plan fits
    available_gib per process, among the divisors of each process's share of global_batch_size (the
    micro-steps stay whole and the global batch stays the recipe's). Fewer, larger micro-steps do
    more compute per byte FSDP gathers and per kernel launched. Each candidate is planned at its own
    size, largest first (activations do not grow in proportion to the batch: the 7B model's are 6.1,
    7.6, 13.5 and 25.4 GiB at 1, 2, 4 and 8 sequences). None when not even batch 1 fits."""
    share = config["global_batch_size"] // processes
    for batch in (b for b in range(share, 0, -1) if share % b == 0):
        changed = {**config, "batch_size": batch}
        if process_gib(changed, processes, vocab, measure=False)[1] > available_gib:
            continue  # the states alone do not fit (FSDP's whole gradient: fewer micro-steps may drop it)
        if process_gib(changed, processes, vocab, heap=heap)[0] <= available_gib:
            return batch
    return None


def resolve_batch_size(config, processes, vocab, available_gib, heap=0.0):
    """(config with batch_size = 'auto' replaced by largest_batch_size's, whether that batch fits):
    where not even one sequence fits, batch 1, which the memory check then refuses with what would
    fit. A config with a number is returned as it is."""
    if config["batch_size"] != "auto":
        return config, True
    batch = largest_batch_size(config, processes, vocab, available_gib * AUTO_BATCH_MEMORY, heap)
    return {**config, "batch_size": batch or 1}, batch is not None


def device_batch_size(config, processes, vocab, device):
    """resolve_batch_size's batch_size against what `device` has for this process
    (utils.available_memory), with the heap's allowance on the CPU."""
    available, _ = available_memory(device)
    heap = cpu_heap_allowance(processes) if torch.device(device).type == "cpu" else 0.0
    config = {**config, "device": device}  # the step measured with this device's loss (step_peak_bytes)
    return resolve_batch_size(config, processes, vocab, available / GiB, heap)[0]["batch_size"]


def cpu_heap_allowance(processes):
    """The fraction of a step's transient tensors that glibc's heap adds on the CPU (CPU_HEAP_ALLOWANCE)."""
    return CPU_HEAP_ALLOWANCE["torchrun" if processes > 1 else "one process"]


def device_memory_problem(config, processes, vocab, device):
    """memory_problem against what `device` has for this process (utils.available_memory), with
    the heap's allowance on the CPU."""
    available, source = available_memory(device)
    heap = cpu_heap_allowance(processes) if torch.device(device).type == "cpu" else 0.0
    config = {**config, "device": device}  # the step measured with this device's loss (step_peak_bytes)
    return memory_problem(config, processes, vocab, available / GiB, f"{device} ({source})", heap)


def auto_batch_size(config, processes, vocab, device, master):
    """batch_size='auto': device_batch_size on every process, the smallest that any found, so all run
    alike (1 where not even one sequence fits: check_fits says why); rank 0 (master) says so."""
    batch_size = min(parallelism.gather_objects(device_batch_size(config, processes, vocab, device)))
    if master:
        print(f"batch_size='auto': {batch_size} sequences per process and micro-step on {device}")
    return batch_size


def check_fits(config, processes, vocab, device):
    """A UserError, before anything is allocated, when the plan's memory for this process does not
    fit in what the device has (device_memory_problem); rank 0 says it for every rank."""
    if problem := device_memory_problem(config, processes, vocab, device):
        raise UserError(problem, agreed=True)
