"""
Checkpoints of a training run, kept apart from train.py: what is saved, how it is written so that
no crash or full disk can leave a run without a good checkpoint, and how a run resumes.

A run's out_dir holds
    ckpt.pt / ckpt.json            the latest full state: weights, optimizer, step, data and RNG state
    ckpt_prev.pt / ckpt_prev.json  the full state before it, kept in case the latest cannot be read
    best.pt / best.json            weights only, the best validation loss so far (what evaluate.py scores)
    run.lock                       flock-ed by the run writing out_dir (lock_run); names it; not a run file
Every .pt has a readable .json beside it (config, step, losses). Under FSDP the full state is
sharded into ckpt_dcp/<slot>/ and ckpt.pt names the slot (parallelism.save_sharded); best.pt's
weights likewise into best_dcp/step_<iter>/.

Writes go to a temporary file that is renamed into place (utils.atomic_write), so a kill at any
moment leaves either the old or the new file, never half of one. Every function takes what it
needs as arguments; errors a user can fix are raised as CheckpointError with one line that names
the file.
"""

import errno
import fcntl
import json
import math
import os
import pickle
import shlex
import shutil
import socket
import time
import zipfile

import torch

import parallelism
import tracking
from data import DataError, dataset_mismatch, read_meta
from utils import LogError, atomic_write, exit_run, read_log, save_json, save_text, torch_save, write_failure

# the files of a run: a fresh run refuses an out_dir holding any of them
RUN_FILES = ("ckpt.pt", "ckpt.json", "ckpt_prev.pt", "ckpt_prev.json", "best.pt", "best.json", "log.jsonl",
             "metrics.json", "marginalization.json", tracking.ID_FILE)
LOCK_FILE = "run.lock"  # held (flock) by the one run that writes out_dir; not a run file
DCP_SLOTS = ("a", "b", "c")
BEST_DCP = "best_dcp"  # FSDP: the shards of best.pt (save_weights)  # FSDP shard folders: the latest, the previous, and the one being written


class CheckpointError(Exception):
    pass


