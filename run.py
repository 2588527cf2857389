"""
A training run's directory: who owns it, what it holds, and how a run continues in it. checkpoint.py
says what a checkpoint holds and how it is written; this module says when and where.

A run's out_dir holds
    ckpt.pt / ckpt.json            the latest full state: weights, optimizer, step, data and RNG state
    ckpt_prev.pt / ckpt_prev.json  the full state before it, kept in case the latest cannot be read
    best.pt / best.json            weights only, the best validation loss so far (what evaluate.py scores)
    log.jsonl, metrics.json, ...   the run's record (RUN_FILES)
    run.lock                       flock-ed by the run writing out_dir (lock_run); names it; not a run file
Under FSDP the full state is sharded into ckpt_dcp/<slot>/ and best.pt's weights into
best_dcp/step_<iter>/ (checkpoint.py).

    open_run      one run per out_dir (the lock), 'auto' = resume if there is a checkpoint, else start
                  (rank 0 decides for every rank); a fresh run never replaces another unless told to
    RunFiles      what a run writes while it trains: log lines, checkpoints, the divergence stop
    resume        continue exactly where the newest readable checkpoint stopped, if the config allows
                  (RESUME_MAY_CHANGE, check_resumable: the resume policy)

Errors a user can fix are raised as checkpoint.CheckpointError with one line that names the file or key.
"""

import errno
import fcntl
import json
import math
import os
import shlex
import signal
import shutil
import socket
import time


import evaluate
import parallelism
import tracking
from checkpoint import (BEST_DCP, RESUME_NEEDS, CheckpointError, agree, check_dataset, load, load_latest,
                        restore, save_full, save_weights)
from errors import UserError
from model import GPTConfig
from utils import LogError, PathError, read_log, save_text, write_failure


# the files of a run: a fresh run refuses an out_dir holding any of them
RUN_FILES = ("ckpt.pt", "ckpt.json", "ckpt_prev.pt", "ckpt_prev.json", "best.pt", "best.json", "log.jsonl",
             "metrics.json", "marginalization.json", tracking.ID_FILE)


