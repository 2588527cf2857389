"""
Data parallelism (DDP, FSDP2), applied to the model from outside
(torchtitan style): init_distributed, parallelize, gradient_sync and
the collectives train.py needs. Design notes: docs/parallelism.md.
"""

import contextlib
import datetime
import functools
import gc
import math
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

from errors import UsageError
from model import fill_parameters
from utils import launched


def init_distributed(device_type, timeout_s=None):
    """Join torchrun's process group (nccl on CUDA, gloo on CPU), whose
    collectives give up after timeout_s (None: torch's 30 minutes);
    returns (rank, local_rank, world_size). Without torchrun: a group
    of one, so that `--parallel=fsdp` runs the same code."""
    global _host_group
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0,
                                world_size=1)
        return 0, 0, 1
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    # WORLD_SIZE set by hand: the rendezvous would fail, or wait forever
    if missing:
        raise UsageError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but "
            f"{', '.join(missing)} not: start the processes with torchrun "
            f"(torchrun --nproc_per_node=N train.py ...), which sets them "
            f"all")
    check_rendezvous_address(os.environ["MASTER_ADDR"],
                             os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    dist.init_process_group(backend, timeout=timeout)
    if backend != "gloo":  # the stop vote: on the host, no device sync
        _host_group = dist.new_group(backend="gloo", timeout=timeout)
    return dist.get_rank(), launched("LOCAL_RANK", 0), dist.get_world_size()


def check_rendezvous_address(host, port):
    """One line for a MASTER_ADDR or MASTER_PORT set by hand to nonsense;
    torch would retry the connection until its timeout."""
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise UsageError(f"environment variable MASTER_PORT must be a port "
                         f"number (1-65535; torchrun sets it), got {port!r}")
    try:
        socket.getaddrinfo(host, int(port))
    except OSError as e:
        raise UsageError(f"environment variable MASTER_ADDR={host!r} is no "
                         f"address this machine can reach ({e.strerror}); "
                         f"torchrun sets it") from None


def apply_activation_checkpointing(model):
    """Recompute each block's activations in backward (~1/3 more
    compute); the blocks are wrapped in place, keeping their keys."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper \
        import checkpoint_wrapper  # non-reentrant
    for i, block in enumerate(model.h):
        model.h[i] = checkpoint_wrapper(block)


def compile_blocks(model, backend="inductor", fullgraph=False):
    """torch.compile each block in place (the state-dict keys stay),
    block by block for activation checkpointing and FSDP."""
    for block in model.h:
        block.compile(backend=backend, fullgraph=fullgraph)


def parallelize(trained, parallel, device, param_dtype=None,
                unused_parameters=False, weights=None, keep_gathered=False,
                shard_size=0):
    """Apply `parallel` ('none' | 'ddp' | 'fsdp') to `trained`
    (objective.Trained: its model, and its objective if that has
    parameters). Returns the wrapper the training step's forward runs
    through (DDP's; FSDP2 shards `trained` in place and returns it);
    all else uses `trained`. Modules built on meta are materialised
    here, then given `weights`.

    param_dtype: FSDP2's all-gather dtype (gradients reduced in fp32).
    unused_parameters: some parameters may get no gradient on a rank.
    keep_gathered (fsdp): a block's weights stay gathered from its first
        forward to the step's last backward.
    shard_size (fsdp): 0 shards over every process; k over groups of k
        consecutive ranks, replicated across the groups."""
    model = trained.model
    objective = trained.objective
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and parallel != "fsdp":
        materialize(trained, device, weights)
    if parallel == "none":
        return trained
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        cuda = device.startswith("cuda")
        return DDP(trained,
                   device_ids=[torch.device(device).index] if cuda else None,
                   find_unused_parameters=unused_parameters)
    assert parallel == "fsdp", parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    world = dist.get_world_size()
    mesh_device = "cuda" if device.startswith("cuda") else "cpu"
    if shard_size and shard_size < world:
        # FSDP2 over a 2-D (replicate, shard) mesh is hybrid sharding
        mesh = init_device_mesh(mesh_device, (world // shard_size, shard_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(mesh_device, (world,))
    shards = mesh.size(mesh.ndim - 1)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32)
    shard = functools.partial(
        fully_shard, mesh=mesh,
        shard_placement_fn=lambda p: Shard(shard_dim(p.shape, shards)))
    for block in model.h:
        shard(block, mp_policy=policy,
              reshard_after_forward=not keep_gathered)
    # a root stays gathered from forward to backward (losses.cwt)
    shard(model, mp_policy=policy)
    named = [*model.named_parameters(), *objective.named_parameters()]
    note = padding_note(named, shards)
    if note and dist.get_rank() == 0:
        print(note, flush=True)
    has_params = any(p.requires_grad for p in objective.parameters())
    if has_params:
        # its own root, taking float32 logits and states as they are
        shard(objective, mp_policy=MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32,
            cast_forward_inputs=False))
    if on_meta:
        materialize(trained, device, weights)
    if unused_parameters:
        from torch.distributed.fsdp import FSDPModule
        modules = (model, objective) if has_params else (model,)
        # torch >= 2.13
        if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
            for module in modules:
                module.set_reduce_scatter_unused_params(True)
        else:
            zero_gradients_for_unused(*modules)
    return trained


@torch.no_grad()
def materialize(trained, device, weights=None):
    """Allocate the meta-built model and objective on `device`, draw
    their weights as one process does (FSDP2's a parameter at a time),
    then copy the model's `weights` ({name: whole tensor}, or a
    loader) in."""
    trained.to_empty(device=device)
    model = trained.model
    objective = trained.objective
    sharded = any(hasattr(p, "to_local") for p in model.parameters())
    fill = fill_sharded if sharded else fill_parameters
    if not sharded:
        # to_empty() un-shares the tied tensor of a plain module
        model.tie_weights()
    fill(model, model.initializers())
    draw_constructor_defaults(objective)
    fill(objective, objective.initializers())
    if callable(weights):  # e.g. checkpoint.load_shards_into
        weights(model)
    elif weights is not None and sharded:
        copy_shards(model, weights)
    elif weights is not None:
        model.load_state_dict(weights)


def draw_constructor_defaults(module):
    """Draw, and drop, the default init of module's nn.Linear layers
    on the CPU, as building them there did."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            # a plain twin: the layer itself may hold DTensors by now
            nn.Linear(layer.in_features, layer.out_features,
                      bias=layer.bias is not None, device="cpu")


def fill_sharded(module, initializers):
    """model.fill_parameters for an FSDP2 module: each full parameter
    filled by the same call, one at a time, this rank's rows kept."""
    parameters = dict(module.named_parameters())
    for name, fill in initializers:
        p = parameters[name]
        full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        fill(full)
        p.to_local().copy_(local_rows(full, p))
        del full


def copy_shards(module, weights):
    """load_state_dict(weights) for an FSDP2 module: each rank copies
    only its rows of each whole (memory-mapped) tensor."""
    state = module.state_dict()
    if state.keys() != weights.keys():
        raise ValueError(
            f"the starting weights do not fit the model: "
            f"missing {sorted(state.keys() - weights.keys())}, "
            f"unexpected {sorted(weights.keys() - state.keys())}")
    for name, p in state.items():
        p.to_local().copy_(local_rows(weights[name], p))


def sharded_mesh_dim(dtensor):
    """The one mesh dimension a DTensor is sharded over (the others
    Replicate), or None."""
    placements = dtensor.placements
    dims = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if len(dims) == 1 and placements[dims[0]].is_shard():
        return dims[0]
    return None


def local_part(tensor):
    """A DTensor's local shard, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_rows(full, sharded):
    """This rank's part of the whole tensor `full` as FSDP2 lays out the
    DTensor `sharded`: cut as torch.chunk cuts (the last ranks' fewer)."""
    mesh_dim = sharded_mesh_dim(sharded)
    assert mesh_dim is not None, sharded.placements
    dim = sharded.placements[mesh_dim].dim
    mesh = sharded.device_mesh
    size = -(-full.size(dim) // mesh.size(mesh_dim))
    start = mesh.get_local_rank(mesh_dim) * size
    return full[(slice(None),) * dim + (slice(start, start + size),)]


def shard_dim(shape, shards):
    """The dimension FSDP cuts a parameter of `shape` on over `shards`
    ranks: the first that `shards` divides (dim 0 if none: padded)."""
    if not shape:
        return 0
    return next((d for d, n in enumerate(shape) if n % shards == 0), 0)


def padded_numel(shape, shards):
    """Elements of a parameter as FSDP holds it over `shards` ranks (its
    sharded dimension padded to a multiple of them)."""
    if not shape:
        return shards  # a scalar: one element on every rank
    d = shard_dim(shape, shards)
    rows = -(-shape[d] // shards) * shards
    return math.prod(shape) // max(shape[d], 1) * rows


def padding_note(named_parameters, shards):
    """One line naming the parameters FSDP pads on `shards` ranks (no
    dimension divides), or None."""
    shapes = {name: p.shape for name, p in named_parameters}
    extra = {name: padded_numel(shape, shards) - math.prod(shape)
             for name, shape in shapes.items()}
    # the most padded first
    padded = sorted((n for n in extra if extra[n]), key=lambda n: -extra[n])
    if not padded:
        return None
    total = sum(p.numel() for _, p in named_parameters)
    names = ", ".join(f"{n} {list(shapes[n])}" for n in padded[:3])
    if len(padded) > 3:
        names += " ..."
    return (f"note: fsdp pads {len(padded)} parameters to a multiple of "
            f"{shards} ranks (no dimension divides: {names}): its "
            f"all-gathers and reduce-scatters move "
            f"{100 * sum(extra.values()) / total:.1f} % more than the weights")


def fsdp_unavailable(device):
    """Why parallel='fsdp' cannot run on `device` ('auto', 'cpu',
    'cuda:1', ...) with this torch, or None."""
    auto_cpu = device == "auto" and not torch.cuda.is_available()
    on_cpu = device == "cpu" or auto_cpu
    if on_cpu and not hasattr(torch.cpu.Stream, "record_event"):
        return (f"parallel='fsdp' on the CPU needs torch >= 2.7 (FSDP2 "
                f"records events on torch.cpu.Stream; this is torch "
                f"{torch.__version__}); use parallel='ddp' or a CUDA device")
    return None


def zero_gradients_for_unused(model, objective=None):
    """set_reduce_scatter_unused_params(True) for torch < 2.13: every
    parameter of each FSDP unit joins the graph with weight 0. Call
    after fully_shard."""
    def root_parameters():  # not the blocks': those are other units
        in_blocks = {id(p) for block in model.h for p in block.parameters()}
        return [p for p in model.parameters() if id(p) not in in_blocks]
    add_zero_term(model.wte, root_parameters)
    for block in model.h:
        add_zero_term(block, block.parameters)
    if objective is not None:
        add_zero_term(objective, objective.parameters)


def add_zero_term(module, parameters):
    """A forward hook, first in line, that adds 0 * the sum of
    parameters() to module's output (or to a tuple's first element)."""
    def hook(_module, _args, output):
        if not torch.is_grad_enabled():
            return output
        # float32 sums: a float16 sum could overflow, and 0 * inf is nan
        zero = 0.0 * sum(p.sum(dtype=torch.float32)
                         for p in parameters() if p.requires_grad)
        if isinstance(output, tuple):
            return (output[0] + zero, *output[1:])
        return output + zero
    module.register_forward_hook(hook, prepend=True)


def gradient_sync(wrapped, enabled, keep_gathered=False):
    """Context for one micro-step of parallelize's wrapper:
    enabled=False accumulates gradients locally, the step's last
    micro-step syncs. keep_gathered: FSDP2 reshards the weights after
    the last micro-step's backward only."""
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else wrapped.no_sync()
    for module in wrapped.children():  # the model, the objective
        if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            module.set_requires_gradient_sync(enabled)
            if keep_gathered:
                module.set_reshard_after_backward(enabled)
    return contextlib.nullcontext()


def world_size():
    """The number of processes in the group (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank():
    """This process's rank (0 without a group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def sum_over_processes(values):
    """The sum of a tensor over all ranks (a copy, but for one)."""
    if world_size() == 1:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values


def mean_over_processes(values):
    """The mean of a float tensor over all ranks."""
    if world_size() == 1:
        return values
    # SUM, then divide: gloo has no AVG
    return sum_over_processes(values) / world_size()


# NCCL runs: a gloo group beside it for votes on host values; gloo runs
# vote in the default group (None)
_host_group = None


def max_over_processes(number):
    """The largest of the ranks' whole numbers (a stop's signal, 0 for
    none) on every rank: one all-reduce on the host, no device sync.
    Every rank calls it at the same point."""
    if world_size() == 1:
        return int(number)
    vote = torch.tensor([int(number)])
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_host_group)
    return int(vote.item())


def from_rank_0(value):
    """Rank 0's value (any picklable object) on every rank: what rank 0
    alone decides (resume or start, from which checkpoint)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_finite(parameters, device):
    """Whether every weight on every rank is finite; one all-reduce."""
    local = all(bool(torch.isfinite(local_part(p)).all())
                for p in parameters)
    flag = torch.tensor([0.0 if local else 1.0], device=device)
    return mean_over_processes(flag).item() == 0


def gather_objects(value):
    """Every rank's value (picklable), in rank order, on every rank."""
    if world_size() == 1:
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def first_error(message):
    """The first rank's message that is not None, on every rank: what
    one rank found that all must act on together."""
    return next((m for m in gather_objects(message) if m is not None),
                None)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def shutdown():
    """Leave the process group at the end of a run, once the caller has
    dropped the sharded modules and their optimizer (why in this order:
    docs/parallelism.md)."""
    gc.collect()
    barrier()
    dist.destroy_process_group()