def load(path, device="cpu", need=("model_config", "config", "iter_num"), mmap=False):
    """torch.load with weights_only=True (our checkpoints hold only tensors and plain containers),
    and one clear error for a missing, truncated, empty or foreign file. mmap: the tensors stay in
    the file, mapped into memory (on the CPU), and only the pages a reader touches are read."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a checkpoint file (e.g. {os.path.join(path, 'best.pt')})")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {path} ({os.path.getsize(path):,} bytes, {type(e).__name__}): "
                              f"it is truncated, empty or not a PyTorch checkpoint") from None
    missing = [key for key in need if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise CheckpointError(f"{path} is not a checkpoint written by train.py (no {', '.join(map(repr, missing))})")
    check_expert_layout(checkpoint.get("model", {}), path)
    return checkpoint


def check_expert_layout(weights, path):
    """A mixture of experts written before issue 31 held one module per expert (h.0.mlp.experts.3.gate.weight);
    the model now stacks them (h.0.mlp.gate, (E, hidden, C)) and does not read the old layout."""
    old = next((name for name in weights if ".mlp.experts." in name), None)
    if old:
        raise CheckpointError(f"{path} holds a mixture of experts in the old per-expert layout ({old}); this version "
                              f"stacks the experts (mlp.gate, mlp.up, mlp.down) and cannot read it")


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


def sharded_weights(directory, device="cpu"):
    """{'model': {name: tensor}, 'objective': {...}}: the whole weights from the shards that
    parallelism.save_sharded wrote into directory, without the optimizer state (for a 7B run that
    reads 28 GB, not 84). The shapes and dtypes come from the checkpoint's own metadata, so no
    model has to be built first."""
    import warnings

    import torch.distributed.checkpoint as dcp
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"cannot read the FSDP shards in {directory} ({type(e).__name__}: {e})") from None
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
    return {module: {name: tensor.to(device) for name, tensor in part.items()} for module, part in weights.items()}


def run_state(config, model_config, meta, iter_num, best_val_loss, last_eval, training=None):
    """What a checkpoint holds besides the weights (save_full and save_weights add those): config,
    step and losses; the dataset's meta and resolved path (evaluate.py and sample.py run from
    anywhere); training: what continuing exactly needs as well (training_state), for ckpt.pt."""
    return {"model_config": model_config.__dict__, "config": config, "iter_num": iter_num,
            "best_val_loss": best_val_loss, "last_eval": last_eval, "meta": meta,
            "data_dir_resolved": os.path.realpath(config["data_dir"]), "processes": parallelism.world_size(),
            **(training or {})}


def training_state(data_generator, epoch_windows, clipper, scaler, grad_parts, flops_done, device):
    """The state besides weights and optimizers that resume() sets back: data order and RNG states
    (epoch_windows: the position in data_order 'epoch', else None), AdaGC's EMAs, the loss scale,
    FLOPs so far. Every rank draws the same random numbers and windows, so rank 0's states are everyone's."""
    return dict(data_rng=data_generator.get_state(), torch_rng=torch.get_rng_state(), grad_parts=grad_parts,
                data_position=epoch_windows.state_dict() if epoch_windows is not None else None,
                cuda_rng=torch.cuda.get_rng_state() if torch.device(device).type == "cuda" else None,
                flops_done=dict(flops_done), adagc=clipper.state_dict() if clipper is not None else None,
                grad_scaler=scaler.state_dict())


def summary(state):
    """The readable JSON written beside a .pt: config, step and losses."""
    return {key: state.get(key) for key in ("config", "model_config", "iter_num", "best_val_loss", "last_eval",
                                            "config_changes")}


def write(path, state, keep_previous=False):
    """Write state to path (and its JSON summary beside it), atomically. keep_previous: the file
    now at path becomes <name>_prev.pt first, so two full states exist at every moment after the
    second save (a kill between the two renames leaves only _prev, which resume falls back to);
    keep_previous=False replaces the file at path and leaves any _prev as it is.
    A failed write removes its temporary file, leaves the previous checkpoint as it was, and raises
    one CheckpointError that tells a full disk (and the space left) from a missing permission."""
    directory = os.path.dirname(os.path.abspath(path))
    prev = path[:-3] + "_prev.pt"

    def save(tmp):  # a failed write is the OSError that says why (ENOSPC, EACCES), not torch's "unexpected pos"
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
            + (f"{' and '.join(kept)} {'is' if len(kept) == 1 else 'are'} intact." if kept else "Nothing was saved.")
        ) from None


def remove_temporaries(out_dir):
    """The temporary files a killed write left behind (this module and utils.atomic_write)."""
    if os.path.isdir(out_dir):
        for name in os.listdir(out_dir):
            if name.startswith(".") and name.endswith(".tmp"):
                os.remove(os.path.join(out_dir, name))


def existing_run(out_dir):
    """The run files already in out_dir (empty if none)."""
    return [name for name in RUN_FILES if os.path.exists(os.path.join(out_dir, name))]


def clear_run(out_dir):
    """Delete a run on purpose (--overwrite=True): its files and FSDP shards, nothing else."""
    for name in existing_run(out_dir):
        os.remove(os.path.join(out_dir, name))
    for shards in ("ckpt_dcp", BEST_DCP):
        shutil.rmtree(os.path.join(out_dir, shards), ignore_errors=True)


def lock_run(out_dir, command):
    """Make out_dir this process's for its whole life: an exclusive flock on out_dir/run.lock, so
    that two runs never write one out_dir (a requeued job beside one still running, a command run
    twice). Returns the open lock file: keep it open; the kernel drops the lock when the process
    ends however it ends (kill -9 too), so a lock a dead run left is no obstacle. The holder (pid,
    host, start, command) is written into the locked file itself, not renamed into place: a rename
    would put an unlocked file at the path. Raises CheckpointError, before anything in out_dir is
    changed, when out_dir cannot be a run's directory or a live run holds it."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"out_dir {out_dir} is a file, not a directory; give another --out_dir")
    path = os.path.join(out_dir, LOCK_FILE)
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+")
    except OSError as e:
        told_apart = e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)
        reason = write_failure(out_dir, e) if told_apart else f"cannot use {out_dir} as a run's directory ({e.strerror})"
        raise CheckpointError(f"{reason}; give an --out_dir you can write to") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        for _ in range(50):  # the holder writes its name just after it locks
            holder = lock.read().strip()
            if holder:
                break
            time.sleep(0.02)
            lock.seek(0)
        lock.close()
        raise CheckpointError(f"{out_dir} is in use by a run that is still going ({holder or 'holder unknown'}); "
                              f"wait for it to end or stop it, or give another --out_dir") from None
    except OSError as e:  # ENOLCK: a network file system without lock support
        lock.close()
        raise CheckpointError(f"cannot lock {path} ({e.strerror}): the file system does not support locks; "
                              f"put out_dir on a local or lock-capable file system (docs/runs.md)") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
               f"{' '.join(command)}\n")
    lock.flush()
    return lock


