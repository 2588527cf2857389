"""A training run's directory: who owns it (open_run: one run per out_dir),
what the run writes there (RunFiles), and how it continues (resume, if
check_resumable allows). checkpoint.py says what a checkpoint holds.
Design notes: docs/runs.md
"""

import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import socket
import time

import parallelism
import scoring
import tracking
from checkpoint import (BEST_DCP, RESUME_NEEDS, CheckpointError, Sharded,
                        Whole, agree, check_dataset, load, load_latest)
from errors import UserError
from model import GPTConfig
from utils import (NO_PERMISSION, NO_SPACE, LogError, PathError, read_log,
                   remove_leftovers, save_text, write_failure)

# the files of a run: a fresh run refuses an out_dir holding any of them
RUN_FILES = ("ckpt.pt", "ckpt.json", "ckpt_prev.pt", "ckpt_prev.json",
             "best.pt", "best.json", "log.jsonl", "metrics.json",
             "marginalization.json", tracking.ID_FILE)
# held (flock) by the one run that writes out_dir; not a run file
LOCK_FILE = "run.lock"
SHARD_FOLDERS = ("ckpt_dcp", BEST_DCP)


def existing_run(out_dir):
    """The run files already in out_dir (empty if none)."""
    return [name for name in RUN_FILES
            if os.path.exists(os.path.join(out_dir, name))]


def clear_run(out_dir):
    """Delete a run's files and shards (--overwrite=True), nothing else."""
    for name in existing_run(out_dir):
        os.remove(os.path.join(out_dir, name))
    for shards in SHARD_FOLDERS:
        shutil.rmtree(os.path.join(out_dir, shards), ignore_errors=True)


def lock_run(out_dir, command):
    """Lock out_dir/run.lock (flock) for this process's life, naming the
    holder in it. Returns the open lock file: keep it open."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"out_dir {out_dir} is a file, not a directory; "
                              f"give another --out_dir")
    path = os.path.join(out_dir, LOCK_FILE)
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        lock = open(fd, "r+")
    except OSError as e:
        if e.errno in NO_PERMISSION + NO_SPACE:
            reason = write_failure(out_dir, e)
        else:
            reason = (f"cannot use {out_dir} as a run's directory "
                      f"({e.strerror})")
        raise CheckpointError(
            f"{reason}; give an --out_dir you can write to") from None
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
        raise CheckpointError(
            f"{out_dir} is in use by a run that is still going "
            f"({holder or 'holder unknown'}); wait for it to end or stop it, "
            f"or give another --out_dir") from None
    except OSError as e:  # ENOLCK: a network file system without locks
        lock.close()
        raise CheckpointError(
            f"cannot lock {path} ({e.strerror}): the file system does not "
            f"support locks; put out_dir on a local or lock-capable file "
            f"system (docs/runs.md)") from None
    # written into the locked file itself: a rename would unlock the path
    lock.truncate(0)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
               f"{started}: {' '.join(command)}\n")
    lock.flush()
    return lock


def start_of(init_from, out_dir):
    """init_from, with 'auto' as 'resume' if out_dir holds a checkpoint,
    else 'scratch'."""
    if init_from != "auto":
        return init_from
    existing = existing_run(out_dir)
    if "ckpt.pt" in existing or "ckpt_prev.pt" in existing:
        return "resume"
    return "scratch"


def keep_aside(out_dir, existing):
    """Move a run's files into a new out_dir/restarted_<k>/, returned."""
    k = 1
    while os.path.exists(os.path.join(out_dir, f"restarted_{k}")):
        k += 1
    folder = os.path.join(out_dir, f"restarted_{k}")
    os.makedirs(folder)
    shards = [d for d in SHARD_FOLDERS
              if os.path.isdir(os.path.join(out_dir, d))]
    for name in existing + shards:
        os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    return folder


