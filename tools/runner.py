"""
Runs a grid's training runs for tools/compare.py, `workers` train.py
processes at a time, and archives each as it finishes. How a call runs,
reuses, refuses and records its runs: docs/runs.md#a-grids-runs.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np
import torch
from tqdm import tqdm

from checkpoint import load_with_weights
from errors import UsageError, UserError
from tools import identity
from tools.grids import GRID_ARGS, POOLABLE, UNRECORDED_RUNS, run_dir, runs_of
from tools.identity import read_json
from utils import (atomic_write, choose_device, measure_matmul_flops, read_log, save_json,
                   save_text)

RECORD_EVERY_S = 60  # how often a running call rewrites its wall.json record


def has_metrics(directory):
    """Whether the run (or stage) in directory finished."""
    return os.path.exists(os.path.join(directory, "metrics.json"))


def stage_dir(out_dir, stage, stages):
    """Where stage k of a chain runs: out_dir/stage<k>, the last one in out_dir itself."""
    return out_dir if stage == stages - 1 else os.path.join(out_dir, f"stage{stage}")


def launch(config, seed, out_dir, threads, overrides):
    """Train one run (a train.py process per unfinished stage); its wall
    time counts earlier calls' (stopped_wall.json)."""
    if has_metrics(out_dir):
        return
    t0 = time.time()
    stopped_path = os.path.join(out_dir, "stopped_wall.json")
    earlier = read_json(stopped_path)["wall_s"] if os.path.exists(stopped_path) else 0.0
    identity.mark_start(out_dir)
    planned = planned_commands(config, seed, overrides)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    commands = []
    flops = 0
    try:
        for stage, cmd in enumerate(planned):
            directory = stage_dir(out_dir, stage, len(planned))
            os.makedirs(directory, exist_ok=True)
            cmd = cmd + [f"--out_dir={directory}", f"--num_threads={threads}"]
            if stage:
                previous = os.path.join(out_dir, f"stage{stage - 1}", "best.pt")
                cmd.append(f"--init_from={previous}")
            commands.append(cmd)
            if not has_metrics(directory):
                run_stage(cmd, directory, env)
            flops += run_flops(directory) or 0
    except BaseException:
        save_json({"wall_s": earlier + time.time() - t0}, stopped_path)
        raise
    save_json({"wall_s": earlier + time.time() - t0, "threads": threads,
               "commands": commands, "flops": flops,
               "identity": identity.record(commands),
               "provenance": identity.provenance(commands, identity.started(out_dir))},
              os.path.join(out_dir, "run.json"))


# this call's train.py processes, which run_grid stops on Ctrl-C or SIGTERM
_running = set()
_running_lock = threading.Lock()
_stopping = threading.Event()


class Stopped(Exception):
    pass


class RunFailed(UserError):
    """A train.py process of the grid ended with an error."""


def run_stage(cmd, directory, env):
    """Run a stage's train.py (output in train.out), from its checkpoint
    if any; Stopped when this call stopped it."""
    resume = os.path.exists(os.path.join(directory, "ckpt.pt"))
    if resume:
        cmd = [a for a in cmd if not a.startswith("--init_from=")] + ["--init_from=resume"]
    else:  # without a checkpoint, an earlier attempt's log is replaced
        cmd = cmd + ["--overwrite=True"]
    train_out = os.path.join(directory, "train.out")
    with open(train_out, "a" if resume else "w") as out:
        with _running_lock:  # so a process is either never started or stopped
            if _stopping.is_set():
                raise Stopped()
            # its own session: a terminal's Ctrl-C reaches compare.py only
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            _running.add(process)
        try:
            code = process.wait()
        finally:
            with _running_lock:
                _running.discard(process)
    if code and _stopping.is_set():  # it saved a checkpoint to go on from
        raise Stopped()
    if code:
        raise RunFailed(
            f"run {directory} failed (train.py exit status {code}): {last_line(train_out)}; "
            f"its whole output: {train_out}. The grid's other runs were stopped at a "
            "checkpoint; the next call goes on from there.")