def start_of(init_from, out_dir):
    """What init_from='auto' means for out_dir: 'resume' when it holds a checkpoint, 'scratch' when
    it holds no run (the same command starts a job and continues it when it is requeued); a run
    without a checkpoint to resume is refused. Other values are returned as they are."""
    existing = existing_run(out_dir)
    if init_from != "auto":
        return init_from
    if not existing:
        return "scratch"
    if "ckpt.pt" in existing or "ckpt_prev.pt" in existing:
        return "resume"
    raise CheckpointError(f"init_from='auto' but {out_dir} holds a run with no checkpoint to resume "
                          f"({', '.join(existing)}); start it over with --init_from=scratch --overwrite=True or "
                          f"give another --out_dir")


def open_run(out_dir, init_from, overwrite, master, command):
    """Take out_dir for this run, before anything in it changes: rank 0 locks it (lock_run), 'auto'
    becomes 'resume' or 'scratch' (start_of), and a fresh run refuses a run already there (a
    forgotten --init_from=resume would lose it) unless overwrite, which then deletes it whole.
    Returns (lock or None, init_from). Collective: a CheckpointError on any rank is raised on all."""
    lock, problem, existing = None, None, []
    try:
        lock = lock_run(out_dir, command) if master else None
        init_from = start_of(init_from, out_dir)
        existing = existing_run(out_dir) if init_from != "resume" else []
        if existing and not overwrite:
            raise CheckpointError(f"{out_dir} already holds a run ({', '.join(existing)}). Continue it with "
                                  f"--init_from=resume, start it over on purpose with --overwrite=True, or give "
                                  f"another --out_dir.")
    except CheckpointError as e:
        problem = str(e)
    agree(problem)
    if master:
        if existing:
            clear_run(out_dir)
        remove_temporaries(out_dir)  # of a write that was killed
    return lock, init_from


def resume(out_dir, config, device, master, modules, optimizers, parallel, dcp_slots, data_generator,
           epoch_windows, clipper, scaler):
    """Continue the run in out_dir exactly: the newest readable full checkpoint (load_latest),
    checked against config, loaded into modules and optimizers, and the data order, RNG, AdaGC and
    loss-scale states set from it; the log lines from its step on are dropped (the loop logs them
    again: the evaluation at that step, the steps a killed run logged after its checkpoint).
    Returns (checkpoint, path, changes): changes as check_resumable returns them."""
    checkpoint, path = load_latest(out_dir, device, master)
    changes = check_resumable(checkpoint, config, config["data_dir"], parallelism.world_size())
    restore(checkpoint, path, out_dir, modules, optimizers, parallel, dcp_slots)
    if master:
        trim_log(os.path.join(out_dir, "log.jsonl"), checkpoint["iter_num"])
    # RNG states must be CPU tensors, whatever map_location moved them to
    data_generator.set_state(checkpoint["data_rng"].cpu())
    if epoch_windows is not None and checkpoint.get("data_position"):  # else (random order until now): epoch 0
        try:
            epoch_windows.load_state_dict(checkpoint["data_position"])
        except DataError as e:
            raise CheckpointError(f"cannot resume: {e}") from None
    torch.set_rng_state(checkpoint["torch_rng"].cpu())
    if torch.device(device).type == "cuda" and checkpoint.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(checkpoint["cuda_rng"].cpu())
    if clipper is not None and checkpoint.get("adagc") is not None:
        clipper.load_state_dict(checkpoint["adagc"])
    if checkpoint.get("grad_scaler"):  # a float16 run's loss scale
        scaler.load_state_dict(checkpoint["grad_scaler"])
    if master:
        print(f"resumed from {path} at iter {checkpoint['iter_num']}"
              + "".join(f"; {key} {before!r} -> {after!r}" for key, (before, after) in changes.items()))
    return checkpoint, path, changes