def open_run(out_dir, init_from, overwrite, master, command):
    """Take out_dir for this run: rank 0 locks it and decides for all
    what 'auto' means and whether a run already there may be replaced.
    Returns (lock or None, init_from). Collective."""
    lock = None
    problem = None
    existing = []
    restart = init_from == "auto"
    if master:
        try:
            lock = lock_run(out_dir, command)
            init_from = start_of(init_from, out_dir)
            if init_from != "resume":
                existing = existing_run(out_dir)
            if existing and not (overwrite or restart):
                raise CheckpointError(
                    f"{out_dir} already holds a run ({', '.join(existing)}). "
                    f"Continue it with --init_from=resume, start it over on "
                    f"purpose with --overwrite=True, or give another "
                    f"--out_dir.")
        except CheckpointError as e:
            problem = str(e)
    problem, init_from = parallelism.from_rank_0((problem, init_from))
    if problem is not None:
        raise CheckpointError(problem, agreed=True)
    if master:
        if existing and restart and not overwrite:
            folder = keep_aside(out_dir, existing)
            print(f"{out_dir} held a run stopped before its first checkpoint: "
                  f"starting it again; what it wrote is in {folder}")
        elif existing:
            clear_run(out_dir)
        remove_leftovers(out_dir, RUN_FILES)  # of a killed write
    return lock, init_from


class RunComplete(UserError):
    """A resume of a run that reached max_iters: status 0, so a requeued
    job of a finished run ends."""
    status = 0
    agreed = True


def load_agreed(out_dir, device, master):
    """(checkpoint, path) to resume from, as rank 0 picked it; every
    rank must find the same step there, or all end. Collective."""
    checkpoint = None
    path = None
    problem = None
    if master:
        try:
            checkpoint, path = load_latest(out_dir, device)
        except CheckpointError as e:
            problem = str(e)
    step = checkpoint and checkpoint["iter_num"]
    problem, path, step = parallelism.from_rank_0((problem, path, step))
    if problem is not None:
        raise CheckpointError(problem, agreed=True)
    if not master:
        try:
            checkpoint = load(path, device, need=RESUME_NEEDS)
            if checkpoint["iter_num"] != step:
                raise CheckpointError(
                    f"{path} holds step {checkpoint['iter_num']}")
        except CheckpointError as e:
            problem = (f"cannot resume: rank 0 resumes from step {step} of "
                       f"{path}, but rank {parallelism.rank()} finds: {e}. "
                       f"Every rank must see out_dir as rank 0 does (one "
                       f"shared file system, the same path); nothing was "
                       f"changed")
    agree(problem)
    return checkpoint, path


def end_if_complete(checkpoint, config, out_dir, master, device):
    """RunComplete if the checkpoint reached max_iters, after the final
    evaluation a stop cut short (rank 0 writes only metrics.json)."""
    step = checkpoint["iter_num"]
    if step < config["max_iters"]:
        return
    complete = (f"{out_dir} holds a complete run (step {step}, max_iters "
                f"{config['max_iters']})")
    if (os.path.exists(os.path.join(out_dir, "metrics.json"))
            or not config["final_eval"]):
        raise RunComplete(
            f"{complete}: nothing to do, nothing changed; to train it "
            f"further, resume with a larger --max_iters")
    if master:
        flops = checkpoint.get("flops_done") or {}
        scoring.write_run_metrics(out_dir, flops, device)
    raise RunComplete(
        f"{complete} without its final evaluation: wrote metrics.json, "
        f"changed nothing else; to train it further, resume with a larger "
        f"--max_iters")


