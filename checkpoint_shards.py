"""A checkpoint's FSDP shards, written and read through
torch.distributed.checkpoint (DCP): they load back on any number of
ranks, or whole in one process. checkpoint.py says when and where.

Design notes: docs/runs.md
"""

import os
import pickle
import warnings

import torch

import parallelism
from errors import CheckpointError


def dcp():
    """torch.distributed.checkpoint with its state_dict helpers,
    imported on first use."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    return torch.distributed.checkpoint


def shard_errors():
    """What a failed DCP save or load raises."""
    return (dcp().api.CheckpointException, OSError, RuntimeError,
            EOFError, pickle.UnpicklingError)


def damaged_shards(directory):
    """Why the shards in directory cannot be read whole (an unreadable
    .metadata, a .distcp file missing or short), or None."""
    try:
        metadata = dcp().FileSystemReader(directory).read_metadata()
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
        return (f"cannot read the FSDP shards in {directory} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    expected = {}
    for item in metadata.storage_data.values():
        name = item.relative_path
        end = item.offset + item.length
        expected[name] = max(expected.get(name, 0), end)
    for name, size in sorted(expected.items()):
        shard = os.path.join(directory, name)
        if not os.path.isfile(shard):
            return f"the FSDP shard {shard} is missing"
        if os.path.getsize(shard) < size:
            return (f"the FSDP shard {shard} is truncated "
                    f"({os.path.getsize(shard):,} bytes of {size:,})")
    return None


def read_metadata(directory):
    """The shards' metadata; CheckpointError if they are damaged."""
    if problem := damaged_shards(directory):
        raise CheckpointError(problem)
    return dcp().FileSystemReader(directory).read_metadata()


def sharded_weights(directory, device="cpu"):
    """{'model': {name: tensor}, 'objective': {...}} from the shards in
    directory (no optimizer state, no model needed)."""
    metadata = read_metadata(directory)
    weights = {"model": {}, "objective": {}}
    for key, meta in metadata.state_dict_metadata.items():
        # "model.<module>.<parameter>"
        top, _, name = key.partition(".")
        module, _, name = name.partition(".")
        if top == "model" and module in weights and hasattr(meta, "size"):
            weights[module][name] = torch.empty(
                tuple(meta.size), dtype=meta.properties.dtype)
    if not weights["model"]:
        raise CheckpointError(f"{directory} holds no model weights")
    flat = {f"{module}.{name}": tensor for module, part in weights.items()
            for name, tensor in part.items()}
    with warnings.catch_warnings():
        # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp().load({"model": flat}, checkpoint_id=directory)
    return {module: {name: t.to(device) for name, t in part.items()}
            for module, part in weights.items()}


def load_shards_into(directory, head_from_embedding, model):
    """Read FSDP shards into an FSDP2 model in place, each rank its own
    rows; head_from_embedding: the LM head copies wte. Collective."""
    metadata = read_metadata(directory)
    stored = {key.removeprefix("model.model.")
              for key in metadata.state_dict_metadata
              if key.startswith("model.model.")}
    no_head = model.config.tie_weights or head_from_embedding
    wanted = {name: tensor for name, tensor in model.state_dict().items()
              if not (name == "lm_head.weight" and no_head)}
    if missing := sorted(wanted.keys() - stored):
        raise CheckpointError(
            f"the shards in {directory} hold no {', '.join(missing)}")
    state = {f"model.{name}": tensor for name, tensor in wanted.items()}
    dcp().load({"model": state}, checkpoint_id=directory)
    if head_from_embedding:
        with torch.no_grad():
            head = parallelism.local_part(model.lm_head.weight)
            head.copy_(parallelism.local_part(model.wte.weight))


def sharded_state(modules, optimizers, with_optimizers):
    """What DCP writes and reads; without optimizers before the first
    step (docs/runs.md)."""
    state_dict = dcp().state_dict
    if not with_optimizers:
        return {"model": state_dict.get_model_state_dict(modules)}
    model_state, optimizer_state = state_dict.get_state_dict(
        modules, optimizers)
    return {"model": model_state, "optimizers": optimizer_state}


def save_sharded(directory, modules, optimizers, with_optimizers=True):
    """Write the shards of modules (and optimizers); collective."""
    state = sharded_state(modules, optimizers, with_optimizers)
    dcp().save(state, checkpoint_id=directory)


def load_sharded(directory, modules, optimizers, with_optimizers=True):
    """Read back what save_sharded wrote, in place; collective."""
    state_dict = dcp().state_dict
    state = sharded_state(modules, optimizers, with_optimizers)
    dcp().load(state, checkpoint_id=directory)
    if with_optimizers:
        state_dict.set_state_dict(modules, optimizers,
                                  model_state_dict=state["model"],
                                  optim_state_dict=state["optimizers"])
    else:
        state_dict.set_model_state_dict(modules, state["model"])