class RunFiles:
    """What a run writes in out_dir while it trains, every failure ending the run on every rank
    with one line (utils.exit_run) and ckpt.pt intact: log.jsonl (and W&B), ckpt.pt with the
    previous one kept as ckpt_prev.pt (FSDP: shards in ckpt_dcp/), best.pt. A non-finite loss or
    weight ends the run before anything from it is written, naming the last good checkpoint.
    modules: ModuleDict {'model', 'objective'}; under torchrun only rank 0 (master) writes files."""

    def __init__(self, out_dir, modules, optimizers, parallel, master, device, learning_rate):
        self.out_dir, self.modules, self.optimizers, self.parallel, self.master = (out_dir, modules, optimizers,
                                                                                  parallel, master)
        self.device, self.learning_rate = device, learning_rate  # the divergence message suggests a smaller one
        self.dcp_slots = [None, None]  # FSDP: the ckpt_dcp/ folders that ckpt_prev.pt and ckpt.pt name
        self.keep_previous = True  # False: ckpt.pt is the unreadable file a resume fell back from
        self.saved_step = None  # the step ckpt.pt holds
        self.wandb_run = None
        # the training keys changed on a resume (--resume_changes), in every checkpoint from then on:
        # [{"iter": step, "changes": {key: [before, after]}}]; the first 'before' of a key is its original value
        self.config_changes = []

    def resume(self, config, data_generator, epoch_windows, clipper, scaler):
        """resume() into this run's modules: the checkpoint it continues from. The config changes
        it allowed join the run's history, and the history's events from the resumed step on go
        (back) into log.jsonl, which resume() cut at that step."""
        state, path, changes = resume(self.out_dir, config, self.device, self.master, self.modules, self.optimizers,
                                      self.parallel, self.dcp_slots, data_generator, epoch_windows, clipper, scaler)
        self.keep_previous = path == os.path.join(self.out_dir, "ckpt.pt")
        self.saved_step = state["iter_num"]
        self.config_changes = state.get("config_changes", []) + (
            [{"iter": state["iter_num"], "changes": changes}] if changes else [])
        for event in self.config_changes:
            if event["iter"] >= state["iter_num"]:
                self.log({"iter": event["iter"], "event": "resume_changes", "changes": event["changes"]})
        return state

    def log(self, record):
        if self.master and (problem := tracking.append_record(os.path.join(self.out_dir, "log.jsonl"), record,
                                                              self.wandb_run)):
            exit_run(problem)

    def stop_if_diverged(self, values, where, step, check_weights=False):
        """End the run when training has diverged, before anything is written from it: values
        {name: float} are numbers already on the host (the logged losses, the evaluation), so this
        adds no device sync to a training step; check_weights also looks at every weight, agreed
        over all ranks. Exits with status 1 naming the step, the non-finite terms and the last
        checkpoint that is still good."""
        bad = [name for name, value in values.items() if isinstance(value, float) and not math.isfinite(value)]
        if check_weights and not parallelism.all_finite(self.modules["model"].parameters(), self.device):
            bad.append("weights")
        if bad:
            last = os.path.join(self.out_dir, "ckpt.pt" if self.keep_previous else "ckpt_prev.pt")
            exit_run(f"training diverged at step {step}: non-finite {', '.join(bad)} ({where}). Nothing from this "
                     f"step on was saved; the last good checkpoint is {last} (step {self.saved_step}). Resume from it "
                     f"with a smaller learning_rate (now {self.learning_rate:g}): --init_from=resume "
                     f"--learning_rate=...", self.master)

    def save(self, state, training, best=False):
        """ckpt.pt from run_state() + training_state(), and best=True also best.pt (weights only),
        once every weight is checked finite. Collective."""
        self.stop_if_diverged({}, "before writing a checkpoint", state["iter_num"], check_weights=True)
        state = {**state, "config_changes": self.config_changes}
        try:
            if best:
                save_weights(os.path.join(self.out_dir, "best.pt"), state, self.modules, self.parallel, self.master)
            save_full(self.out_dir, {**state, **training}, self.modules, self.optimizers, self.parallel, self.master,
                      self.dcp_slots, self.keep_previous)
        except CheckpointError as e:  # on every rank (agree)
            exit_run(str(e), self.master)
        self.keep_previous, self.saved_step = True, state["iter_num"]


