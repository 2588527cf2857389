"""
Data parallelism, applied to the model from outside (torchtitan style): model.py and losses.py
know nothing about it. train.py launched by torchrun (which sets RANK, LOCAL_RANK, WORLD_SIZE)

    torchrun --nproc_per_node=8 train.py config/baseline_1b3.py

uses these pieces in this order:

    rank, local_rank, world_size = init_distributed(device_type)
    train_model, train_objective = parallelize(model, objective, parallel, ...)   # built on meta
    with gradient_sync((train_model, train_objective), enabled=last_micro_step): forward, backward

    ddp    every rank holds the whole model; gradients are averaged by all-reduce in backward
    fsdp   FSDP2 (fully_shard): every block, then the root, is sharded over the ranks; a block's
           parameters are all-gathered just before it runs and its gradients reduce-scattered
           right after its backward, so each rank keeps 1/world of the weights, gradients and
           AdamW moments; fsdp_shard_size = k (hybrid sharding) shards over each group of k
           ranks, a node, and replicates across the groups, keeping those collectives on the node;
           each parameter is cut on a dimension that the ranks divide (shard_dim), so a MoE's 8
           stacked experts on 64 ranks are cut on their hidden dimension, not padded to 64 rows

Sharded initialisation (torchtitan's recipe, made exact): train.py builds the model and the
objective on the meta device and parallelize materialises them. Under fsdp, fully_shard goes on
the meta modules and to_empty allocates only each rank's shards; then every parameter, in the
order the one-process init draws its random numbers (GPT.initializers), is filled as a whole
tensor on the device with the same calls and this rank's rows are kept. No process holds more
than its shards plus one parameter's full weights, and the gathered model is the one-process
model bit for bit. Starting weights (init_from) are copied the same way, shard by shard, from a
checkpoint mapped into memory.

Only data is split across ranks; every loss in losses.py is computed per rank on its own
micro-batch and the gradients are averaged, exactly like gradient accumulation. SimReg and
dispersion are per sequence and need nothing from other ranks. CWT's negatives are the positions
of the micro-batch (per rank), as they are per micro-step with accumulation: no gathering, so the
loss does not change with the number of GPUs as long as batch_size does.
"""

import contextlib
import functools
import gc
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from errors import UsageError
from model import fill_parameters
from utils import launched


def init_distributed(device_type):
    """Join the process group torchrun describes in the environment (nccl on CUDA, gloo on CPU)
    and return (rank, local_rank, world_size). Without torchrun (no WORLD_SIZE) it makes a group
    of one process, so `python train.py ... --parallel=fsdp` runs (and tests) the same code."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return 0, 0, 1
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:  # WORLD_SIZE set by hand: the rendezvous would fail with a traceback, or wait
        raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} not: start "
                         f"the processes with torchrun (torchrun --nproc_per_node=N train.py ...), which "
                         f"sets them all")
    dist.init_process_group(backend)
    return dist.get_rank(), launched("LOCAL_RANK", 0), dist.get_world_size()


def apply_activation_checkpointing(model):
    """Recompute each block's activations in backward instead of storing them: one block's
    worth of activations alive at a time, for ~1/3 more compute. Each block of model.h is
    replaced in place, so GPT.forward still collects every block's output; the wrapper keeps
    the state-dict keys of the unwrapped block, so checkpoints are unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.h):
        model.h[i] = checkpoint_wrapper(block)  # non-reentrant torch.utils.checkpoint


def compile_blocks(model, backend="inductor", fullgraph=False):
    """torch.compile every block in place (nn.Module.compile: the state-dict keys stay the same):
    the block's matmuls, norms and pointwise ops are fused into fewer kernels. Block by block,
    not the whole model, so that activation checkpointing and FSDP (both applied after) keep
    working per block, and a compiled block is reused by all the identical ones. fullgraph=True:
    a graph break is an error instead of a silent split (tools/gpu_check.py checks every block so)."""
    for block in model.h:
        block.compile(backend=backend, fullgraph=fullgraph)