LOCK_FILE = "run.lock"  # held (flock) by the one run that writes out_dir; not a run file


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
        reason = (write_failure(out_dir, e) if told_apart
                  else f"cannot use {out_dir} as a run's directory ({e.strerror})")
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
        raise CheckpointError(f"{out_dir} is in use by a run that is still going "
                              f"({holder or 'holder unknown'}); "
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
    it holds no run or a run stopped before its first checkpoint (the same command starts a job and
    continues it when it is requeued, however early the job was stopped). Other values are returned
    as they are."""
    existing = existing_run(out_dir)
    if init_from != "auto":
        return init_from
    return "resume" if "ckpt.pt" in existing or "ckpt_prev.pt" in existing else "scratch"


def keep_aside(out_dir, existing):
    """A run stopped before its first checkpoint, started again by init_from='auto': its files (the
    log of what happened) move into out_dir/restarted_<k>/, nothing is deleted. Returns that folder."""
    k = 1
    while os.path.exists(os.path.join(out_dir, f"restarted_{k}")):
        k += 1
    folder = os.path.join(out_dir, f"restarted_{k}")
    os.makedirs(folder)
    for name in existing + [d for d in ("ckpt_dcp", BEST_DCP) if os.path.isdir(os.path.join(out_dir, d))]:
        os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    return folder


def open_run(out_dir, init_from, overwrite, master, command):
    """Take out_dir for this run, before anything in it changes: rank 0 locks it (lock_run), 'auto'
    becomes 'resume' or 'scratch' (start_of), and a fresh run refuses a run already there (a
    forgotten --init_from=resume would lose it) unless overwrite, which then deletes it whole.
    'auto' on a run stopped before its first checkpoint starts it again and keeps its files
    (keep_aside). Rank 0 decides alone, on what it sees, and every rank takes its decision (a rank
    whose view of a shared file system lags cannot start fresh beside ranks that resume). Returns
    (lock or None, init_from). Collective: a CheckpointError is raised on every rank."""
    lock, problem, existing, restart = None, None, [], init_from == "auto"
    if master:
        try:
            lock = lock_run(out_dir, command)
            init_from = start_of(init_from, out_dir)
            existing = existing_run(out_dir) if init_from != "resume" else []
            if existing and not (overwrite or restart):
                raise CheckpointError(f"{out_dir} already holds a run ({', '.join(existing)}). Continue it "
                                      f"with --init_from=resume, start it over on purpose with "
                                      f"--overwrite=True, or give another --out_dir.")
        except CheckpointError as e:
            problem = str(e)
    problem, init_from = parallelism.from_rank_0((problem, init_from))
    if problem is not None:
        raise CheckpointError(problem, agreed=True)
    if master:
        if existing and restart and not overwrite:
            folder = keep_aside(out_dir, existing)
            print(f"{out_dir} held a run stopped before its first checkpoint: starting it again; "
                  f"what it wrote is in {folder}")
        elif existing:
            clear_run(out_dir)
        remove_temporaries(out_dir)  # of a write that was killed
    return lock, init_from


class RunComplete(UserError):
    """A resume of a run that already reached its max_iters: nothing to do but the final evaluation a
    stop cut short, if any (its line is printed on stdout and the status is 0, so a requeued job of a
    finished run ends); every rank finds it in the checkpoint they agreed on."""
    status, agreed = 0, True


def load_agreed(out_dir, device, master):
    """The checkpoint to resume from, the same on every rank: rank 0 picks it (load_latest: ckpt.pt,
    or ckpt_prev.pt if that cannot be read) and sends its path and step; every other rank loads that
    path and must find that step there, or every rank ends with one line naming what that rank saw.
    Returns (checkpoint, path). Collective."""
    checkpoint, path, problem = None, None, None
    if master:
        try:
            checkpoint, path = load_latest(out_dir, device, master)
        except CheckpointError as e:
            problem = str(e)
    problem, path, step = parallelism.from_rank_0((problem, path, checkpoint and checkpoint["iter_num"]))
    if problem is not None:
        raise CheckpointError(problem, agreed=True)
    if not master:
        try:
            checkpoint = load(path, device, need=RESUME_NEEDS)
            if checkpoint["iter_num"] != step:
                raise CheckpointError(f"{path} holds step {checkpoint['iter_num']}")
        except CheckpointError as e:
            problem = (f"cannot resume: rank 0 resumes from step {step} of {path}, but rank "
                       f"{parallelism.rank()} finds: {e}. Every rank must see out_dir as rank 0 does "
                       f"(one shared file system, the same path); nothing was changed")
    agree(problem)
    return checkpoint, path


def resume(out_dir, config, device, master, modules, optimizers, parallel, dcp_slots, training):
    """Continue the run in out_dir exactly: the newest readable full checkpoint (load_latest),
    checked against config, loaded into modules and optimizers and into training (a
    checkpoint.TrainingState: data order, RNGs, AdaGC, loss scale, FLOPs); the log lines from its
    step on are dropped (the loop logs them again: the evaluation at that step, the steps a killed
    run logged after its checkpoint). Returns (checkpoint, path, changes): changes as
    check_resumable returns them."""
    checkpoint, path = load_agreed(out_dir, device, master)
    try:  # every rank checks and loads the same checkpoint: a refusal is the same on each (rank 0 says it)
        changes = check_resumable(checkpoint, config, config["data_dir"], parallelism.world_size())
        if checkpoint["iter_num"] >= config["max_iters"]:  # before anything is loaded, trimmed or saved
            complete = (f"{out_dir} holds a complete run (step {checkpoint['iter_num']}, max_iters "
                        f"{config['max_iters']})")
            if os.path.exists(os.path.join(out_dir, "metrics.json")) or not config["final_eval"]:
                raise RunComplete(f"{complete}: nothing to do, nothing changed; to train it further, resume "
                                  f"with a larger --max_iters")
            # a stop in its last step or its final evaluation: the resume (a grid's, a requeued job's)
            # runs that evaluation, on rank 0, with the FLOPs the run executed, and writes only metrics.json
            if master:
                evaluate.write_run_metrics(out_dir, checkpoint.get("flops_done") or {}, device)
            raise RunComplete(f"{complete} without its final evaluation: wrote metrics.json, changed nothing "
                              f"else; to train it further, resume with a larger --max_iters")
        restore(checkpoint, path, out_dir, modules, optimizers, parallel, dcp_slots)
    except CheckpointError as e:
        e.agreed = True
        raise
    if master:
        trim_log(os.path.join(out_dir, "log.jsonl"), checkpoint["iter_num"])
    training.load_state_dict(checkpoint)
    if master:
        print(f"resumed from {path} at iter {checkpoint['iter_num']}"
              + "".join(f"; {key} {before!r} -> {after!r}" for key, (before, after) in changes.items()))
    return checkpoint, path, changes


class RunFiles:
    """What a run writes in out_dir while it trains, every failure a UserError that ends the run
    with one line (utils.end_with) and ckpt.pt intact: log.jsonl (and W&B), ckpt.pt with the
    previous one kept as ckpt_prev.pt (FSDP: shards in ckpt_dcp/), best.pt. A non-finite loss or
    weight ends the run before anything from it is written, naming the last good checkpoint.
    modules: ModuleDict {'model', 'objective'}; under torchrun only rank 0 (master) writes files."""

    def __init__(self, out_dir, modules, optimizers, parallel, master, device, learning_rate):
        self.out_dir, self.modules, self.optimizers, self.parallel, self.master = (
            out_dir, modules, optimizers, parallel, master)
        # learning_rate: the divergence message suggests a smaller one
        self.device, self.learning_rate = device, learning_rate
        self.dcp_slots = [None, None]  # FSDP: the ckpt_dcp/ folders that ckpt_prev.pt and ckpt.pt name
        self.keep_previous = True  # False: ckpt.pt is the unreadable file a resume fell back from
        self.saved_step = None  # the step ckpt.pt holds
        self.wandb_run = None
        # the training keys changed on a resume (--resume_changes), in every checkpoint from then on:
        # [{"iter": step, "changes": {key: [before, after]}}]; the first 'before' of a key is its
        # original value
        self.config_changes = []

    def resume(self, config, training):
        """resume() into this run's modules: the checkpoint it continues from. The config changes
        it allowed join the run's history, and the history's events from the resumed step on go
        (back) into log.jsonl, which resume() cut at that step."""
        state, path, changes = resume(self.out_dir, config, self.device, self.master, self.modules,
                                      self.optimizers, self.parallel, self.dcp_slots, training)
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
            raise PathError(problem)

    def stop_if_diverged(self, values, where, step, check_weights=False):
        """End the run when training has diverged, before anything is written from it: values
        {name: float} are numbers already on the host (the logged losses, the evaluation), so this
        adds no device sync to a training step; check_weights also looks at every weight, agreed
        over all ranks. A UserError on every rank names the step, the non-finite terms and the
        last checkpoint that is still good."""
        bad = [name for name, value in values.items()
               if isinstance(value, float) and not math.isfinite(value)]
        if check_weights and not parallelism.all_finite(self.modules["model"].parameters(), self.device):
            bad.append("weights")
        if bad:
            if self.saved_step is None:  # before the run's first checkpoint
                then = (f"No checkpoint was written before it: start the run again with other settings "
                        f"(--overwrite=True), e.g. a smaller learning_rate (now {self.learning_rate:g})")
            else:
                last = os.path.join(self.out_dir, "ckpt.pt" if self.keep_previous else "ckpt_prev.pt")
                then = (f"The last good checkpoint is {last} (step {self.saved_step}). Resume from it "
                        f"with a smaller learning_rate (now {self.learning_rate:g}): --init_from=resume "
                        f"--resume_changes=learning_rate --learning_rate=...")
            raise UserError(f"training diverged at step {step}: non-finite {', '.join(bad)} ({where}). "
                            f"Nothing from this step on was saved. {then}", agreed=True)

    def save(self, state, training, best=False):
        """ckpt.pt from checkpoint.run_state() and training (a checkpoint.TrainingState), and
        best=True also best.pt (weights only), once every weight is checked finite. Collective."""
        self.stop_if_diverged({}, "before writing a checkpoint", state["iter_num"], check_weights=True)
        state = {**state, "config_changes": self.config_changes}
        if best:  # a CheckpointError is raised on every rank (checkpoint.agree)
            save_weights(os.path.join(self.out_dir, "best.pt"), state, self.modules, self.parallel,
                         self.master)
        save_full(self.out_dir, {**state, **training.state_dict()}, self.modules, self.optimizers,
                  self.parallel, self.master, self.dcp_slots, self.keep_previous)
        self.keep_previous, self.saved_step = True, state["iter_num"]


def stopped_message(signum, step, out_dir, argv, world_size):
    """What rank 0 says when a stop signal (signum, whichever rank got it) ended the run, its step
    finished and saved: how to go on."""
    return (f"stopped by {signal.Signals(signum).name} at step {step}; the full state "
            f"is in {os.path.join(out_dir, 'ckpt.pt')}. Resume with:\n  {resume_command(argv, world_size)}")


def resume_command(argv, world_size):
    """The command that continues a stopped run: the launch it had (launcher) and its own arguments
    with --init_from=resume (an --overwrite dropped: it would start the run over)."""
    args = [a for a in argv[1:] if not a.startswith(("--init_from=", "--overwrite="))]
    parts = (launcher(argv[0], world_size), os.path.basename(argv[0]), shlex.join(args), "--init_from=resume")
    return " ".join(part for part in parts if part)


def launcher(script, world_size):
    """How this process was started: 'python', or torchrun with the options it was given (its command
    line, the parent's; where that cannot be read, the shape torchrun describes in the environment:
    nodes and processes per node), plus a note when each node runs its own copy."""
    if world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return "python"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().decode().split("\0")[:-1]
        start = next(i for i, a in enumerate(parent) if a.endswith(("torchrun", "torch.distributed.run"))) + 1
        options = shlex.join(parent[start:parent.index(script)])
    except (OSError, StopIteration, ValueError):  # no /proc, or not torchrun's child
        options = f"--nnodes={nodes} --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', str(world_size))}"
    return f"{'' if nodes == 1 else f'(on each of the {nodes} nodes) '}torchrun {options}"


# the config keys that give the weights their shapes and the data its meaning: never changed on a resume
RESUME_KEYS = ("arch", "n_layer", "n_head", "n_embd", "ffn_hidden", "n_expert", "block_size", "bias",
               "rope_layout", "tie_weights", "vocab_size", "low_resource", "separate_embeddings")


# the keys a resume may change: how long and how often, where and with what it runs, logging. Every
# other key changes what is trained or what the run's record means, and must equal the checkpoint's
# unless --resume_changes names it. The batch may be split differently (batch_size, accumulation,
# processes) as long as the global batch stays the same: the data order does not depend on the split.
RESUME_MAY_CHANGE = ("out_dir", "data_dir", "data_source", "init_from", "head_from_embedding", "overwrite",
                     "resume_changes", "max_iters", "eval_interval", "checkpoint_interval", "log_interval",
                     "final_eval", "dry_run", "check_memory", "device", "num_threads", "compile", "parallel",
                     "activation_checkpointing", "fsdp_keep_gathered", "fsdp_shard_size", "wandb_log",
                     "wandb_project", "wandb_run_name", "batch_size", "gradient_accumulation_steps",
                     "global_batch_size", "ce_chunk_size")


def global_batch(config, processes):
    """Sequences per optimizer step over all processes."""
    return (config["global_batch_size"]
            or config["batch_size"] * config["gradient_accumulation_steps"] * processes)


def check_resumable(checkpoint, config, data_dir, processes=1):
    """Refuse to resume with a config that changes what the checkpoint means or how it goes on
    training, in one line listing every differing key with both values; the keys the user names
    in config['resume_changes'] (comma-separated) may differ, and are returned as {key: [the
    checkpoint's value, this config's]} for the run's record. Keys newer than the checkpoint count
    as their default. The data is compared by content (checkpoint.check_dataset: tokenizer,
    vocabulary, split sizes and the hashes recorded at preparation), wherever it now is."""
    from configurator import train_defaults  # a key newer than the checkpoint: it trained with its default
    saved = {**train_defaults(), **checkpoint["config"]}  # (data_order before the key: 'random', its default)
    if "rope_layout" not in checkpoint["config"]:  # written before the layout was recorded
        saved["rope_layout"] = GPTConfig.from_checkpoint({"arch": saved["arch"]}).rope_layout
    for key in RESUME_KEYS:
        if saved.get(key, config[key]) != config[key]:
            raise CheckpointError(f"cannot resume: key '{key}' is {config[key]!r} but the checkpoint was "
                                  f"trained with {saved[key]!r} (it fixes the weights' shapes or the data's "
                                  f"meaning)")
    # the data is its content, not its path: a copy elsewhere (a node's local scratch) resumes; another
    # dataset, or the same folder holding other tokens by now, is refused by what the preparation recorded
    check_dataset(checkpoint, data_dir)
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
        listed = "; ".join(f"{key}: {before!r} there, {after!r} here"
                           for key, (before, after) in refused.items())
        names = ",".join("batch_size" if key == batch else key for key in refused)
        raise CheckpointError(f"cannot resume: this command changes how the run trains ({listed}). "
                              f"Resume with the checkpoint's values, or name what you mean to change: "
                              f"--resume_changes={names} (recorded in the log and the checkpoint)")
    return differing


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