def resume_command(argv, world_size):
    """The command that continues a stopped run: its own arguments with --init_from=resume (an
    --overwrite dropped: it would start the run over)."""
    args = [a for a in argv[1:] if not a.startswith(("--init_from=", "--overwrite="))]
    launcher = f"torchrun --nproc_per_node={world_size}" if world_size > 1 else "python"
    return f"{launcher} {os.path.basename(argv[0])} {shlex.join(args)} --init_from=resume"


def json_step(path):
    try:
        with open(path) as f:
            return json.load(f).get("iter_num")
    except (OSError, ValueError, AttributeError):
        return None


def load_latest(out_dir, device, master=True):
    """The newest readable full checkpoint of out_dir: ckpt.pt, or ckpt_prev.pt if ckpt.pt is
    missing or unreadable (rank 0 says so). Returns (checkpoint, path). A JSON that names
    another step than its weights (a kill between the two writes) is written again."""
    paths = [os.path.join(out_dir, name) for name in ("ckpt.pt", "ckpt_prev.pt")]
    if not any(os.path.exists(p) for p in paths):
        raise CheckpointError(f"init_from='resume' but there is no checkpoint at {paths[0]}")
    problems = []
    for path in paths:
        try:
            checkpoint = load(path, device, need=("model_config", "config", "iter_num", "data_rng", "torch_rng"))
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems and master:
            print(f"warning: {problems[0]}; resuming from the previous checkpoint {path} "
                     f"(step {checkpoint['iter_num']}) instead")
        if master and json_step(path[:-3] + ".json") != checkpoint["iter_num"]:  # killed between the two writes
            save_json(summary(checkpoint), path[:-3] + ".json")
        return checkpoint, path
    raise CheckpointError("cannot resume: " + "; ".join(problems))


def starting_weights(path, model_config, head_from_embedding, data_dir, device="cpu"):
    """The weights of another run's checkpoint, to start a new run from (load them before the model
    is parallelized: plain, whole tensors). The model must have the same shape (tie_weights and
    dropout may differ). head_from_embedding: the new untied LM head starts as a copy of the input
    embedding -- CWT's second stage gives a headless model a head that way (headless LM paper,
    Sec. 4.2). Raises CheckpointError for an unreadable file or other tokens than data_dir's,
    ValueError for another shape. On the CPU a single-file checkpoint (a one-process or DDP run's)
    is memory-mapped: under FSDP each rank reads only its shards' rows (parallelism.copy_shards);
    an FSDP run's best.pt or ckpt.pt is read back whole from its shards, the whole model in each
    process's CPU memory (not on its device)."""
    source = load_with_weights(path, device, mmap=device == "cpu")
    check_dataset(source, data_dir, whole=False)
    for key, value in source["model_config"].items():
        if key not in ("tie_weights", "dropout") and getattr(model_config, key) != value:
            raise ValueError(f"cannot start from {path}: model key '{key}' is {getattr(model_config, key)!r} here "
                             f"but {value!r} there")
    weights = dict(source["model"])
    if head_from_embedding:
        weights["lm_head.weight"] = weights["wte.weight"].clone()
    return weights


