"""What a checkpoint holds, and how it is written and read so that no crash
or full disk leaves a run without a good one: ckpt.pt (the full state),
ckpt_prev.pt (the one before), best.pt (the weights), each with a readable
.json; under FSDP each names a folder of shards (checkpoint_shards.py).
run.py says when and where.

Design notes: docs/runs.md
"""

import functools
import json
import os
import pickle
import shutil
import zipfile

import torch

import parallelism
from checkpoint_shards import (damaged_shards, load_sharded,
                               load_shards_into, save_sharded,
                               shard_errors, sharded_weights)
from data import DataError, dataset_mismatch, read_meta
from errors import CheckpointError, UsageError
from model import GPT, GPTConfig
from utils import (atomic_write, remove_leftovers, save_json, torch_save,
                   write_failure)

# FSDP: ckpt.pt's shard folders (latest, previous, being written)
DCP_SLOTS = ("a", "b", "c")
BEST_DCP = "best_dcp"  # FSDP: the shards of best.pt


def load(path, device="cpu",
         need=("model_config", "config", "iter_num"), mmap=False):
    """torch.load with weights_only=True, and one clear error for a missing,
    truncated, empty or foreign file."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if os.path.isdir(path):
        raise CheckpointError(
            f"{path} is a directory, not a checkpoint file (e.g. "
            f"{os.path.join(path, 'best.pt')})")
    try:
        checkpoint = torch.load(
            path, map_location=device, weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, pickle.UnpicklingError,
            zipfile.BadZipFile, ValueError, OSError) as e:
        raise CheckpointError(
            f"cannot read checkpoint {path} ({os.path.getsize(path):,} bytes, "
            f"{type(e).__name__}): it is truncated, empty or not a PyTorch "
            f"checkpoint"
        ) from None
    missing = [key for key in need
               if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"{path} is not a checkpoint written by train.py (no "
            f"{', '.join(map(repr, missing))})")
    check_expert_layout(checkpoint.get("model", {}), path)
    return checkpoint


def check_expert_layout(weights, path):
    """Refuse the per-expert layout of before issue 31
    (h.0.mlp.experts.3.gate.weight); experts are stacked now."""
    old = next((name for name in weights if ".mlp.experts." in name), None)
    if old:
        raise CheckpointError(
            f"{path} holds a mixture of experts in the old per-expert layout "
            f"({old}); this version stacks the experts (mlp.gate, mlp.up, "
            f"mlp.down) and cannot read it")


def load_with_weights(path, device="cpu", mmap=False):
    """load(path) with the whole weights under 'model' (and 'objective'),
    from the file or from the FSDP shards it names (read in one process)."""
    checkpoint = load(path, device, mmap=mmap)
    if "model" in checkpoint:
        return checkpoint
    if "dcp" not in checkpoint:
        raise CheckpointError(
            f"{path} holds no model weights (no 'model' and no FSDP shards "
            f"named)")
    directory = shards_of(path, checkpoint)
    checkpoint.update(sharded_weights(directory, device))
    check_expert_layout(checkpoint["model"], directory)
    return checkpoint


def load_model(path, device="cpu"):
    """(model, checkpoint) of a train.py checkpoint (an FSDP run's too);
    a CheckpointError names a bad file. Built on the meta device, the
    model takes the memory-mapped tensors: one copy of the weights."""
    checkpoint = load_with_weights(path, "cpu", mmap=True)
    config = GPTConfig.from_checkpoint(checkpoint["model_config"])
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(checkpoint["model"], assign=True)
    model.tie_weights()  # assign gave the tied matrix two parameters
    return model.to(device).eval(), checkpoint


def shards_of(path, checkpoint):
    """The folder of FSDP shards that the checkpoint at path names."""
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.join(directory, checkpoint["dcp"])


def run_state(config, model_config, meta, iter_num, best_val_loss,
              last_eval):
    """A checkpoint's state besides the weights and the TrainingState."""
    return {"model_config": model_config.__dict__, "config": config,
            "iter_num": iter_num, "best_val_loss": best_val_loss,
            "last_eval": last_eval, "meta": meta,
            "data_dir_resolved": os.path.realpath(config["data_dir"]),
            "processes": parallelism.world_size()}


class TrainingState:
    """The rest of a full checkpoint, saved and loaded like a module
    (rank 0's: every rank's is the same); what it holds: docs/runs.md."""

    def __init__(self, data_generator, epoch_windows=None, clipper=None,
                 scaler=None, grad_recorder=None, device="cpu"):
        self.data_generator = data_generator
        self.epoch_windows = epoch_windows
        self.clipper = clipper
        self.scaler = scaler
        self.grad_recorder = grad_recorder
        self.cuda = torch.device(device).type == "cuda"
        self.flops_done = {"train": 0, "eval": 0}

    def state_dict(self):
        def state_of(part):
            return part.state_dict() if part is not None else None

        recorder = self.grad_recorder
        return dict(
            flops_done=dict(self.flops_done),
            data_rng=self.data_generator.get_state(),
            data_position=state_of(self.epoch_windows),
            torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state() if self.cuda else None,
            adagc=state_of(self.clipper),
            grad_scaler=state_of(self.scaler),
            grad_parts=recorder.steps if recorder is not None else [])

    def load_state_dict(self, state):
        """Set everything back; what older checkpoints lack stays."""
        self.flops_done = dict(state.get("flops_done") or self.flops_done)
        # RNG states must be CPU tensors
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
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        if self.grad_recorder is not None:
            self.grad_recorder.steps = state.get("grad_parts", [])


def summary(state):
    """The readable JSON written beside a .pt: config, step, losses."""
    keys = ("config", "model_config", "iter_num", "best_val_loss",
            "last_eval", "config_changes")
    return {key: state.get(key) for key in keys}


def write(path, state, keep_previous=False):
    """Write state to path, and its summary beside it, atomically;
    keep_previous: the file at path becomes <name>_prev.pt first."""
    directory = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    prev = path[:-3] + "_prev.pt"
    save = functools.partial(torch_save, state)
    try:
        if keep_previous:
            tmp = os.path.join(directory, f".{name}.new.tmp")
            save(tmp)
            if os.path.exists(path):
                os.replace(path, prev)
                if os.path.exists(path[:-3] + ".json"):
                    os.replace(path[:-3] + ".json", prev[:-3] + ".json")
            os.replace(tmp, path)
        else:
            atomic_write(path, save)
        # a kill here leaves the JSON a step behind: load_latest mends it
        save_json(summary(state), path[:-3] + ".json")
    except (OSError, RuntimeError) as e:
        remove_leftovers(directory, [name])
        if not isinstance(e, OSError):
            e = OSError(None, str(e).splitlines()[0][:100])
        kept = [p for p in (path, prev) if os.path.exists(p)]
        after = "Nothing was saved."
        if kept:
            verb = "is" if len(kept) == 1 else "are"
            after = f"{' and '.join(kept)} {verb} intact."
        raise CheckpointError(f"{write_failure(path, e)}. {after}") from None


def json_step(path):
    try:
        with open(path) as f:
            return json.load(f).get("iter_num")
    except (OSError, ValueError, AttributeError):
        return None


RESUME_NEEDS = ("model_config", "config", "iter_num", "data_rng", "torch_rng")


def load_latest(out_dir, device):
    """(checkpoint, path) of the newest readable full checkpoint: ckpt.pt,
    or ckpt_prev.pt (with a warning); mends a JSON summary a step
    behind. Rank 0's."""
    paths = [os.path.join(out_dir, name)
             for name in ("ckpt.pt", "ckpt_prev.pt")]
    if not any(os.path.exists(p) for p in paths):
        raise CheckpointError(
            f"init_from='resume' but there is no checkpoint at {paths[0]}; "
            f"--init_from=auto starts a run stopped before its first "
            f"checkpoint again, keeping what it wrote")
    problems = []
    for path in paths:
        try:
            checkpoint = load(path, device, need=RESUME_NEEDS)
            if "dcp" in checkpoint:
                directory = os.path.join(out_dir, checkpoint["dcp"])
                if problem := damaged_shards(directory):
                    raise CheckpointError(f"{problem}, named by {path}")
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems:
            print(f"warning: {problems[0]}; resuming from the previous "
                  f"checkpoint {path} (step {checkpoint['iter_num']}) instead")
        json_path = path[:-3] + ".json"
        if json_step(json_path) != checkpoint["iter_num"]:
            save_json(summary(checkpoint), json_path)
        return checkpoint, path
    raise CheckpointError("cannot resume: " + "; ".join(problems))


def starting_weights(path, model_config, head_from_embedding, data_dir,
                     sharded=False):
    """Another run's weights to start from, memory-mapped on the CPU:
    whole, or for a sharded run from shards, a function reading each
    rank's rows (load_shards_into). head_from_embedding: the LM head
    starts as a copy of the input embedding (CWT's second stage,
    headless LM paper, Sec. 4.2)."""
    source = load(path, mmap=True)
    check_dataset(source, data_dir, whole=False)
    theirs = GPTConfig.from_checkpoint(source["model_config"])
    for key, value in theirs.__dict__.items():
        ours = getattr(model_config, key)
        if key not in ("tie_weights", "dropout") and ours != value:
            raise UsageError(
                f"cannot start from {path}: model key '{key}' is {ours!r} "
                f"here but {value!r} there")
    if sharded and "model" not in source and "dcp" in source:
        return functools.partial(load_shards_into, shards_of(path, source),
                                 head_from_embedding)
    weights = dict(load_with_weights(path, mmap=True)["model"])
    if head_from_embedding:
        weights["lm_head.weight"] = weights["wte.weight"].clone()
    return weights


def check_dataset(checkpoint, data_dir, whole=True):
    """CheckpointError if data_dir holds another dataset than the
    checkpoint (whole=False: the same tokens suffice)."""
    try:
        problem = dataset_mismatch(checkpoint.get("meta", {}),
                                   read_meta(data_dir), data_dir, whole)
    except DataError as e:
        raise CheckpointError(str(e)) from None
    if problem:
        raise CheckpointError(problem)


def data_dir_of(checkpoint, path, override=None):
    """The checkpoint's dataset: --data_dir (override), else the
    resolved path the run stored, else its data_dir as written."""
    candidates = [override] if override else [
        checkpoint.get("data_dir_resolved"), checkpoint["config"]["data_dir"]]
    for candidate in candidates:
        if candidate and os.path.exists(f"{candidate}/meta.json"):
            check_dataset(checkpoint, candidate)
            return candidate
    named = " or ".join(repr(c) for c in candidates if c)
    raise CheckpointError(
        f"the dataset of {path} is not at {named} (no meta.json there); pass "
        f"--data_dir=...")


def whole_weights(modules):
    return {"model": modules["model"].state_dict(),
            "objective": modules["objective"].state_dict()}


def objective_shapes(modules):
    objective = modules["objective"].state_dict()
    return {k: list(v.shape) for k, v in objective.items()}


class Checkpoints:
    """Writes a run's ckpt.pt and best.pt and restores a resumed run.
    modules: ModuleDict {'model', 'objective'}."""

    def __init__(self, out_dir, modules, optimizers, master):
        self.out_dir = out_dir
        self.modules = modules
        self.optimizers = optimizers
        self.master = master

    def write_agreed(self, path, state, keep_previous=False):
        """write() on rank 0, its outcome agreed over all ranks."""
        problem = None
        if self.master:
            try:
                write(path, state, keep_previous=keep_previous)
            except CheckpointError as e:
                problem = str(e)
        agree(problem)


class Whole(Checkpoints):
    """ckpt.pt and best.pt hold the whole weights, written by rank 0."""

    def save_full(self, state, keep_previous=True):
        """Write ckpt.pt, the previous one kept as ckpt_prev.pt unless
        keep_previous=False. Collective."""
        path = os.path.join(self.out_dir, "ckpt.pt")
        optimizers = [opt.state_dict() for opt in self.optimizers]
        state = {**state, **whole_weights(self.modules),
                 "optimizers": optimizers}
        self.write_agreed(path, state, keep_previous)

    def save_best(self, state):
        """best.pt: the weights alone. Collective."""
        path = os.path.join(self.out_dir, "best.pt")
        state = {**state, **whole_weights(self.modules)}
        self.write_agreed(path, state)

    def restore(self, checkpoint, path):
        if "dcp" in checkpoint:
            directory = os.path.join(self.out_dir, checkpoint["dcp"])
            raise CheckpointError(
                f"cannot resume: {path} was written with parallel='fsdp' "
                f"(sharded in {directory}); resume with --parallel=fsdp")
        self.modules["model"].load_state_dict(checkpoint["model"])
        try:
            self.modules["objective"].load_state_dict(
                checkpoint.get("objective", {}))
        except RuntimeError:
            raise CheckpointError(loss_mismatch(path)) from None
        for opt, state in zip(self.optimizers, checkpoint["optimizers"]):
            opt.load_state_dict(state)


class Sharded(Checkpoints):
    """ckpt.pt and best.pt name folders of FSDP shards, every rank
    writing its own: ckpt.pt's in a free one of ckpt_dcp/'s DCP_SLOTS,
    best.pt's in best_dcp/step_<iter>/."""

    def __init__(self, out_dir, modules, optimizers, master):
        super().__init__(out_dir, modules, optimizers, master)
        # the slots ckpt_prev.pt and ckpt.pt name
        self.slots = [None, None]

    def save_full(self, state, keep_previous=True):
        path = os.path.join(self.out_dir, "ckpt.pt")
        slot = next(s for s in DCP_SLOTS if s not in self.slots)
        dcp = os.path.join("ckpt_dcp", slot)
        with_optimizers = any(opt.state for opt in self.optimizers)
        self.write_shards(os.path.join(self.out_dir, dcp), path,
                          with_optimizers)
        state = {**state, "dcp": dcp, "dcp_previous": self.slots[1],
                 "dcp_optimizers": with_optimizers,
                 "objective_shapes": objective_shapes(self.modules)}
        self.write_agreed(path, state, keep_previous)
        self.slots = [self.slots[1], slot]
        if self.master:  # shards no checkpoint names any more
            for old in DCP_SLOTS:
                if old not in self.slots:
                    shutil.rmtree(os.path.join(self.out_dir, "ckpt_dcp", old),
                                  ignore_errors=True)

    def save_best(self, state):
        path = os.path.join(self.out_dir, "best.pt")
        best_dcp = os.path.join(self.out_dir, BEST_DCP)
        step = f"step_{state['iter_num']}"
        self.write_shards(os.path.join(best_dcp, step), path)
        state = {**state, "dcp": os.path.join(BEST_DCP, step)}
        self.write_agreed(path, state)
        if self.master:
            for old in os.listdir(best_dcp):
                if old != step:
                    shutil.rmtree(os.path.join(best_dcp, old),
                                  ignore_errors=True)

    def write_shards(self, directory, path, with_optimizers=False):
        """Every rank writes its shards into directory (emptied first),
        for the checkpoint at path; a failure on one rank fails all."""
        if self.master and os.path.exists(directory):
            shutil.rmtree(directory)
        parallelism.barrier()
        problem = None
        try:
            save_sharded(directory, self.modules, self.optimizers,
                         with_optimizers)
        except shard_errors() as e:
            problem = (f"cannot write the shards in {directory} "
                       f"({str(e).splitlines()[0][:200]}); {path} is intact")
        agree(problem)

    def restore(self, checkpoint, path):
        """Read the shards a full checkpoint names. Collective."""
        if "dcp" not in checkpoint:
            written = checkpoint["config"].get("parallel", "none")
            raise CheckpointError(
                f"cannot resume: {path} holds whole weights (written with "
                f"parallel='{written}'); resume it with that setting")
        directory = os.path.join(self.out_dir, checkpoint["dcp"])
        if checkpoint["objective_shapes"] != objective_shapes(self.modules):
            raise CheckpointError(loss_mismatch(path))
        try:  # DCP gathers every rank's failure
            load_sharded(directory, self.modules, self.optimizers,
                         checkpoint["dcp_optimizers"])
        except shard_errors() as e:
            before = ""
            if path.endswith("ckpt.pt"):
                before = f"; move {path} aside to resume from ckpt_prev.pt"
            raise CheckpointError(
                f"cannot read the FSDP shards in {directory}, named by {path} "
                f"({type(e).__name__}){before}") from None
        self.slots = [checkpoint.get("dcp_previous"),
                      os.path.basename(checkpoint["dcp"])]


def loss_mismatch(path):
    return (f"cannot resume from {path}: its loss parameters (NITP head) "
            f"do not match nitp_weight / nitp_hidden of this config")


def agree(problem):
    """CheckpointError on every rank if any rank had a problem (its
    message, else None). Collective."""
    problem = parallelism.first_error(problem)
    if problem is not None:
        raise CheckpointError(problem, agreed=True)