class RunFiles:
    """What a run writes while it trains: log.jsonl (and W&B), ckpt.pt,
    best.pt (Sharded under FSDP, else Whole)."""

    def __init__(self, out_dir, modules, optimizers, parallel, master,
                 device, learning_rate):
        self.out_dir = out_dir
        self.modules = modules
        kind = Sharded if parallel == "fsdp" else Whole
        self.checkpoints = kind(out_dir, modules, optimizers, master)
        self.master = master
        self.device = device
        self.learning_rate = learning_rate  # for the divergence message
        # False: ckpt.pt is the unreadable file a resume fell back from
        self.keep_previous = True
        self.saved_step = None  # the step ckpt.pt holds
        self.wandb_run = None
        # [{"iter": step, "changes": {key: [before, after]}}]
        self.config_changes = []

    def resume(self, config, training):
        """Continue exactly from the newest readable checkpoint, checked
        against config, into the modules and training (a TrainingState).
        Returns the checkpoint."""
        out_dir = self.out_dir
        state, path = load_agreed(out_dir, self.device, self.master)
        step = state["iter_num"]
        try:  # every rank checks the same checkpoint: the same refusal
            changes = check_resumable(state, config, config["data_dir"],
                                      parallelism.world_size())
            end_if_complete(state, config, out_dir, self.master, self.device)
            self.checkpoints.restore(state, path)
        except CheckpointError as e:
            e.agreed = True
            raise
        if self.master:
            trim_log(os.path.join(out_dir, "log.jsonl"), step)
        training.load_state_dict(state)
        if self.master:
            told = "".join(f"; {key} {before!r} -> {after!r}"
                           for key, (before, after) in changes.items())
            print(f"resumed from {path} at iter {step}{told}")
        self.keep_previous = path == os.path.join(out_dir, "ckpt.pt")
        self.saved_step = step
        self.config_changes = list(state.get("config_changes", []))
        if changes:
            self.config_changes.append({"iter": step, "changes": changes})
        for event in self.config_changes:
            if event["iter"] >= step:
                self.log({"iter": event["iter"], "event": "resume_changes",
                          "changes": event["changes"]})
        return state

    def log(self, record):
        if not self.master:
            return
        path = os.path.join(self.out_dir, "log.jsonl")
        if problem := tracking.append_record(path, record, self.wandb_run):
            raise PathError(problem)

    def stop_if_diverged(self, values, where, step, check_weights=False):
        """End the run on every rank if values ({name: float} on the
        host) or, with check_weights, the weights are not finite, naming
        the last good checkpoint."""
        bad = [name for name, value in values.items()
               if isinstance(value, float) and not math.isfinite(value)]
        if check_weights:
            weights = self.modules["model"].parameters()
            if not parallelism.all_finite(weights, self.device):
                bad.append("weights")
        if not bad:
            return
        lr = f"a smaller learning_rate (now {self.learning_rate:g})"
        if self.saved_step is None:
            then = (f"No checkpoint was written before it: start the run "
                    f"again with other settings (--overwrite=True), e.g. {lr}")
        else:
            name = "ckpt.pt" if self.keep_previous else "ckpt_prev.pt"
            then = (f"The last good checkpoint is "
                    f"{os.path.join(self.out_dir, name)} (step "
                    f"{self.saved_step}). Resume from it with {lr}: "
                    f"--init_from=resume --resume_changes=learning_rate "
                    f"--learning_rate=...")
        raise UserError(
            f"training diverged at step {step}: non-finite {', '.join(bad)} "
            f"({where}). Nothing from this step on was saved. "
            f"{then}", agreed=True)

    def save(self, state, training, best=False):
        """ckpt.pt from run_state() and training (a TrainingState), and
        best.pt if best, once the weights are finite. Collective."""
        step = state["iter_num"]
        self.stop_if_diverged({}, "before writing a checkpoint", step,
                              check_weights=True)
        state = {**state, "config_changes": self.config_changes}
        if best:
            self.checkpoints.save_best(state)
        self.checkpoints.save_full({**state, **training.state_dict()},
                                   self.keep_previous)
        self.keep_previous = True
        self.saved_step = step


def stopped_message(signum, step, out_dir, argv, world_size):
    """What rank 0 says when a stop signal ended the run: how to go on."""
    return (f"stopped by {signal.Signals(signum).name} at step {step}; the "
            f"full state is in {os.path.join(out_dir, 'ckpt.pt')}. Resume "
            f"with:\n  {resume_command(argv, world_size)}")


def resume_command(argv, world_size):
    """The command that continues a stopped run (without --overwrite)."""
    args = [a for a in argv[1:]
            if not a.startswith(("--init_from=", "--overwrite="))]
    parts = (launcher(argv[0], world_size), os.path.basename(argv[0]),
             shlex.join(args), "--init_from=resume")
    return " ".join(part for part in parts if part)


def launcher(script, world_size):
    """How this process was started: 'python', or torchrun and its options."""
    if world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return "python"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().decode().split("\0")[:-1]
        names = ("torchrun", "torch.distributed.run")
        start = next(i for i, a in enumerate(parent)
                     if a.endswith(names)) + 1
        options = shlex.join(parent[start:parent.index(script)])
    except (OSError, StopIteration, ValueError):  # not torchrun's child
        per_node = os.environ.get("LOCAL_WORLD_SIZE", str(world_size))
        options = f"--nnodes={nodes} --nproc_per_node={per_node}"
    each = "" if nodes == 1 else f"(on each of the {nodes} nodes) "
    return f"{each}torchrun {options}"