def parallelize(model, objective, parallel, device, param_dtype=None, unused_parameters=False, weights=None,
                keep_gathered=False, shard_size=0):
    """Apply `parallel` ('none' | 'ddp' | 'fsdp') to the model and to the objective if it has
    parameters (NITP's head). Returns (train_model, train_objective): the callables the training
    step runs forward through. Everything else (evaluation, the optimizer, checkpoints) uses
    `model` and `objective` themselves, which FSDP2 shards in place and DDP leaves as they are.

    Modules built on the meta device are materialised on `device` and initialised here (whole, or
    shard by shard under fsdp), then given `weights` ({name: tensor} of the whole model, e.g.
    checkpoint.starting_weights) if not None; modules already materialised are kept as they are.

    param_dtype: FSDP2 all-gathers the weights in this dtype for compute (bf16 on GPU) and
        reduces gradients in float32; None = float32 throughout.
    unused_parameters: some parameters may get no gradient on some ranks (a headless untied run
        never uses its LM head), which
        DDP and FSDP must be told, or the ranks wait on each other forever. FSDP then reduces
        zeros for them: a parameter that no rank used gets a zero gradient rather than none
        (AdamW still decays it), unlike in a single process.
    keep_gathered (fsdp): a block's weights, once gathered in its forward, stay gathered through its
        backward and the step's later micro-steps (gradient_sync reshards them after the last
        backward): one all-gather per block per optimizer step instead of two per micro-step, for
        the whole model's weights in the compute dtype on every GPU (memory.memory_by_mode counts both).
    shard_size (fsdp): 0 shards over every process; k shards over groups of k consecutive ranks (a
        node: torchrun numbers a node's processes consecutively) and replicates the shards across
        the world / k groups (hybrid sharding, HSDP): the all-gathers and reduce-scatters stay
        inside a group, and only the group's gradient shards are all-reduced between groups."""
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and parallel != "fsdp":
        materialize(model, objective, device, weights)
    if parallel == "none":
        return model, objective
    has_params = any(p.requires_grad for p in objective.parameters())
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        device_ids = [torch.device(device).index] if device.startswith("cuda") else None
        wrap = lambda m: DDP(m, device_ids=device_ids, find_unused_parameters=unused_parameters)  # noqa: E731
        return wrap(model), (wrap(objective) if has_params else objective)
    assert parallel == "fsdp", parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    world, mesh_device = dist.get_world_size(), "cuda" if device.startswith("cuda") else "cpu"
    if shard_size and shard_size < world:  # (replicate, shard): FSDP2 over a 2-D mesh is hybrid sharding
        mesh = init_device_mesh(mesh_device, (world // shard_size, shard_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(mesh_device, (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shards = mesh.size(mesh.ndim - 1)
    def placement(p):  # each parameter cut on a dimension the shard count divides, where one does
        return Shard(shard_dim(p.shape, shards))
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep_gathered,
                    shard_placement_fn=placement)
    # the root holds the embeddings, ln_f and the LM head; FSDP2 keeps a root's parameters
    # unsharded from its forward to its backward, which is why losses.cwt can use
    # model.input_embedding() (the gathered wte) after the forward pass
    fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    if (note := padding_note([*model.named_parameters(), *objective.named_parameters()], shards)) \
            and dist.get_rank() == 0:
        print(note, flush=True)
    if has_params:  # the objective is its own root; it gets float32 logits and states as they are
        fully_shard(objective, mesh=mesh, shard_placement_fn=placement,
                    mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False))
    if on_meta:
        materialize(model, objective, device, weights)
    if unused_parameters:
        from torch.distributed.fsdp import FSDPModule
        if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):  # torch >= 2.13
            for module in (model, objective) if has_params else (model,):
                module.set_reduce_scatter_unused_params(True)
        else:
            zero_gradients_for_unused(model, objective if has_params else None)
    return model, objective


@torch.no_grad()
def materialize(model, objective, device, weights=None):
    """Allocate the meta-built model and objective on `device` and initialise them as a one-process
    run does: the model's draws, then those an eagerly built objective made in its constructor,
    then the objective's init; then copy in `weights` ({name: whole tensor}, or a function that
    loads the model itself). Plain modules are filled whole, FSDP2 modules (parameters that are
    DTensors) one full parameter at a time, keeping this rank's shard."""
    model.to_empty(device=device)
    objective.to_empty(device=device)
    sharded = any(hasattr(p, "to_local") for p in model.parameters())
    fill = fill_sharded if sharded else fill_parameters
    if not sharded:
        model.tie_weights()  # to_empty() un-shares the tied tensor of a plain module
    fill(model, model.initializers())
    draw_constructor_defaults(objective)
    fill(objective, objective.initializers())
    if callable(weights):  # a reader that fills the sharded model itself (checkpoint.load_shards_into)
        weights(model)
    elif weights is not None:
        if sharded:
            copy_shards(model, weights)
        else:
            model.load_state_dict(weights)