def last_line(path):
    """The last line train.py wrote: for a UserError, its one-line error."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f.read().splitlines()]
    except OSError:
        return "(no train.out)"
    return next((line for line in reversed(lines) if line), "(train.out is empty)")


def stop_runs():
    """Start no new run and stop the running ones (SIGTERM: each saves
    its step); returns how many were running."""
    with _running_lock:
        _stopping.set()
        running = list(_running)
    for process in running:
        process.terminate()
    for process in running:
        process.wait()
    return len(running)


def run_identity(commands):
    """What two runs share when they are the same run: their commands,
    less where they write, their threads and a chain's link."""
    skip = ("--out_dir=", "--num_threads=", "--init_from=")
    return json.dumps([[a for a in cmd[1:] if not a.startswith(skip)] for cmd in commands])


def planned_commands(config, seed, overrides):
    """Each stage's train.py command (config: a file, or a chain's tuple)."""
    chain = config if isinstance(config, tuple) else (config,)
    return [[sys.executable, "train.py", c, f"--seed={seed}", *overrides] for c in chain]


def finished_runs(root, needed):
    """{run_identity: directory} of root's finished runs with `needed`."""
    finished = {}
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.endswith(".tmp")]
        if {"run.json", *needed} <= set(files):
            record = read_json(os.path.join(dirpath, "run.json"))
            finished.setdefault(run_identity(record["commands"]), dirpath)
    return finished