# what gives the weights their shapes and the data its meaning: a resume
# never changes them
RESUME_KEYS = ("arch", "n_layer", "n_head", "n_embd", "ffn_hidden", "n_expert",
               "block_size", "bias", "rope_layout", "tie_weights",
               "vocab_size", "low_resource", "separate_embeddings")

# what a resume may change (docs/runs.md); every other key must equal the
# checkpoint's unless --resume_changes names it
RESUME_MAY_CHANGE = (
    "out_dir", "data_dir", "data_source", "init_from", "head_from_embedding",
    "overwrite", "resume_changes", "max_iters", "eval_interval",
    "checkpoint_interval", "log_interval", "final_eval", "dry_run",
    "check_memory", "device", "num_threads", "compile", "parallel",
    "activation_checkpointing", "fsdp_keep_gathered", "fsdp_shard_size",
    "collective_timeout", "hang_factor",
    "wandb_log", "wandb_project", "wandb_run_name", "batch_size",
    "gradient_accumulation_steps", "global_batch_size", "ce_chunk_size")


def global_batch(config, processes):
    """Sequences per optimizer step over all processes."""
    return (config["global_batch_size"]
            or config["batch_size"] * config["gradient_accumulation_steps"]
            * processes)


def check_resumable(checkpoint, config, data_dir, processes=1):
    """Refuse a config that changes how the checkpoint trains on, unless
    resume_changes names the keys: returned as {key: [before, after]}."""
    from configurator import train_defaults
    saved = {**train_defaults(), **checkpoint["config"]}
    if "rope_layout" not in checkpoint["config"]:  # not recorded then
        arch = {"arch": saved["arch"]}
        saved["rope_layout"] = GPTConfig.from_checkpoint(arch).rope_layout
    for key in RESUME_KEYS:
        if saved.get(key, config[key]) != config[key]:
            raise CheckpointError(
                f"cannot resume: key '{key}' is {config[key]!r} but the "
                f"checkpoint was trained with {saved[key]!r} (it fixes the "
                f"weights' shapes or the data's meaning)")
    check_dataset(checkpoint, data_dir)
    differing = {key: [saved[key], value] for key, value in config.items()
                 if key not in RESUME_MAY_CHANGE and key in saved
                 and saved[key] != value}
    batch = "global batch (sequences per step)"  # any of its keys names it
    if "processes" in checkpoint:  # else compared per key
        before = global_batch(saved, checkpoint["processes"])
        after = global_batch(config, processes)
        if before != after:
            differing[batch] = [before, after]
    named = config.get("resume_changes", "").split(",")
    allowed = {name.strip() for name in named if name.strip()}
    if allowed & {"batch_size", "gradient_accumulation_steps",
                  "global_batch_size"}:
        allowed.add(batch)
    refused = {key: values for key, values in differing.items()
               if key not in allowed}
    if refused:
        listed = "; ".join(f"{key}: {before!r} there, {after!r} here"
                           for key, (before, after) in refused.items())
        names = ",".join("batch_size" if key == batch else key
                         for key in refused)
        raise CheckpointError(
            f"cannot resume: this command changes how the run trains "
            f"({listed}). Resume with the checkpoint's values, or name what "
            f"you mean to change: --resume_changes={names} (recorded in the "
            f"log and the checkpoint)")
    return differing


def trim_log(log_path, iter_num):
    """Drop the log lines from iter_num on (logged again) and a torn last
    line; a damaged line elsewhere is an error."""
    if not os.path.exists(log_path):
        return
    try:
        records = read_log(log_path, allow_empty=True)
    except LogError as e:
        raise CheckpointError(
            f"cannot resume: {e} (ckpt.pt itself may be fine: move the log "
            f"aside to resume without it)") from None
    kept = [json.dumps(r) + "\n" for r in records if r["iter"] < iter_num]
    save_text("".join(kept), log_path)
