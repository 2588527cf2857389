"""
What one process of a run needs in memory, before anything is
allocated, and whether it fits: train.py's memory check and
batch_size='auto', and plan.py's memory table. The states are counted
per parameter (memory_by_mode), the activations measured on the meta
device (activation_gib).

What is counted: docs/parallelism.md; the plan against measured peaks
(`python -m tools.bench --section plan_memory`): docs/performance.md.
"""

import functools
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import parallelism
from model import GPT, GPTConfig
from errors import UserError
from objective import Objective, Trained
from utils import available_memory

GiB = 2 ** 30
# on the CPU, glibc's heap: this fraction of the step's transient
# tensors on top of their peak (docs/performance.md)
CPU_HEAP_ALLOWANCE = {"one process": 0.2, "torchrun": 0.8}

# GiB of each GPU as nvidia-smi reports it (80 GB A100, SXM parts)
GPU_MEMORY_GIB = {"H100": 79.6, "H200": 140.4, "H800": 79.6, "A100": 80.0,
                  "A800": 80.0, "L40S": 45.0, "A10G": 22.5, "4090": 24.0}
# the share of it batch_size='auto' fills (docs/performance.md)
AUTO_BATCH_MEMORY = 0.9


def meta_model(config, vocab):
    """(model, objective) of the config on the meta device: shapes, no
    memory."""
    with torch.device("meta"):
        model = GPT(GPTConfig.from_config(config, vocab))
        return model, Objective.from_config(config)


class PeakTensorBytes(TorchDispatchMode):
    """The peak bytes of the tensors created under it, while they
    live; a storage counts once, however many views it has."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # meta tensors have no address
            if key not in self.storages:
                self.storages.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key, nbytes):
        self.live -= nbytes
        self.storages.discard(key)


class FlashAttentionOnMeta(TorchFunctionMode):
    """A causal attention on meta runs the CPU flash kernel's meta
    function, not the math form that holds the T x T scores flash
    kernels never do: the step holds what it holds on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                  **kwargs):
        plain = attn_mask is None and is_causal and not kwargs
        if q.device.type == "meta" and plain:
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(q, k, v, dropout_p, True)[0]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, **kwargs)


def compute_dtype(config):
    """The dtype a run's activations are stored in: on a GPU bf16
    (also for 'auto'), fp16 or float32; float32 elsewhere (an upper
    bound for a CPU run under bf16)."""
    if not str(config.get("device", "")).startswith("cuda"):
        return torch.float32
    dtypes = {"float32": torch.float32, "float16": torch.float16}
    return dtypes.get(config.get("dtype"), torch.bfloat16)


def objective_on_blocks(config, n_layer):
    """The run's objective on its model cut to n_layer blocks: a loss
    that reads block l's state (simreg_layer, nitp_layer) reads the
    cut model's last block when l is beyond it (the same shape)."""
    cut = {"n_layer": n_layer}
    if config.get("simreg_layer", -1) > n_layer:
        cut["simreg_layer"] = n_layer
    if config.get("nitp_layer", 0) > n_layer:
        cut["nitp_layer"] = n_layer
    return Objective.from_config({**config, **cut})


def step_peak_bytes(config, model_config, n_layer, batch_size, seq_len,
                    device="meta"):
    """Peak bytes of the tensors one training micro-step creates
    (forward, the run's objective, backward into existing gradients)
    with the model cut to n_layer blocks, in compute_dtype; on meta by
    default. Cached: a plan asks for the same step often."""
    scalars = (int, float, str, bool, type(None))
    keys = tuple(sorted((k, v) for k, v in config.items()
                        if isinstance(v, scalars)))
    model_keys = tuple(sorted(model_config.__dict__.items()))
    return _step_peak_bytes(keys, model_keys, n_layer, batch_size, seq_len,
                            device)


@functools.lru_cache(maxsize=64)
def _step_peak_bytes(config_items, model_config_items, n_layer, batch_size,
                     seq_len, device):
    config = dict(config_items)
    cfg = GPTConfig(**{**dict(model_config_items), "n_layer": n_layer,
                       "block_size": seq_len})
    with torch.device("meta"):
        model = GPT(cfg)
        objective = objective_on_blocks(config, n_layer)
    if device != "meta":
        model.to_empty(device=device)
        objective.to_empty(device=device)
    with torch.no_grad():
        for p in [*model.parameters(), *objective.parameters()]:
            # any finite value: a router sends each token to top_k
            # experts whatever the values
            p.fill_(0.02)
            # the gradients are the plan's states, not the step's
            p.grad = torch.zeros_like(p)
    x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=device)
    # in the compute dtype, as autocast's matmuls store the activations
    # (the weights' own memory is the plan's states, not the step's)
    model.to(compute_dtype(config))
    objective.to(compute_dtype(config))
    with FlashAttentionOnMeta(), PeakTensorBytes() as counter:
        loss, _, logits, hidden = Trained(model, objective)(x, x)
        loss.backward()
        del loss, logits, hidden
    return counter.peak