def draw_constructor_defaults(module):
    """Draw, and drop, the random numbers that building module's nn.Linear layers off the meta device
    draws (their default init, on the CPU generator), one layer at a time: the objective was built
    on the CPU before sharded initialisation, so its init and every later random number stay what
    they were (archived CPU runs with a NITP head reproduce)."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):  # a plain twin: the layer itself may hold DTensors by now
            nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="cpu")


def fill_sharded(module, initializers):
    """model.fill_parameters for an FSDP2 module: each parameter's full tensor is filled on its
    device by the same call, its rows of this rank kept, and freed before the next one."""
    parameters = dict(module.named_parameters())
    for name, fill in initializers:
        p = parameters[name]
        full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        fill(full)
        p.to_local().copy_(local_rows(full, p))
        del full


def copy_shards(module, weights):
    """load_state_dict(weights) for an FSDP2 module: each rank copies only its rows of each whole
    tensor (of a memory-mapped checkpoint: only those pages are read), in state-dict order."""
    state = module.state_dict()
    if state.keys() != weights.keys():
        raise ValueError(f"the starting weights do not fit the model: "
                         f"missing {sorted(state.keys() - weights.keys())}, "
                         f"unexpected {sorted(weights.keys() - state.keys())}")
    for name, p in state.items():
        p.to_local().copy_(local_rows(weights[name], p))


def local_rows(full, sharded):
    """This rank's part of the whole tensor `full` as FSDP2 lays out the DTensor `sharded`: its
    sharded dimension (shard_dim) cut as torch.chunk cuts it (ceil(n / shards) each, the last ranks'
    fewer or none), over the mesh's one sharded dimension (hybrid sharding: the other one replicates)."""
    (mesh_dim,) = [i for i, placement in enumerate(sharded.placements) if not placement.is_replicate()]
    placement = sharded.placements[mesh_dim]
    assert placement.is_shard(), sharded.placements
    size = -(-full.size(placement.dim) // sharded.device_mesh.size(mesh_dim))
    start = sharded.device_mesh.get_local_rank(mesh_dim) * size
    return full[(slice(None),) * placement.dim + (slice(start, start + size),)]


# FSDP2 cuts a parameter on dim 0 and pads it to a multiple of the ranks: a MoE's (8, hidden, C)
# experts on 64 ranks would be 8 rows on 8 ranks and none on 56, each all-gather 8x the weights.
# fully_shard's shard_placement_fn (torch >= 2.6, the floor of requirements.txt) cuts another
# dimension, which must divide evenly.
def shard_dim(shape, shards):
    """The dimension FSDP cuts a parameter of `shape` on over `shards` ranks: 0 where `shards`
    divides it (FSDP2's own), else the first dimension that it divides (the hidden dimension of
    stacked experts), else 0, padded."""
    if not shape:
        return 0
    return next((d for d, n in enumerate(shape) if n % shards == 0), 0)


def padded_numel(shape, shards):
    """Elements of a parameter as FSDP holds it over `shards` ranks: its sharded dimension rounded
    up to a multiple of the ranks (what each all-gather and reduce-scatter moves, and shards x what
    each rank stores)."""
    if not shape:
        return shards  # a scalar: one element on every rank
    d = shard_dim(shape, shards)
    return math.prod(shape) // max(shape[d], 1) * (-(-shape[d] // shards) * shards)


def padding_note(named_parameters, shards):
    """One line when FSDP on `shards` ranks pads some parameters (no dimension of theirs divides),
    else None."""
    extra = {name: (padded_numel(p.shape, shards) - p.numel(), list(p.shape)) for name, p in named_parameters}
    padded = sorted(((e, name, shape) for name, (e, shape) in extra.items() if e), key=lambda x: -x[0])
    if not padded:
        return None
    total = sum(p.numel() for _, p in named_parameters)
    extra = sum(e for e, _, _ in padded)
    # the most padded
    names = ", ".join(f"{n} {s}" for _, n, s in padded[:3]) + (" ..." if len(padded) > 3 else "")
    return (f"note: fsdp pads {len(padded)} parameters to a multiple of {shards} ranks "
            f"(no dimension divides: {names}): "
            f"its all-gathers and reduce-scatters move {100 * extra / total:.1f} % more than the weights")


def fsdp_unavailable(device):
    """Why parallel='fsdp' cannot run on `device` ('auto', 'cpu', 'cuda:1', ...) with this torch, in
    one line, or None. FSDP2 orders its collectives with streams and events; on the CPU (gloo)
    those are torch.cpu.Stream's no-ops, and record_event / wait_event came in torch 2.7."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and not hasattr(torch.cpu.Stream, "record_event"):
        return (f"parallel='fsdp' on the CPU needs torch >= 2.7 (FSDP2 records events on torch.cpu.Stream; "
                f"this is torch {torch.__version__}); use parallel='ddp' or a CUDA device")
    return None


def zero_gradients_for_unused(model, objective=None):
    """What torch < 2.13 needs instead of FSDPModule.set_reduce_scatter_unused_params(True): every
    parameter of each FSDP unit takes part in the graph with weight 0, so a parameter the step did
    not use gets a zero gradient from autograd and every rank reduce-scatters the same tensors (the
    same zeros the newer API reduces). Call after fully_shard. The zero is added while the unit's
    parameters are gathered: to each block's output (the hook goes before FSDP's post-forward hook,
    which reshards them), to the token embedding for the root's own parameters (every loss depends
    on it; the root's post-backward runs after the whole backward), and to the objective's loss.
    In backward autograd runs the term's nodes, created last, before the unit's own, so the zeros
    are in place when FSDP's post-backward collects the gradients. x + 0 is x: the run is the
    newer API's, bit for bit (tests/test_distributed.py checks both against the unwrapped model)."""
    def root_parameters():  # the model's own: not its blocks' (those are other units, maybe resharded)
        in_blocks = {id(p) for block in model.h for p in block.parameters()}
        return [p for p in model.parameters() if id(p) not in in_blocks]
    add_zero_term(model.wte, root_parameters)
    for block in model.h:
        add_zero_term(block, block.parameters)
    if objective is not None:
        add_zero_term(objective, objective.parameters)


