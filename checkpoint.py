"""What a checkpoint holds and how it is written and read, so that no crash or full disk can leave a
run without a good checkpoint (run.py decides when and where a run writes them).

    ckpt.pt    the full state: weights, optimizer, step, data and RNG state (run_state, TrainingState)
    best.pt    the weights alone (save_weights)
Every .pt has a readable .json beside it (config, step, losses). Under FSDP every rank writes its
own shards with torch.distributed.checkpoint (DCP; save_sharded, load_sharded): the full state
into ckpt_dcp/<slot>/ and ckpt.pt names the slot; best.pt's weights into best_dcp/step_<iter>/.

Writes go to a temporary file that is renamed into place (utils.atomic_write), so a kill at any
moment leaves either the old or the new file, never half of one. Every function takes what it
needs as arguments; errors a user can fix are raised as CheckpointError with one line naming the file.
"""

import functools
import json
import os
import pickle
import shutil
import zipfile

import torch

import parallelism
from data import DataError, dataset_mismatch, read_meta
from errors import UsageError, UserError
from model import GPTConfig
from utils import atomic_write, save_json, torch_save, write_failure

DCP_SLOTS = ("a", "b", "c")  # FSDP shard folders of ckpt.pt: latest, previous, being written (save_full)
BEST_DCP = "best_dcp"  # FSDP: the shards of best.pt (save_weights)


class CheckpointError(UserError):
    """A checkpoint that cannot be read, written or used here: one line naming it."""