def activation_gib(config, model_config, batch_size, seq_len, device="meta"):
    """GiB of one micro-step's activations and transient buffers: act
    (all stored), act_ckpt (activation checkpointing: each block's input
    kept, one block recomputed at a time) and one block. Measured with 1
    and 2 blocks at the run's own batch and sequence length (why:
    docs/performance.md): the difference is one block, the rest is
    embedding, head, loss and the gradients' transients."""
    one, two = (step_peak_bytes(config, model_config, n, batch_size,
                                seq_len, device) for n in (1, 2))
    block = max(two - one, 0)
    rest = max(2 * one - two, 0)
    itemsize = compute_dtype(config).itemsize
    block_input = batch_size * seq_len * model_config.n_embd * itemsize
    L = model_config.n_layer
    return {"act": (rest + L * block) / GiB,
            "act_ckpt": (rest + L * block_input + block) / GiB,
            "block": block / GiB}


def gathered_bytes(config):
    """Bytes per parameter FSDP gathers (train.py's param_dtype)."""
    return 4 if config["dtype"] == "float32" else 2


def memory_by_mode(model, config, processes, micro_steps, measure=True):
    """GiB per GPU: {ddp, fsdp} x {plain, checkpointed}, and the parts
    they are made of. The states: 16 bytes per parameter (fp32 weights,
    gradients, AdamW's moments), 1/k of them under FSDP on k ranks
    (fsdp_shard_size = k: hybrid sharding), plus what DDP and FSDP hold
    besides (docs/parallelism.md). measure: True (on meta), False
    (activations NaN) or a device to measure them on."""
    n = model.num_params()
    group = shard_group(config, processes)
    # as FSDP holds them: padded where no dimension divides
    blocks, root = fsdp_units(model, group)
    padded = sum(blocks) + root
    largest = max(max(blocks), root)
    held = padded if config.get("fsdp_keep_gathered") else largest
    gathered = held * gathered_bytes(config)  # FSDP's mixed precision
    buckets = 4 if processes > 1 else 0
    accumulated = 4 * n if micro_steps > 1 else 0
    parts = {"ddp": (16 + buckets) * n / GiB,
             "fsdp": (16 * padded / group + gathered + largest * 4
                      + accumulated) / GiB}
    if not measure:
        parts.update(dict.fromkeys(("act", "act_ckpt", "block"), float("nan")))
    else:
        device = {} if measure is True else {"device": measure}
        parts.update(activation_gib(config, model.config, config["batch_size"],
                                    config["block_size"], **device))
    table = {mode: {"plain": parts[mode] + parts["act"],
                    "checkpointed": parts[mode] + parts["act_ckpt"]}
             for mode in ("ddp", "fsdp")}
    return table, parts


def held_numel(parameters, shards):
    """Elements of `parameters` as FSDP holds them on `shards` ranks:
    each padded where no dimension divides (the whole count on 1)."""
    return sum(parallelism.padded_numel(p.shape, shards) for p in parameters)


def fsdp_units(model, shards):
    """(elements of each block, of the root: embeddings, final norm, LM
    head) as FSDP holds them on `shards` ranks (held_numel). A tied
    matrix counts once."""
    blocks = [held_numel(block.parameters(), shards) for block in model.h]
    in_blocks = {id(p) for block in model.h for p in block.parameters()}
    root = held_numel((p for p in model.parameters()
                       if id(p) not in in_blocks), shards)
    return blocks, root


def shard_group(config, processes):
    """The processes FSDP shards the states over: all of them, or
    fsdp_shard_size's groups (hybrid sharding)."""
    k = config.get("fsdp_shard_size", 0)
    return k if 0 < k < processes else processes


def micro_steps_of(config, processes):
    """Micro-steps per optimizer step on `processes` processes
    (global_batch_size fixes the batch)."""
    if config["global_batch_size"]:
        per_step = config["batch_size"] * processes
        return config["global_batch_size"] // per_step
    return config["gradient_accumulation_steps"]


def process_gib(config, processes, vocab, measure=True, heap=0.0):
    """(GiB one process of the run needs, GiB of its weights, gradients
    and optimizer states): the plan's memory for the run's own parallel
    mode and activation checkpointing, plus `heap` times the step's
    transient tensors (CPU_HEAP_ALLOWANCE on the CPU)."""
    model, _ = meta_model(config, vocab)
    mode = "fsdp" if config["parallel"] == "fsdp" else "ddp"
    micro_steps = micro_steps_of(config, processes)
    table, parts = memory_by_mode(model, config, processes, micro_steps,
                                  measure)
    ckpt = config["activation_checkpointing"]
    tensors = table[mode]["checkpointed" if ckpt else "plain"]
    return tensors + heap * (tensors - parts[mode]), parts[mode]