def add_zero_term(module, parameters):
    """A forward hook on module, first in line: 0 * (the sum of parameters()) added to its output
    (or to the first element of a tuple), so each of them gets a gradient, zero unless used."""
    def hook(_module, _args, output):
        if not torch.is_grad_enabled():
            return output
        # float32 sums: a float16 sum of a large weight could overflow, and 0 * inf is nan
        zero = 0.0 * sum(p.sum(dtype=torch.float32) for p in parameters() if p.requires_grad)
        return (output[0] + zero, *output[1:]) if isinstance(output, tuple) else output + zero
    module.register_forward_hook(hook, prepend=True)


def gradient_sync(modules, enabled, keep_gathered=False):
    """Context for one micro-step's forward and backward: with enabled=False gradients only
    accumulate locally (no communication); the last micro-step of an optimizer step syncs.
    FSDP2 then holds full-size (unsharded) float32 gradients between micro-steps: it trades
    memory for communication. keep_gathered (parallelize's): FSDP2 reshards the weights only
    after the last micro-step's backward, so the others gather nothing."""
    stack = contextlib.ExitStack()
    for module in modules:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            if not enabled:
                stack.enter_context(module.no_sync())
        elif hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module
            module.set_requires_gradient_sync(enabled)
            if keep_gathered:
                module.set_reshard_after_backward(enabled)
    return stack


def world_size():
    """The number of processes in the group (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def sum_over_processes(values):
    """The sum of a tensor over all ranks (a copy; the tensor itself on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values


def mean_over_processes(values):
    """The mean of a float tensor over all ranks (for logging: the loss of the global batch)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    return sum_over_processes(values) / dist.get_world_size()  # SUM then divide: gloo has no AVG


def rank():
    """This process's rank (0 without a group)."""
    return dist.get_rank() if dist.is_initialized() else 0


@functools.cache
def _host_group():
    """A gloo group over the same ranks beside NCCL's, for votes on host values (None where the
    default group is gloo already)."""
    return dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None


def max_over_processes(number):
    """The largest of the ranks' whole numbers (a stop's signal number, 0 for none), the same answer
    on every rank: one all-reduce of one number on the host (a gloo group beside NCCL) whatever the
    device, so it costs no device sync and can run every step. Collective: every rank calls it at
    the same point; int(number) on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return int(number)
    vote = torch.tensor([int(number)])
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_host_group())
    return int(vote.item())


def from_rank_0(value):
    """Rank 0's value (any picklable object) on every rank, whatever the others hold: what rank 0
    alone decides (resume or start, from which checkpoint). One broadcast; value on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_finite(parameters, device):
    """Whether every weight on every rank is finite (each rank looks at its own shards); one
    all-reduce."""
    local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in parameters)
    return mean_over_processes(torch.tensor([0.0 if local else 1.0], device=device)).item() == 0


def gather_objects(value):
    """Every rank's value (any picklable object), in rank order, on every rank; [value] on one
    process. One all_gather_object."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def first_error(message):
    """The first rank's message among every rank's (None where a rank found nothing wrong), on every
    rank: what one rank found (a failed write, a lock rank 0 could not take) that all must act on
    together, or the others would wait in their next collective."""
    return next((m for m in gather_objects(message) if m is not None), None)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def shutdown():
    """Leave the process group at the end of a run, once the caller has dropped its references
    to the sharded modules and their optimizer. Why the order matters: FSDP's modules can hold
    handles of collective work (and the tensors they read); if those are still alive when the
    interpreter exits, gloo frees them during its teardown and can abort a run that has finished
    and saved everything ("terminate called without an active exception", observed on a 2-process
    gloo FSDP run). Collecting them first, then a barrier so that no rank closes its connections
    while another still talks, then destroying the group, ends every rank cleanly."""
    gc.collect()
    barrier()
    dist.destroy_process_group()