def copy_run(source, dest, reevaluate=False):
    """Copy a finished run's folder to dest (through dest.tmp), run.json
    recording where it came from; reevaluate: score its best.pt with
    today's evaluate.py."""
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if reevaluate:
        subprocess.run([sys.executable, os.path.join(identity.REPO, "evaluate.py"),
                        os.path.join(tmp, "best.pt"),
                        f"--out={os.path.join(tmp, 'metrics.json')}", "--overwrite"],
                       check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    record = read_json(os.path.join(tmp, "run.json"))
    save_json({**record, "reused_from": source}, os.path.join(tmp, "run.json"))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.rename(tmp, dest)


def evaluated_today(directory):
    """Whether a run's metrics.json has what today's evaluate.py writes."""
    metrics = read_json(os.path.join(directory, "metrics.json"))
    return {"geometry", "flops"} <= metrics.keys()


def reuse_identical(grid, todo, root, archive, overrides):
    """Copy rather than train the runs of todo another grid already made
    (docs/runs.md#running-them); returns the (method, seed) pairs reused."""
    with_checkpoints = finished_runs(root, ("best.pt", "metrics.json"))
    archived = finished_runs(archive, ("metrics.json",))
    reused = []
    for method, seed, config, args, out in todo:
        same = run_identity(planned_commands(config, seed, [*args, *overrides]))
        source = with_checkpoints.get(same)
        old = archived.get(same)
        dest = run_dir(archive, grid, method, seed)
        if (source is not None and os.path.abspath(source) != os.path.abspath(out)
                and not has_metrics(out)):
            copy_run(source, out, reevaluate=True)
        elif old is not None and not has_metrics(dest) and evaluated_today(old):
            copy_run(old, dest)
        else:
            continue
        reused.append((method, seed))
    return reused


def run_flops(out_dir):
    """The FLOPs a finished run executed (a chain's run.json sums its
    stages), or None for runs made before train.py counted them."""
    for name in ("run.json", "metrics.json"):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            flops = read_json(path).get("flops")
            if isinstance(flops, dict):
                flops = flops.get("total")
            if flops:
                return flops
    return None


def bf16_matrix_units():
    """Whether the CPU has bf16 units (AMX, AVX512-BF16): on AVX2 bf16
    runs ~100x slower than fp32."""
    flags = identity.cpuinfo()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def runs_device(overrides):
    """What the runs train on: the GPU's name, or the device's kind (cpu, mps)."""
    device = next((a.split("=", 1)[1] for a in reversed(overrides) if a.startswith("--device=")),
                  "auto")
    try:
        device = choose_device(device)
    except ValueError:  # a device this machine lacks: the runs will say so, each in one line
        return device
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return device


def machine_peak():
    """The all-core 2048^2 matmul peak, fp32 or (where faster) bf16, the
    best of 20 (docs/runs.md#the-wall-time-of-a-call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        peak = {"float32": measure_matmul_flops("cpu", torch.float32, repeats=20)}
        if bf16_matrix_units():
            peak["bfloat16"] = measure_matmul_flops("cpu", torch.bfloat16, repeats=20)
    finally:
        torch.set_num_threads(threads)
    dtype = max(peak, key=peak.get)
    return {"peak_flops": peak[dtype], "peak_dtype": dtype, "measured": peak}


def archive_run(out_dir, dest):
    """Copy what the tables need into the archive: the metric files, the
    log thinned to every evaluation and every 50th step."""
    for name in ("metrics.json", "marginalization.json", "run.json"):
        source = os.path.join(out_dir, name)
        if os.path.exists(source):
            atomic_write(os.path.join(dest, name), lambda tmp: shutil.copyfile(source, tmp))
    kept = [r for r in read_log(os.path.join(out_dir, "log.jsonl"))
            if "val" in r or (r["iter"] + 1) % 50 == 0]
    save_text("".join(json.dumps(r) + "\n" for r in kept), os.path.join(dest, "log.jsonl"))
    archive_embedding(out_dir, dest)


def archive_embedding(out_dir, dest):
    """best.pt's input embedding and vocabulary for the figures
    (embedding.npz, ~70 KB for the char model; not for big ones)."""
    source = os.path.join(out_dir, "best.pt")
    target = os.path.join(dest, "embedding.npz")
    if os.path.exists(target) or not os.path.exists(source):
        return
    checkpoint = load_with_weights(source)  # an FSDP run's too, from its shards
    wte = checkpoint["model"]["wte.weight"].float().numpy()
    itos = checkpoint["meta"].get("itos")
    if itos is None or wte.size > 2 ** 16:
        return

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, wte=wte, itos=np.array(itos))
    atomic_write(target, write)


def sync_archive(grid, root, archive):
    """Archive every run finished in root but not yet archived; returns the archived runs."""
    done = set()
    for method, seed, *_, out in runs_of(grid, root):
        dest = run_dir(archive, grid, method, seed)
        if not has_metrics(dest) and has_metrics(out):
            archive_run(out, dest)
        if has_metrics(dest):
            done.add((method, seed))
            archive_embedding(out, dest)  # runs archived before the figures existed
    return done


def chosen_runs(grid, folder, only):
    """runs_of, only the (method, seed) pairs in only (None: all)."""
    return [r for r in runs_of(grid, folder) if only is None or (r[0], r[1]) in only]


class UnlikeRuns(UsageError):
    """A grid's finished run trained with other keys than this call's: refused, one line."""


def check_like(grid, folder, overrides, only=None):
    """Raise UnlikeRuns for a run of the grid in folder trained with
    other keys than this call's (docs/runs.md#which-runs-a-table-may-pair)."""
    cpu_of_grid = identity.grid_cpu(folder, grid)
    for method, seed, config, args, directory in chosen_runs(grid, folder, only):
        planned = identity.training_keys(planned_commands(config, seed, [*args, *overrides]))
        if not has_metrics(directory):  # a stopped run goes on from its checkpoint's config
            difference = stopped_difference(directory, planned)
        else:
            found = identity.of_run(directory, cpu_of_grid) or {}
            if not found and (method, seed) not in UNRECORDED_RUNS.get(grid, ()):
                raise UnlikeRuns(
                    f"{directory} ({method}, seed {seed}) has a metrics.json but no run.json: "
                    "what trained it is not recorded, so it cannot be paired; train it again "
                    "(move the folder aside) or compare without it (--seeds)")
            trained = found.get("training")
            difference = trained and identity.first_difference(trained, planned)
        if difference:
            raise UnlikeRuns(
                f"{directory} ({method}, seed {seed}) was trained with {difference}: the table "
                "would pair unlike runs; give --archive and --root other folders for a "
                "comparison with other keys (--methods and --seeds make it smaller)")


def stopped_difference(out_dir, planned):
    """first_difference of the stage a stopped run goes on from, or None."""
    for stage, keys in enumerate(planned):
        directory = stage_dir(out_dir, stage, len(planned))
        path = os.path.join(directory, "ckpt.json")
        if os.path.exists(path) and not has_metrics(directory):
            trained = identity.training(read_json(path)["config"])
            return identity.first_difference([trained], [keys])
    return None


class UnpooledRuns(UserError):
    """Runs a table would pair across code or machines: refused, one line."""


def check_pooled_call(grid, archive, only=None):
    """Raise UnpooledRuns when a run this call would train shares its
    seed with an archived run of other code or another CPU model, unless
    the grid is in grids.POOLABLE."""
    if grid in POOLABLE:
        return
    here = (identity.current_code(), identity.cpu_name())
    cpu_of_grid = identity.grid_cpu(archive, grid)
    machines = {(m, s): identity.machine(identity.of_run(d, cpu_of_grid))
                for m, s, *_, d in runs_of(grid, archive) if has_metrics(d)}
    for method, seed, *_ in chosen_runs(grid, archive, only):
        if (method, seed) in machines:
            continue
        for (other, other_seed), there in machines.items():
            if other_seed == seed and not identity.pools(here, there):
                raise UnpooledRuns(
                    f"grid {grid}: {method} on seed {seed} would run code "
                    f"{identity.short_code(here[0])} on {here[1]}, and its table would pair "
                    f"it with {other}'s archived run, code {identity.short_code(there[0])} on "
                    f"{there[1]}; train the seed's runs again together (--archive and --root "
                    "another folder), or declare the grid in tools/grids.py's POOLABLE with "
                    "why its runs pool")


def run_grid(grid, root, workers, overrides, archive, only=None):
    """Train the grid's unfinished runs (only: the (method, seed) pairs
    to train), archiving each as it finishes; returns the wall time."""
    chosen = chosen_runs(grid, root, only)
    done = sync_archive(grid, root, archive)
    todo = [r for r in chosen if (r[0], r[1]) not in done]
    reused = reuse_identical(grid, todo, root, archive, overrides)
    if reused:
        print(f"reused {len(reused)} identical finished run(s) of other grids: {reused}")
        done = sync_archive(grid, root, archive)
        todo = [r for r in todo if (r[0], r[1]) not in done]
    print(f"grid '{grid}': {len(chosen)} runs, {len(chosen) - len(todo)} already done, "
          f"{len(todo)} to run, {workers} at a time")
    if not todo:
        return 0.0
    threads = max(1, (os.cpu_count() or 1) // workers)
    peak = machine_peak()  # before any run starts: the cores are idle
    print(f"machine peak: {peak['peak_flops'] / 1e9:.0f} GFLOP/s ({peak['peak_dtype']} 2048^2 "
          f"matmul on {os.cpu_count()} cores, {identity.cpu_name()})")
    t0 = time.time()
    flops = 0
    wall_path = os.path.join(archive, grid, "wall.json")
    record = {"call": f"pid {os.getpid()} on {socket.gethostname()}, started {t0:.3f}",
              "runs": 0, "workers": workers, "threads_per_run": threads,
              "cpu": identity.cpu_name(), "cores": os.cpu_count(),
              "device": runs_device([*GRID_ARGS.get(grid, ()), *overrides]),
              "torch": torch.__version__, **peak, "wall_s": 0.0, "flops": 0, "archived": []}

    def save():
        record.update(wall_s=time.time() - t0, runs=len(record["archived"]), flops=flops)
        record_call(wall_path, record)
    # written now, each minute and at each finished run: a killed call keeps its time
    record_call(wall_path, record)
    pool = ThreadPoolExecutor(workers)
    try:
        with tqdm(total=len(todo), desc=grid, unit="run") as bar:
            futures = {pool.submit(launch, config, seed, out, threads, [*args, *overrides]):
                       (method, seed, out)
                       for method, seed, config, args, out in todo}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=RECORD_EVERY_S,
                                         return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()
                    method, seed, out = futures[future]
                    archive_run(out, run_dir(archive, grid, method, seed))
                    record["archived"].append({"method": method, "seed": seed})
                    run = run_flops(out)
                    flops = None if flops is None or run is None else flops + run
                    bar.update(1)
                save()
    except BaseException:  # Ctrl-C, SIGTERM or a failed run: stop everything, keep what finished
        pool.shutdown(wait=False, cancel_futures=True)
        stopped = stop_runs()
        print(f"stopped: {len(record['archived'])} run(s) finished in this call; {stopped} "
              "running one(s) go on from their last checkpoint in the next call",
              file=sys.stderr)
        raise
    finally:  # an interrupted call's wall time counts too
        pool.shutdown(wait=True)
        _stopping.clear()
        save()
    return record["wall_s"]


def record_call(path, record):
    """Write a call's record into wall.json, in place of the one with
    its `call` id."""
    calls = grid_calls(path)
    ids = [c.get("call") for c in calls]
    if "call" in record and record["call"] in ids:
        calls[ids.index(record["call"])] = record
    else:
        calls.append(record)
    save_json({"calls": calls}, path)


def grid_calls(path):
    return read_json(path)["calls"] if os.path.exists(path) else []