# the config keys that give the weights their shapes and the data its meaning: never changed on a resume
RESUME_KEYS = ("arch", "n_layer", "n_head", "n_embd", "ffn_hidden", "n_expert", "block_size", "bias", "tie_weights",
               "vocab_size", "low_resource", "separate_embeddings")
# the keys a resume may change: how long and how often, where and with what it runs, logging. Every
# other key changes what is trained or what the run's record means, and must equal the checkpoint's
# unless --resume_changes names it. The batch may be split differently (batch_size, accumulation,
# processes) as long as the global batch stays the same: the data order does not depend on the split.
RESUME_MAY_CHANGE = ("out_dir", "data_dir", "data_source", "init_from", "head_from_embedding", "overwrite",
                     "resume_changes", "max_iters", "eval_interval", "checkpoint_interval", "log_interval",
                     "final_eval", "dry_run", "check_memory", "device", "num_threads", "compile", "parallel",
                     "activation_checkpointing", "fsdp_keep_gathered", "fsdp_shard_size", "wandb_log", "wandb_project", "wandb_run_name", "batch_size",
                     "gradient_accumulation_steps", "global_batch_size")


def global_batch(config, processes):
    """Sequences per optimizer step over all processes."""
    return config["global_batch_size"] or config["batch_size"] * config["gradient_accumulation_steps"] * processes


def check_resumable(checkpoint, config, data_dir, processes=1):
    """Refuse to resume with a config that changes what the checkpoint means or how it goes on
    training, in one line listing every differing key with both values; the keys the user names
    in config['resume_changes'] (comma-separated) may differ, and are returned as {key: [the
    checkpoint's value, this config's]} for the run's record. Keys newer than the checkpoint count
    as their default. data_dir compares resolved paths: the same data named relatively or
    absolutely is the same data."""
    from configurator import train_defaults  # a key newer than the checkpoint: it trained with its default
    saved = {**train_defaults(), **checkpoint["config"]}  # (data_order before the key: 'random', its default)
    for key in RESUME_KEYS:
        if saved.get(key, config[key]) != config[key]:
            raise CheckpointError(f"cannot resume: key '{key}' is {config[key]!r} but the checkpoint was trained "
                                  f"with {saved[key]!r} (it fixes the weights' shapes or the data's meaning)")
    saved_data = checkpoint.get("data_dir_resolved") or os.path.realpath(saved["data_dir"])
    if os.path.realpath(data_dir) != saved_data:
        raise CheckpointError(f"cannot resume: key 'data_dir' is {data_dir!r} ({os.path.realpath(data_dir)}) but "
                              f"the checkpoint was trained on {saved_data}")
    check_dataset(checkpoint, data_dir)  # the same folder may hold other data by now
    differing = {key: [saved[key], value] for key, value in config.items()
                 if key not in RESUME_MAY_CHANGE and key in saved and saved[key] != value}
    batch = "global batch (sequences per step)"  # named by any of its keys in resume_changes
    if "processes" in checkpoint:  # a checkpoint from before the processes were recorded: per key
        before, after = global_batch(saved, checkpoint["processes"]), global_batch(config, processes)
        if before != after:
            differing[batch] = [before, after]
    allowed = {name.strip() for name in config.get("resume_changes", "").split(",") if name.strip()}
    if allowed & {"batch_size", "gradient_accumulation_steps", "global_batch_size"}:
        allowed.add(batch)
    refused = {key: values for key, values in differing.items() if key not in allowed}
    if refused:
        listed = "; ".join(f"{key}: {before!r} there, {after!r} here" for key, (before, after) in refused.items())
        names = ",".join("batch_size" if key == batch else key for key in refused)
        raise CheckpointError(f"cannot resume: this command changes how the run trains ({listed}). Resume with the "
                              f"checkpoint's values, or name what you mean to change: --resume_changes={names} "
                              f"(recorded in the log and the checkpoint)")
    return differing


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
    candidates = [override] if override else [checkpoint.get("data_dir_resolved"), checkpoint["config"]["data_dir"]]
    for candidate in candidates:
        if candidate and os.path.exists(os.path.join(candidate, "meta.json")):
            check_dataset(checkpoint, candidate)
            return candidate
    named = " or ".join(repr(c) for c in candidates if c)
    raise CheckpointError(f"the dataset of {path} is not at {named} (no meta.json there); pass --data_dir=...")