def load(path, device="cpu", need=("model_config", "config", "iter_num"), mmap=False):
    """torch.load with weights_only=True (our checkpoints hold only tensors and plain containers),
    and one clear error for a missing, truncated, empty or foreign file. mmap: the tensors stay in
    the file, mapped into memory (on the CPU), and only the pages a reader touches are read."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a checkpoint file "
                              f"(e.g. {os.path.join(path, 'best.pt')})")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {path} ({os.path.getsize(path):,} bytes, "
                              f"{type(e).__name__}): it is truncated, empty or not a PyTorch "
                              f"checkpoint") from None
    missing = [key for key in need if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise CheckpointError(f"{path} is not a checkpoint written by train.py "
                              f"(no {', '.join(map(repr, missing))})")
    check_expert_layout(checkpoint.get("model", {}), path)
    return checkpoint


def check_expert_layout(weights, path):
    """A mixture of experts written before issue 31 held one module per expert
    (h.0.mlp.experts.3.gate.weight); the model now stacks them (h.0.mlp.gate, (E, hidden, C)) and
    does not read the old layout."""
    old = next((name for name in weights if ".mlp.experts." in name), None)
    if old:
        raise CheckpointError(f"{path} holds a mixture of experts in the old per-expert layout ({old}); "
                              f"this version stacks the experts (mlp.gate, mlp.up, mlp.down) "
                              f"and cannot read it")


def load_with_weights(path, device="cpu", mmap=False):
    """load(path), with the whole weights under 'model' (and 'objective' where the run had
    parameters there) whichever way it was written: best.pt and a one-process or DDP ckpt.pt hold
    them; an FSDP run's ckpt.pt names the folder of shards, read back here in this one process
    (no process group: evaluate.py, sample.py, the HF export and init_from run anywhere)."""
    checkpoint = load(path, device, mmap=mmap)
    if "model" in checkpoint:
        return checkpoint
    if "dcp" not in checkpoint:
        raise CheckpointError(f"{path} holds no model weights (no 'model' and no FSDP shards named)")
    directory = os.path.join(os.path.dirname(os.path.abspath(path)), checkpoint["dcp"])
    checkpoint.update(sharded_weights(directory, device))
    return checkpoint


def damaged_shards(directory):
    """Why the shards save_sharded wrote into directory cannot be read whole (its .metadata unreadable,
    a .distcp file missing or shorter than the bytes the metadata places in it: truncated), or None.
    Reads the metadata and the files' sizes only, so every rank can ask before any collective."""
    import torch.distributed.checkpoint as dcp
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
        return (f"cannot read the FSDP shards in {directory} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    expected = {}
    for item in metadata.storage_data.values():
        expected[item.relative_path] = max(expected.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(expected.items()):
        shard = os.path.join(directory, name)
        if not os.path.isfile(shard):
            return f"the FSDP shard {shard} is missing"
        if os.path.getsize(shard) < size:
            return f"the FSDP shard {shard} is truncated ({os.path.getsize(shard):,} bytes of {size:,})"
    return None


def sharded_weights(directory, device="cpu"):
    """{'model': {name: tensor}, 'objective': {...}}: the whole weights from the shards that save_sharded
    wrote into directory, without the optimizer state (for a 7B run that reads 28 GB, not 84). The shapes and
    dtypes come from the checkpoint's own metadata, so no model has to be built first."""
    import warnings

    import torch.distributed.checkpoint as dcp
    if problem := damaged_shards(directory):
        raise CheckpointError(problem)
    metadata = dcp.FileSystemReader(directory).read_metadata()
    weights = {"model": {}, "objective": {}}
    for key, meta in metadata.state_dict_metadata.items():
        top, _, name = key.partition(".")  # "model.<module>.<parameter>", module "model" or "objective"
        module, _, name = name.partition(".")
        if top == "model" and module in weights and hasattr(meta, "size"):
            weights[module][name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    if not weights["model"]:
        raise CheckpointError(f"{directory} holds no model weights")
    check_expert_layout(weights["model"], directory)
    flat = {f"{module}.{name}": tensor for module, part in weights.items() for name, tensor in part.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load({"model": flat}, checkpoint_id=directory)
    return {module: {name: tensor.to(device) for name, tensor in part.items()}
            for module, part in weights.items()}


def run_state(config, model_config, meta, iter_num, best_val_loss, last_eval, training=None):
    """What a checkpoint holds besides the weights (save_full and save_weights add those): config,
    step and losses; the dataset's meta and resolved path (evaluate.py and sample.py run from
    anywhere); training: what continuing exactly needs as well (TrainingState.state_dict), for ckpt.pt."""
    return {"model_config": model_config.__dict__, "config": config, "iter_num": iter_num,
            "best_val_loss": best_val_loss, "last_eval": last_eval, "meta": meta,
            "data_dir_resolved": os.path.realpath(config["data_dir"]), "processes": parallelism.world_size(),
            **(training or {})}


class TrainingState:
    """What a full checkpoint holds besides the weights and the optimizer states, as one object with
    state_dict / load_state_dict like the modules saved beside it: the FLOPs executed so far, the
    data order (its generator and, with data_order 'epoch', the position in the epoch), the global
    RNG states, AdaGC's EMAs (clipper), the float16 loss scale (scaler) and Stop Jostling's recorded
    gradient parts (grad_recorder). Every rank draws the same random numbers and windows, so rank
    0's state is everyone's. The step and the best validation loss are the loop's own (run_state)."""

    def __init__(self, data_generator, epoch_windows=None, clipper=None, scaler=None, grad_recorder=None,
                 device="cpu"):
        self.data_generator, self.epoch_windows, self.clipper = data_generator, epoch_windows, clipper
        self.scaler, self.grad_recorder = scaler, grad_recorder
        self.cuda = torch.device(device).type == "cuda"
        self.flops_done = {"train": 0, "eval": 0}  # what this run has executed (the grids' efficiency)

    def state_dict(self):
        return dict(flops_done=dict(self.flops_done), data_rng=self.data_generator.get_state(),
                    data_position=self.epoch_windows.state_dict() if self.epoch_windows is not None else None,
                    torch_rng=torch.get_rng_state(),
                    cuda_rng=torch.cuda.get_rng_state() if self.cuda else None,
                    adagc=self.clipper.state_dict() if self.clipper is not None else None,
                    grad_scaler=self.scaler.state_dict() if self.scaler is not None else None,
                    grad_parts=self.grad_recorder.steps if self.grad_recorder is not None else [])

    def load_state_dict(self, state):
        """Set everything back from a checkpoint's dict; a key an older checkpoint lacks keeps its
        start value (no FLOPs counted before the count existed: 0; random data order until now: epoch 0)."""
        self.flops_done = dict(state.get("flops_done") or self.flops_done)
        # RNG states are CPU tensors wherever they were loaded
        self.data_generator.set_state(state["data_rng"].cpu())
        if self.epoch_windows is not None and state.get("data_position"):
            try:
                self.epoch_windows.load_state_dict(state["data_position"])
            except DataError as e:
                raise CheckpointError(f"cannot resume: {e}") from None
        torch.set_rng_state(state["torch_rng"].cpu())
        if self.cuda and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"].cpu())
        if self.clipper is not None and state.get("adagc") is not None:
            self.clipper.load_state_dict(state["adagc"])
        if self.scaler is not None and state.get("grad_scaler"):  # a float16 run's loss scale
            self.scaler.load_state_dict(state["grad_scaler"])
        if self.grad_recorder is not None:
            self.grad_recorder.steps = state.get("grad_parts", [])


def summary(state):
    """The readable JSON written beside a .pt: config, step and losses."""
    return {key: state.get(key)
            for key in ("config", "model_config", "iter_num", "best_val_loss", "last_eval", "config_changes")}


def write(path, state, keep_previous=False):
    """Write state to path (and its JSON summary beside it), atomically. keep_previous: the file now at path
    becomes <name>_prev.pt first, so two full states exist at every moment after the second save (a kill
    between the two renames leaves only _prev, which resume falls back to); keep_previous=False leaves any
    _prev as it is. A failed write removes its temporary file, leaves the previous checkpoint as it was, and
    raises one CheckpointError that tells a full disk (and the space left) from a missing permission."""
    directory = os.path.dirname(os.path.abspath(path))
    prev = path[:-3] + "_prev.pt"

    def save(tmp):  # a failed write is the OSError that says why, not torch's "unexpected pos"
        torch_save(state, tmp)
    try:
        if keep_previous:
            tmp = os.path.join(directory, "." + os.path.basename(path) + ".new.tmp")
            save(tmp)
            if os.path.exists(path):
                os.replace(path, prev)
                if os.path.exists(path[:-3] + ".json"):
                    os.replace(path[:-3] + ".json", prev[:-3] + ".json")
            os.replace(tmp, path)
        else:
            atomic_write(path, save)
        # a kill before this line leaves the JSON a step behind its weights: load_latest rewrites it
        save_json(summary(state), path[:-3] + ".json")
    except (OSError, RuntimeError) as e:
        for name in os.listdir(directory):
            if name.startswith("." + os.path.basename(path)) and name.endswith(".tmp"):
                os.remove(os.path.join(directory, name))
        kept = [p for p in (path, prev) if os.path.exists(p)]
        if not isinstance(e, OSError):
            e = OSError(None, str(e).splitlines()[0][:100])
        raise CheckpointError(
            f"{write_failure(path, e)}. "
            + (f"{' and '.join(kept)} {'is' if len(kept) == 1 else 'are'} intact."
               if kept else "Nothing was saved.")
        ) from None


def json_step(path):
    try:
        with open(path) as f:
            return json.load(f).get("iter_num")
    except (OSError, ValueError, AttributeError):
        return None


RESUME_NEEDS = ("model_config", "config", "iter_num", "data_rng", "torch_rng")  # what a full state holds


def load_latest(out_dir, device, master=True):
    """The newest readable full checkpoint of out_dir: ckpt.pt, or ckpt_prev.pt if ckpt.pt is
    missing or unreadable, or names FSDP shards that are (damaged_shards; rank 0 says so, in one
    line). Returns (checkpoint, path). A JSON that names another step than its weights (a kill
    between the two writes) is written again."""
    paths = [os.path.join(out_dir, name) for name in ("ckpt.pt", "ckpt_prev.pt")]
    if not any(os.path.exists(p) for p in paths):
        raise CheckpointError(f"init_from='resume' but there is no checkpoint at {paths[0]}; "
                              f"--init_from=auto starts a run stopped before its first checkpoint again, "
                              f"keeping what it wrote")
    problems = []
    for path in paths:
        try:
            checkpoint = load(path, device, need=RESUME_NEEDS)
            if "dcp" in checkpoint and (problem := damaged_shards(os.path.join(out_dir, checkpoint["dcp"]))):
                raise CheckpointError(f"{problem}, named by {path}")
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems and master:
            print(f"warning: {problems[0]}; resuming from the previous checkpoint {path} "
                     f"(step {checkpoint['iter_num']}) instead")
        if master and json_step(path[:-3] + ".json") != checkpoint["iter_num"]:
            save_json(summary(checkpoint), path[:-3] + ".json")
        return checkpoint, path
    raise CheckpointError("cannot resume: " + "; ".join(problems))


def starting_weights(path, model_config, head_from_embedding, data_dir, device="cpu", sharded=False):
    """The weights of another run's checkpoint, to start a new run from (load them before the model is
    parallelized: plain, whole tensors). The model must have the same shape (tie_weights and dropout may
    differ), else UsageError. head_from_embedding: the new untied LM head starts as a copy of the input
    embedding -- CWT's second stage gives a headless model a head that way (headless LM paper, Sec. 4.2).
    Raises CheckpointError for an unreadable file or other tokens than data_dir's. On the CPU a single-file
    checkpoint is memory-mapped: under FSDP each rank reads only its shards' rows (parallelism.copy_shards).
    An FSDP run's checkpoint, for a run that shards too (sharded): a function that reads each rank's rows into
    the sharded model (load_shards_into); for any other run, its whole weights read back from the shards."""
    source = load(path, device, mmap=device == "cpu")
    check_dataset(source, data_dir, whole=False)
    for key, value in GPTConfig.from_checkpoint(source["model_config"]).__dict__.items():
        if key not in ("tie_weights", "dropout") and getattr(model_config, key) != value:
            raise UsageError(f"cannot start from {path}: model key '{key}' is "
                             f"{getattr(model_config, key)!r} here but {value!r} there")
    if sharded and "model" not in source and "dcp" in source:
        directory = os.path.join(os.path.dirname(os.path.abspath(path)), source["dcp"])
        return functools.partial(load_shards_into, directory, head_from_embedding)
    weights = dict(load_with_weights(path, device, mmap=device == "cpu")["model"])
    if head_from_embedding:
        weights["lm_head.weight"] = weights["wte.weight"].clone()
    return weights


def load_shards_into(directory, head_from_embedding, model):
    """The model weights of an FSDP run's shards (save_sharded) read into an FSDP2 model in place:
    DCP reads each rank's rows only, however the two runs were sharded, so no process holds the
    whole model. A tied model reads wte once; head_from_embedding: the LM head's shards are copies
    of wte's (the same shape, cut the same way). Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    problem = damaged_shards(directory)
    if problem:
        raise CheckpointError(problem)
    stored = {key.removeprefix("model.model.") for key in dcp.FileSystemReader(directory).read_metadata()
              .state_dict_metadata if key.startswith("model.model.")}
    wanted = {name: tensor for name, tensor in model.state_dict().items()
              if not (name == "lm_head.weight" and (model.config.tie_weights or head_from_embedding))}
    if missing := sorted(wanted.keys() - stored):
        raise CheckpointError(f"the shards in {directory} hold no {', '.join(missing)}")
    dcp.load({"model": {f"model.{name}": tensor for name, tensor in wanted.items()}}, checkpoint_id=directory)
    if head_from_embedding:
        with torch.no_grad():
            model.lm_head.weight.to_local().copy_(model.wte.weight.to_local())


def check_dataset(checkpoint, data_dir, whole=True):
    """Raise CheckpointError when data_dir's dataset is not the one the checkpoint was trained on
    (data.dataset_mismatch; whole=False: another text with the same tokens is fine)."""
    try:
        problem = dataset_mismatch(checkpoint.get("meta", {}), read_meta(data_dir), data_dir, whole)
    except DataError as e:
        raise CheckpointError(str(e)) from None
    if problem:
        raise CheckpointError(problem)


def data_dir_of(checkpoint, path, override=None):
    """Where the checkpoint's dataset is, from wherever evaluate.py or sample.py runs: --data_dir
    if given, else the resolved path the run stored, else its data_dir as written (relative to the
    working directory); one clear error when none exists or when it holds another dataset."""
    candidates = ([override] if override
                  else [checkpoint.get("data_dir_resolved"), checkpoint["config"]["data_dir"]])
    for candidate in candidates:
        if candidate and os.path.exists(os.path.join(candidate, "meta.json")):
            check_dataset(checkpoint, candidate)
            return candidate
    named = " or ".join(repr(c) for c in candidates if c)
    raise CheckpointError(f"the dataset of {path} is not at {named} (no meta.json there); "
                          f"pass --data_dir=...")


# full training state -----------------------------------------------------------------------------

def save_full(out_dir, state, modules, optimizers, parallel, master, dcp_slots, keep_previous=True):
    """Write ckpt.pt, keeping the previous one as ckpt_prev.pt (keep_previous=False: when ckpt.pt
    is the unreadable file a resume fell back from, it is replaced and ckpt_prev.pt stays). state:
    the plain part (config, step, RNG states, ...); modules: ModuleDict {'model', 'objective'}.
    Single process and DDP: rank 0 writes the whole weights and optimizer states. FSDP: every rank
    writes its shards into a slot of ckpt_dcp/ that neither ckpt.pt nor ckpt_prev.pt names, and
    ckpt.pt names it only once it is complete. dcp_slots: [previous, latest] slot names (None if
    none), updated here. Collective; whether the write succeeded is agreed over all ranks (agree)."""
    path = os.path.join(out_dir, "ckpt.pt")
    state = dict(state)
    if parallel == "fsdp":
        slot = next(s for s in DCP_SLOTS if s not in dcp_slots)
        has_optimizer_state = any(opt.state for opt in optimizers)  # none before the first step
        write_shards(os.path.join(out_dir, "ckpt_dcp", slot), modules, optimizers, has_optimizer_state,
                     master, path)
        state.update(dcp=os.path.join("ckpt_dcp", slot), dcp_previous=dcp_slots[1],
                     dcp_optimizers=has_optimizer_state,
                     objective_shapes={k: list(v.shape)
                                       for k, v in modules["objective"].state_dict().items()})
    else:
        state.update(model=modules["model"].state_dict(), objective=modules["objective"].state_dict(),
                     optimizers=[opt.state_dict() for opt in optimizers])
    agree(_write_on(master, path, state, keep_previous))
    if parallel == "fsdp":
        dcp_slots[:] = [dcp_slots[1], slot]
        if master:  # shards no checkpoint names any more
            for slot in DCP_SLOTS:
                if slot not in dcp_slots:
                    shutil.rmtree(os.path.join(out_dir, "ckpt_dcp", slot), ignore_errors=True)


def write_shards(directory, modules, optimizers, with_optimizers, master, path):
    """Every rank writes its shards into directory (emptied first: a killed run's leftovers), for
    the checkpoint file `path` that will name it. Collective; a failed write on any rank (DCP tells
    every rank) is a CheckpointError on all, with `path` intact."""
    if master and os.path.exists(directory):
        shutil.rmtree(directory)
    parallelism.barrier()
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        save_sharded(directory, modules, optimizers, with_optimizers=with_optimizers)
        problem = None
    except (OSError, RuntimeError, CheckpointException) as e:
        problem = f"cannot write the shards in {directory} ({str(e).splitlines()[0][:200]}); {path} is intact"
    agree(problem)


def _write_on(master, path, state, keep_previous=False):
    """write() on rank 0; what went wrong (a full disk) as a message, None if nothing did."""
    try:
        if master:
            write(path, state, keep_previous=keep_previous)
    except CheckpointError as e:
        return str(e)
    return None


def agree(problem):
    """Raise CheckpointError on every rank if any rank had a problem (its message, or None): all
    ranks end together, with the previous checkpoint intact, instead of the others waiting in
    their next collective for the one that failed. One small collective per save."""
    problem = parallelism.first_error(problem)
    if problem is not None:
        raise CheckpointError(problem, agreed=True)


def save_weights(path, state, modules, parallel, master):
    """best.pt: the weights alone. One process and DDP: rank 0 writes them whole. FSDP: like ckpt.pt, every
    rank writes its own shards (nothing gathered onto one process) into best_dcp/step_<iter>/, and best.pt,
    written once they are complete, names that folder; the folders best.pt no longer names are removed.
    load_with_weights reads either kind whole. Collective; the outcome is agreed over all ranks."""
    state = dict(state)
    if parallel == "fsdp":
        best_dcp = os.path.join(os.path.dirname(path), BEST_DCP)
        directory = os.path.join(best_dcp, f"step_{state['iter_num']}")
        write_shards(directory, modules, [], False, master, path)
        state["dcp"] = os.path.relpath(directory, os.path.dirname(path))
    else:
        state.update(model=modules["model"].state_dict(), objective=modules["objective"].state_dict())
    agree(_write_on(master, path, state))
    if parallel == "fsdp" and master:
        for old in os.listdir(best_dcp):
            if old != os.path.basename(directory):
                shutil.rmtree(os.path.join(best_dcp, old), ignore_errors=True)


def restore(checkpoint, path, out_dir, modules, optimizers, parallel, dcp_slots):
    """Load a full checkpoint's weights and optimizer states in place (collective under FSDP).
    The RNG and data state are the caller's (they live in train.py's generators)."""
    objective_mismatch = (f"cannot resume from {path}: its loss parameters (NITP head) do not match "
                          "nitp_weight / nitp_hidden of this config")
    if "dcp" in checkpoint:  # written by an FSDP run: weights and optimizer state are in shards
        if parallel != "fsdp":
            raise CheckpointError(f"cannot resume: {path} was written with parallel='fsdp' (sharded in "
                                  f"{os.path.join(out_dir, checkpoint['dcp'])}); resume with --parallel=fsdp")
        shapes = {k: list(v.shape) for k, v in modules["objective"].state_dict().items()}
        if checkpoint["objective_shapes"] != shapes:
            raise CheckpointError(objective_mismatch)
        from torch.distributed.checkpoint.api import CheckpointException
        directory = os.path.join(out_dir, checkpoint["dcp"])
        try:  # DCP gathers every rank's failure: all ranks are here together
            load_sharded(directory, modules, optimizers, with_optimizers=checkpoint["dcp_optimizers"])
        except (CheckpointException, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            before = f"; move {path} aside to resume from ckpt_prev.pt" if path.endswith("ckpt.pt") else ""
            raise CheckpointError(f"cannot read the FSDP shards in {directory}, named by {path} "
                                  f"({type(e).__name__}){before}") from None
        dcp_slots[:] = [checkpoint.get("dcp_previous"), os.path.basename(checkpoint["dcp"])]
        return
    if parallel == "fsdp":
        raise CheckpointError(f"cannot resume: {path} holds whole weights (written with parallel="
                              f"'{checkpoint['config'].get('parallel', 'none')}'); "
                              f"resume it with that setting")
    modules["model"].load_state_dict(checkpoint["model"])
    try:
        modules["objective"].load_state_dict(checkpoint.get("objective", {}))
    except RuntimeError:
        raise CheckpointError(objective_mismatch) from None
    for opt, opt_state in zip(optimizers, checkpoint["optimizers"]):
        opt.load_state_dict(opt_state)


# FSDP shards ----------------------------------------------------------------------------------
# DCP shards load back on any number of ranks. `modules` is an nn.ModuleDict holding the model and
# the objective, so the checkpoint's keys are model.<name> and objective.<name>.

def save_sharded(directory, modules, optimizers, with_optimizers=True):
    """Write the shards of modules (and optimizers) into directory; collective. with_optimizers=False before
    the first optimizer step: get_state_dict would otherwise initialise the empty AdamW state with a
    zero-gradient step (step count 1), and the run would no longer match a single-process one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    if with_optimizers:
        model_state, optimizer_state = get_state_dict(modules, optimizers)
        state = {"model": model_state, "optimizers": optimizer_state}
    else:
        state = {"model": get_model_state_dict(modules)}
    dcp.save(state, checkpoint_id=directory)


def load_sharded(directory, modules, optimizers, with_optimizers=True):
    """Read back what save_sharded wrote, in place; collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)
    if with_optimizers:
        model_state, optimizer_state = get_state_dict(modules, optimizers)
        state = {"model": model_state, "optimizers": optimizer_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(modules, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optimizers"])
    else:
        state = {"model": get_model_state_dict(modules)}
        dcp.load(state, checkpoint_id=directory)
        set_model_state_dict(modules, state["model"])