def memory_problem(config, processes, vocab, available_gib, where, heap=0.0):
    """None when the run fits in available_gib per process, else one
    line: what it needs, what `where` has, and what would fit:
    activation checkpointing, a smaller batch_size (more micro-steps
    when global_batch_size fixes the batch), or FSDP on N processes of
    this memory. heap: process_gib's."""
    need = process_gib(config, processes, vocab, heap=heap)[0]
    if need <= available_gib:
        return None

    def fits(**changes):
        changed = {**config, **changes}
        n = changed.pop("processes", processes)
        return process_gib(changed, n, vocab, heap=heap)[0] <= available_gib

    options = []
    ckpt = {"activation_checkpointing": True}
    if not config["activation_checkpointing"] and fits(**ckpt):
        options.append("--activation_checkpointing=True")
    global_batch = config["global_batch_size"]
    batch = config["batch_size"] // 2
    while batch >= 1 and not options:
        whole = not global_batch or global_batch % (batch * processes) == 0
        if whole and fits(batch_size=batch):
            options.append(f"--batch_size={batch}")
        batch //= 2
    # FSDP on more processes: as configured, with activation
    # checkpointing, and without keeping the weights gathered over the
    # step (the whole model per GPU, however many processes there are)
    variants = [{}, ckpt]
    if config.get("fsdp_keep_gathered"):
        variants += [{**v, "fsdp_keep_gathered": False} for v in variants]

    def fsdp_fits(n):
        return next((v for v in variants
                     if fits(parallel="fsdp", processes=n, **v)), None)
    n = 2 * processes
    while n <= 4096 and ((global_batch
                          and global_batch % (config["batch_size"] * n))
                         or fsdp_fits(n) is None):
        n *= 2
    if n <= 4096:
        flags = "".join(f" --{k}={v}" for k, v in fsdp_fits(n).items())
        options.append(f"--parallel=fsdp{flags} on {n} processes "
                       f"(torchrun) of {available_gib:.1f} GiB each")
    would = "; nothing the plan tries fits"
    if options:
        would = "; it would fit with " + ", or with ".join(options)
    what = "weights, gradients, AdamW states and activations"
    return (f"this run needs {need:.1f} GiB per process ({what}; "
            "`python plan.py <config>` gives the parts) but "
            f"{where} has {available_gib:.1f} GiB{would}; "
            "to start it anyway: --check_memory=False")


def resolve_batch_size(config, processes, vocab, available_gib, heap=0.0):
    """(config, whether its batch fits). batch_size='auto' becomes the
    largest divisor of each process's share of global_batch_size whose
    plan fits AUTO_BATCH_MEMORY of available_gib; where none fits, 1,
    which the memory check then refuses with what would fit."""
    if config["batch_size"] != "auto":
        return config, True
    budget = available_gib * AUTO_BATCH_MEMORY
    share = config["global_batch_size"] // processes
    for batch in (b for b in range(share, 0, -1) if share % b == 0):
        changed = {**config, "batch_size": batch}
        # the states alone may not fit (FSDP's whole gradient: fewer
        # micro-steps may drop it)
        states = process_gib(changed, processes, vocab, measure=False)[1]
        if states > budget:
            continue
        if process_gib(changed, processes, vocab, heap=heap)[0] <= budget:
            return changed, True
    return {**config, "batch_size": 1}, False


def cpu_heap_allowance(processes):
    """CPU_HEAP_ALLOWANCE for this many processes."""
    return CPU_HEAP_ALLOWANCE["torchrun" if processes > 1 else "one process"]


def device_memory(device, processes):
    """(GiB `device` has for this process, the heap allowance (on the
    CPU only), where the GiB figure comes from)."""
    available, source = available_memory(device)
    heap = 0.0
    if torch.device(device).type == "cpu":
        heap = cpu_heap_allowance(processes)
    return available / GiB, heap, source


def device_batch_size(config, processes, vocab, device):
    """resolve_batch_size's batch_size against what `device` has for
    this process."""
    available, heap, _ = device_memory(device, processes)
    config = {**config, "device": device}  # the step on this device
    resolved, _ = resolve_batch_size(config, processes, vocab, available, heap)
    return resolved["batch_size"]


def device_memory_problem(config, processes, vocab, device):
    """memory_problem against what `device` has for this process."""
    available, heap, source = device_memory(device, processes)
    config = {**config, "device": device}
    return memory_problem(config, processes, vocab, available,
                          f"{device} ({source})", heap)


def auto_batch_size(config, processes, vocab, device, master):
    """batch_size='auto': device_batch_size on every process, the
    smallest that any found, so all run alike (1 where not even one
    sequence fits: check_fits says why); rank 0 (master) says so."""
    found = device_batch_size(config, processes, vocab, device)
    batch_size = min(parallelism.gather_objects(found))
    if master:
        print(f"batch_size='auto': {batch_size} sequences per process "
              f"and micro-step on {device}")
    return batch_size


def check_fits(config, processes, vocab, device):
    """A UserError, before anything is allocated, when the plan's memory
    for this process does not fit in what the device has; rank 0 says
    it for every rank."""
    if problem := device_memory_problem(config, processes, vocab, device):
        raise UserError(problem, agreed=True)