def trim_log(log_path, iter_num):
    """Drop the log lines from iter_num on (the resumed loop logs them again) and a torn last line
    (a kill in the middle of a write); a damaged line elsewhere is an error."""
    if not os.path.exists(log_path):
        return
    try:
        records = read_log(log_path, allow_empty=True)
    except LogError as e:
        raise CheckpointError(f"cannot resume: {e} (ckpt.pt itself may be fine: move the log aside to resume "
                              f"without it)") from None
    save_text("".join(json.dumps(r) + "\n" for r in records if r["iter"] < iter_num), log_path)


# full training state -----------------------------------------------------------------------------

def save_full(out_dir, state, modules, optimizers, parallel, master, dcp_slots, keep_previous=True):
    """Write ckpt.pt, keeping the previous one as ckpt_prev.pt (keep_previous=False: when ckpt.pt
    is the unreadable file a resume fell back from, it is replaced and ckpt_prev.pt stays). state: the plain part (config,
    step, RNG states, ...); modules: ModuleDict {'model', 'objective'}. Single process and DDP:
    rank 0 writes the whole weights and optimizer states. FSDP: every rank writes its shards into
    a slot of ckpt_dcp/ that neither ckpt.pt nor ckpt_prev.pt names, and ckpt.pt names it only
    once it is complete. dcp_slots: [previous, latest] slot names (None if none), updated here.
    Collective; whether the write succeeded is agreed over all ranks (agree)."""
    path = os.path.join(out_dir, "ckpt.pt")
    state = dict(state)
    if parallel == "fsdp":
        slot = next(s for s in DCP_SLOTS if s not in dcp_slots)
        has_optimizer_state = any(opt.state for opt in optimizers)  # none before the first step
        write_shards(os.path.join(out_dir, "ckpt_dcp", slot), modules, optimizers, has_optimizer_state, master, path)
        state.update(dcp=os.path.join("ckpt_dcp", slot), dcp_previous=dcp_slots[1], dcp_optimizers=has_optimizer_state,
                     objective_shapes={k: list(v.shape) for k, v in modules["objective"].state_dict().items()})
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
        parallelism.save_sharded(directory, modules, optimizers, with_optimizers=with_optimizers)
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
        raise CheckpointError(problem)


def save_weights(path, state, modules, parallel, master):
    """best.pt: the weights alone. One process and DDP: rank 0 writes them whole into best.pt.
    FSDP: like ckpt.pt, every rank writes its own shards (no optimizer state, nothing gathered
    onto one process) into best_dcp/step_<iter>/, and best.pt, written once they are complete,
    names that folder; the folders best.pt no longer names are removed. load_with_weights reads
    either kind whole (evaluate.py, sample.py, the HF export, init_from). Collective; the outcome is
    agreed over all ranks."""
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
        parallelism.load_sharded(os.path.join(out_dir, checkpoint["dcp"]), modules, optimizers,
                                 with_optimizers=checkpoint["dcp_optimizers"])
        dcp_slots[:] = [checkpoint.get("dcp_previous"), os.path.basename(checkpoint["dcp"])]
        return
    if parallel == "fsdp":
        raise CheckpointError(f"cannot resume: {path} holds whole weights (written with parallel="
                              f"'{checkpoint['config'].get('parallel', 'none')}'); resume it with that setting")
    modules["model"].load_state_dict(checkpoint["model"])
    try:
        modules["objective"].load_state_dict(checkpoint.get("objective", {}))
    except RuntimeError:
        raise CheckpointError(objective_mismatch) from None
    for opt, opt_state in zip(optimizers, checkpoint["optimizers"]):
        opt.load_state_dict(opt_state)
