"""
Runs a grid's training runs: a pool of train.py processes (`workers` at a time), each run resumable
from its last checkpoint, its small files copied into the committed archive (results/runs) when it
finishes, and a run another grid already made copied rather than trained again. tools/compare.py
is its command line.

Each run is `python train.py <config> --seed=S [its own arguments] --out_dir=<root>/<grid>/<method>/seed<S>`.
Ctrl-C (or `kill`) stops a call cleanly: train.py finishes its step and saves it, the call's wall time
is recorded, and the runs it stopped go on from exactly there next time. Runs go `workers` at a
time, each on cores/workers threads (two 1-thread processes keep both cores of a laptop busier
than one 2-thread process). Before a call starts its runs it measures the machine's matmul peak on
all cores; wall.json keeps one record per call (naming the runs it archived), rewritten while the
call runs, from which tools/report.py computes the grid's efficiency.
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

import checkpoint as checkpoints
from errors import UsageError, UserError
from tools import identity
from tools.grids import GRID_ARGS, POOLABLE, UNRECORDED_RUNS, run_dir, runs_of, stages
from utils import atomic_write, choose_device, measure_matmul_flops, read_log, save_json, save_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_EVERY_S = 60  # how often a running call rewrites its wall.json record


def launch(config, seed, out_dir, threads, overrides):
    """One training run in its own process (or a chain of them); output in out_dir/train.out.
    A run finished meanwhile (e.g. by another compare.py call) is skipped; a run an earlier call
    stopped part-way goes on from its last checkpoint (train.py --init_from=resume, which
    continues exactly: weights, optimizer, data and RNG state), and a chain from its first
    unfinished stage."""
    if os.path.exists(os.path.join(out_dir, "metrics.json")):
        return 0.0
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0, commands = time.time(), []
    # the time earlier calls spent on this run before they were stopped: its wall time is the sum
    stopped_path = os.path.join(out_dir, "stopped_wall.json")
    earlier = 0.0
    if os.path.exists(stopped_path):
        with open(stopped_path) as f:
            earlier = json.load(f)["wall_s"]
    os.makedirs(out_dir, exist_ok=True)
    identity.mark_start(out_dir)
    try:
        flops = run_stages(stages(config), seed, out_dir, threads, overrides, env, commands)
    except BaseException:
        os.makedirs(out_dir, exist_ok=True)
        save_json({"wall_s": earlier + time.time() - t0}, stopped_path)
        raise
    wall = earlier + time.time() - t0
    save_json({"wall_s": wall, "threads": threads, "commands": commands, "flops": flops,
               "identity": identity.record(commands),
               "provenance": identity.provenance(commands, identity.started(out_dir))},
              os.path.join(out_dir, "run.json"))
    return wall


def run_stages(configs, seed, out_dir, threads, overrides, env, commands):
    """launch's stages, one train.py process each (appended to commands); returns their FLOPs."""
    previous, flops = None, 0
    for stage, config_file in enumerate(configs):
        # earlier stages of a chain go to out_dir/stage<k>; the last one is the run itself
        stage_dir = out_dir if stage == len(configs) - 1 else os.path.join(out_dir, f"stage{stage}")
        os.makedirs(stage_dir, exist_ok=True)
        cmd = planned_commands(config_file, seed, overrides)[0] + [f"--out_dir={stage_dir}",
                                                                   f"--num_threads={threads}"]
        if previous is not None:
            cmd.append(f"--init_from={os.path.join(previous, 'best.pt')}")
        commands.append(cmd)
        previous = stage_dir
        if os.path.exists(os.path.join(stage_dir, "metrics.json")):  # a stage finished by an earlier call
            flops += run_flops(stage_dir) or 0
            continue
        resume = os.path.exists(os.path.join(stage_dir, "ckpt.pt"))
        with open(os.path.join(stage_dir, "train.out"), "a" if resume else "w") as f:
            # without a checkpoint, whatever an earlier attempt left here (a log) is replaced
            code = run_process([a for a in cmd if not a.startswith("--init_from=")] + ["--init_from=resume"]
                               if resume else cmd + ["--overwrite=True"], f, env)
        if code != 0 and _stopping.is_set():  # stopped by this call: it saved a checkpoint to go on from
            raise Stopped()
        if code != 0:
            train_out = os.path.join(stage_dir, "train.out")
            raise RunFailed(f"run {stage_dir} failed (train.py exit status {code}): {last_line(train_out)}; "
                            f"its whole output: {train_out}. The grid's other runs were stopped at a "
                            "checkpoint; the next call goes on from there.")
        flops += run_flops(stage_dir) or 0
    return flops


# The train.py processes of this call. On Ctrl-C or SIGTERM, run_grid stops them and starts no
# new one; each goes on from its last checkpoint in the next call.
_running, _running_lock, _stopping = set(), threading.Lock(), threading.Event()


class Stopped(Exception):
    pass


class RunFailed(UserError):
    """A train.py process of the grid ended with an error (its own line is in its train.out)."""


def last_line(path):
    """The last line train.py wrote (splitlines also splits a progress bar's \r updates), which
    for a train.py that failed on a UserError is its one-line error."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f.read().splitlines()]
    except OSError:
        return "(no train.out)"
    return next((line for line in reversed(lines) if line), "(train.out is empty)")


def run_process(cmd, out, env):
    with _running_lock:  # checked under the lock: a process is either never started or stopped
        if _stopping.is_set():
            raise Stopped()
        # its own session: a terminal's Ctrl-C reaches compare.py only, which stops the runs itself
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _running.add(process)
    try:
        return process.wait()
    finally:
        with _running_lock:
            _running.discard(process)


def stop_runs():
    """Start no new run and stop the running ones (SIGTERM: train.py finishes its step and saves
    it, so the next call goes on from exactly there)."""
    with _running_lock:
        _stopping.set()
        running = list(_running)
    for process in running:
        process.terminate()
    for process in running:
        process.wait()
    return len(running)


def run_identity(commands):
    """What makes two runs the same run: their train.py commands, minus where they write, how many
    threads they use and the path of a chain's previous stage (none of which changes the numbers)."""
    skip = ("--out_dir=", "--num_threads=", "--init_from=")
    return json.dumps([[a for a in cmd[1:] if not a.startswith(skip)] for cmd in commands])


def planned_commands(config, seed, overrides):
    return [[sys.executable, "train.py", c, f"--seed={seed}", *overrides] for c in stages(config)]


def finished_runs(root, needed):
    """{run identity: directory} of the finished runs under root that hold the files `needed`."""
    finished = {}
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.endswith(".tmp")]
        if "run.json" in files and all(name in files for name in needed):
            with open(os.path.join(dirpath, "run.json")) as f:
                record = json.load(f)
            finished.setdefault(run_identity(record["commands"]), dirpath)
    return finished


def copy_run(source, dest, prepare=None):
    """Copy a finished run's folder to dest through dest.tmp (prepare(tmp) may rework the copy),
    recording in run.json where it came from; whatever was at dest (an unfinished attempt) goes."""
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if prepare is not None:
        prepare(tmp)
    with open(os.path.join(tmp, "run.json")) as f:
        record = json.load(f)
    save_json({**record, "reused_from": source}, os.path.join(tmp, "run.json"))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.rename(tmp, dest)


def reevaluate(directory):
    """Today's evaluate.py on a copied run's best.pt, so its metrics.json has every metric."""
    subprocess.run([sys.executable, os.path.join(REPO, "evaluate.py"),
                    os.path.join(directory, "best.pt"), f"--out={os.path.join(directory, 'metrics.json')}",
                    "--overwrite"], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))


def evaluated_today(run_dir_):
    """Whether an archived run's metrics.json has what today's evaluate.py writes (an archive made
    before the hidden-state geometry or the FLOP counts existed cannot be re-evaluated without its
    checkpoint, so such a run is trained again rather than copied into another grid)."""
    with open(os.path.join(run_dir_, "metrics.json")) as f:
        metrics = json.load(f)
    return all(key in metrics for key in ("geometry", "flops"))


def reuse_identical(grid, todo, root, archive, overrides):
    """A run another grid already made (the same commands, e.g. the CE baseline shared by the
    jostling and lowres grids) is copied instead of trained again: from root, checkpoints and
    all, and re-evaluated with today's evaluate.py; or, where no checkpoint is left (a fresh
    checkout), its archived files straight into this grid's archive, which is all the tables
    read. run.json records where it came from. Returns the runs reused."""
    with_checkpoints = finished_runs(root, ("best.pt", "metrics.json"))
    archived = finished_runs(archive, ("metrics.json",))
    reused = []
    for method, seed, config, args, out in todo:
        identity = run_identity(planned_commands(config, seed, [*args, *overrides]))
        dest = run_dir(archive, grid, method, seed)
        source = with_checkpoints.get(identity)
        if source is not None and os.path.abspath(source) != os.path.abspath(out) \
                and not os.path.exists(os.path.join(out, "metrics.json")):
            copy_run(source, out, prepare=reevaluate)
        elif archived.get(identity) is not None and not os.path.exists(os.path.join(dest, "metrics.json")) \
                and evaluated_today(archived[identity]):
            copy_run(archived[identity], dest)
        else:
            continue
        reused.append((method, seed))
    return reused


def run_flops(out_dir):
    """The FLOPs a finished run executed (run.json: all stages of a chain; else its metrics.json,
    written by train.py), or None for runs made before train.py counted them."""
    for name in ("run.json", "metrics.json"):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                flops = json.load(f).get("flops")
            if isinstance(flops, dict):
                flops = flops.get("total")
            if flops:
                return flops
    return None


def bf16_matrix_units():
    """Whether the CPU reports bf16 matrix/vector instructions (AMX or AVX512-BF16): only then is
    bf16 worth measuring (on an AVX2-only CPU it runs ~100x slower than fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def runs_device(overrides):
    """What the runs train on: the GPU's name when they use CUDA (--device=cuda[:N], or the default
    auto on a machine that has one), else the device's kind (cpu, mps)."""
    device = next((a.split("=", 1)[1] for a in reversed(overrides) if a.startswith("--device=")), "auto")
    try:
        device = choose_device(device)
    except ValueError:  # a device this machine lacks: the runs will say so, each in one line
        return device
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


def machine_peak():
    """The machine's matmul peak on all its cores, the denominator of the grid's efficiency: a
    2048^2 fp32 matmul, and a bf16 one where the CPU has bf16 units and it is faster there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        # best of 20 (~2 s): on a shared machine a best of 3 was seen 35 % below the idle peak
        peak = {"float32": measure_matmul_flops("cpu", torch.float32, repeats=20)}
        if bf16_matrix_units():
            peak["bfloat16"] = measure_matmul_flops("cpu", torch.bfloat16, repeats=20)
    finally:
        torch.set_num_threads(threads)
    dtype = max(peak, key=peak.get)
    return {"peak_flops": peak[dtype], "peak_dtype": dtype, "measured": peak}


def archive_run(out_dir, dest):
    """Copy what the tables need from a finished run into the committed archive: the metric
    files, and the log thinned to every evaluation plus every 50th training step."""
    os.makedirs(dest, exist_ok=True)
    for name in ("metrics.json", "marginalization.json", "run.json"):
        if os.path.exists(os.path.join(out_dir, name)):
            source = os.path.join(out_dir, name)
            atomic_write(os.path.join(dest, name), lambda tmp: shutil.copyfile(source, tmp))
    kept = [r for r in read_log(os.path.join(out_dir, "log.jsonl"))
            if "val" in r or (r["iter"] + 1) % 50 == 0]
    save_text("".join(json.dumps(r) + "\n" for r in kept), os.path.join(dest, "log.jsonl"))
    archive_embedding(out_dir, dest)


def archive_embedding(out_dir, dest):
    """The input embedding of best.pt and the vocabulary, for the figures (embedding.npz, ~70 KB
    for the char model; skipped for big vocabularies and when the checkpoint is gone)."""
    source, target = os.path.join(out_dir, "best.pt"), os.path.join(dest, "embedding.npz")
    if os.path.exists(target) or not os.path.exists(source):
        return
    checkpoint = checkpoints.load_with_weights(source)  # an FSDP run's best.pt: read back from its shards
    wte, itos = checkpoint["model"]["wte.weight"].float().numpy(), checkpoint["meta"].get("itos")
    if itos is None or wte.size > 2 ** 16:
        return

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, wte=wte, itos=np.array(itos))
    atomic_write(target, write)


def sync_archive(grid, root, archive):
    """Archive every run finished in root but not yet archived; returns the set of archived runs."""
    done = set()
    for (method, seed, *_, out), (*_, dest) in zip(runs_of(grid, root), runs_of(grid, archive)):
        if (not os.path.exists(os.path.join(dest, "metrics.json"))
                and os.path.exists(os.path.join(out, "metrics.json"))):
            archive_run(out, dest)
        if os.path.exists(os.path.join(dest, "metrics.json")):
            done.add((method, seed))
            archive_embedding(out, dest)  # runs archived before the figures existed
    return done


class UnlikeRuns(UsageError):
    """A grid's finished run trained with other keys than this call's: refused, one line."""


def check_like(grid, folder, overrides, only=None):
    """Raise UnlikeRuns (one line naming the first differing key) when a finished run of the grid
    in folder (its archive or root) was trained with other keys than the grid's config with these
    overrides gives (tools/identity.py: recorded, or inferred for older runs), or has no record at
    all (no run.json) and is not one of grids.UNRECORDED_RUNS. only: the (method, seed) pairs to
    check, all by default."""
    cpu_of_grid = identity.grid_cpu(folder, grid)
    for method, seed, config, args, directory in runs_of(grid, folder):
        if only is not None and (method, seed) not in only:
            continue
        planned = identity.training_keys(planned_commands(config, seed, [*args, *overrides]))
        if os.path.exists(os.path.join(directory, "metrics.json")):
            found = identity.of_run(directory, cpu_of_grid)
            if found is None and (method, seed) not in UNRECORDED_RUNS.get(grid, ()):
                raise UnlikeRuns(f"{directory} ({method}, seed {seed}) has a metrics.json but no run.json: what "
                                 "trained it is not recorded, so it cannot be paired; train it again (move "
                                 "the folder aside) or compare without it (--seeds)")
            difference = None if found is None or found["training"] is None else \
                identity.first_difference(found["training"], planned)
        else:  # a run stopped part-way goes on from its checkpoint (ckpt.json: its config), whose keys
            # must match
            difference = stopped_difference(directory, planned)
        if difference:
            raise UnlikeRuns(f"{directory} ({method}, seed {seed}) was trained with {difference}: the table "
                             "would pair unlike runs; give --archive and --root other folders for a "
                             "comparison with other keys (--methods and --seeds make it smaller)")


class UnpooledRuns(UserError):
    """A pair of runs from other code or another machine, in a grid that does not declare them
    poolable (grids.POOLABLE)."""


def check_pooled_call(grid, archive, only=None):
    """Before a call trains: raise UnpooledRuns when a run it would train shares its seed with an
    archived run of other code or another CPU model (its table would pair them), unless the grid
    is in grids.POOLABLE. only: the (method, seed) pairs this call trains, all by default."""
    if grid in POOLABLE:
        return
    here = (identity.current_code(), identity.cpu_name())
    runs = list(runs_of(grid, archive))
    finished = {(m, s): d for m, s, *_, d in runs if os.path.exists(os.path.join(d, "metrics.json"))}
    cpu_of_grid = identity.grid_cpu(archive, grid)
    machines = {run: identity.machine(identity.of_run(directory, cpu_of_grid))
                for run, directory in finished.items()}
    for method, seed, *_ in runs:
        if (method, seed) in finished or (only is not None and (method, seed) not in only):
            continue
        for (other, other_seed), there in machines.items():
            if other_seed == seed and not identity.pools(here, there):
                raise UnpooledRuns(
                    f"grid {grid}: {method} on seed {seed} would run code {identity.short_code(here[0])} on "
                    f"{here[1]}, and its table would pair it with {other}'s archived run, code "
                    f"{identity.short_code(there[0])} on {there[1]}; train the seed's runs again together "
                    "(--archive and --root another folder), or declare the grid in tools/grids.py's "
                    "POOLABLE with why its runs pool")


def stopped_difference(out_dir, planned):
    """first_difference of the stage a stopped run would go on from (its ckpt.json), or None."""
    for stage, keys in enumerate(planned):
        stage_dir = out_dir if stage == len(planned) - 1 else os.path.join(out_dir, f"stage{stage}")
        path = os.path.join(stage_dir, "ckpt.json")
        if os.path.exists(path) and not os.path.exists(os.path.join(stage_dir, "metrics.json")):
            with open(path) as f:
                config = json.load(f)["config"]
            trained = {k: v for k, v in config.items() if k not in identity.NOT_TRAINING}
            return identity.first_difference([trained], [keys])
    return None


def run_grid(grid, root, workers, overrides, archive="results/runs", only=None):
    """Train the grid's runs not yet finished (only: the (method, seed) pairs to train, all by
    default), archiving each as it finishes; returns the call's wall time."""
    done = sync_archive(grid, root, archive)
    todo = [r for r in runs_of(grid, root)
            if (r[0], r[1]) not in done and (only is None or (r[0], r[1]) in only)]
    reused = reuse_identical(grid, todo, root, archive, overrides)
    if reused:
        print(f"reused {len(reused)} identical finished run(s) of other grids: {reused}")
        done = sync_archive(grid, root, archive)
        todo = [r for r in todo if (r[0], r[1]) not in done]
    total = sum(1 for r in runs_of(grid, root) if only is None or (r[0], r[1]) in only)
    print(f"grid '{grid}': {total} runs, {total - len(todo)} already done, {len(todo)} to run, {workers} at "
          "a time")
    if not todo:
        return 0.0
    threads = max(1, (os.cpu_count() or 1) // workers)
    peak = machine_peak()  # before any run starts: the cores are idle
    print(f"machine peak: {peak['peak_flops'] / 1e9:.0f} GFLOP/s ({peak['peak_dtype']} 2048^2 matmul on "
          f"{os.cpu_count()} cores, {identity.cpu_name()})")
    t0, finished, flops = time.time(), 0, 0
    wall_path = os.path.join(archive, grid, "wall.json")
    record = {"call": f"pid {os.getpid()} on {socket.gethostname()}, started {t0:.3f}", "runs": 0,
              "workers": workers, "threads_per_run": threads, "cpu": identity.cpu_name(),
              "cores": os.cpu_count(), "device": runs_device([*GRID_ARGS.get(grid, ()), *overrides]),
              "torch": torch.__version__, **peak, "wall_s": 0.0, "flops": 0, "archived": []}
    # the record is written now and rewritten each minute and at each finished run, so a call killed
    # without warning (SIGKILL, a machine's end) still counts all but its last minute
    record_call(wall_path, record)
    pool = ThreadPoolExecutor(workers)
    try:
        with tqdm(total=len(todo), desc=grid, unit="run") as bar:
            futures = {pool.submit(launch, config, seed, out, threads, [*args, *overrides]):
                       (method, seed, out)
                       for method, seed, config, args, out in todo}
            pending = set(futures)
            while pending:
                done_now, pending = wait(pending, timeout=RECORD_EVERY_S, return_when=FIRST_COMPLETED)
                for future in done_now:
                    future.result()
                    method, seed, out = futures[future]
                    archive_run(out, run_dir(archive, grid, method, seed))
                    record["archived"].append({"method": method, "seed": seed})
                    finished += 1
                    run = run_flops(out)
                    flops = None if flops is None or run is None else flops + run
                    bar.update(1)
                record.update(wall_s=time.time() - t0, runs=finished, flops=flops)
                record_call(wall_path, record)
    except BaseException:  # Ctrl-C, SIGTERM or a failed run: stop everything, keep what finished
        pool.shutdown(wait=False, cancel_futures=True)
        stopped = stop_runs()
        print(f"stopped: {finished} run(s) finished in this call; {stopped} running one(s) go on from their "
              "last checkpoint in the next call", file=sys.stderr)
        raise
    finally:  # every call's wall time counts, an interrupted one too (the steps since a run's
        # last checkpoint are lost; those runs' FLOPs count when they finish)
        pool.shutdown(wait=True)
        _stopping.clear()
        record.update(wall_s=time.time() - t0, runs=finished, flops=flops)
        record_call(wall_path, record)
    return record["wall_s"]


def record_call(path, record):
    """Write one compare.py call's record into wall.json: appended, or in place of the record with
    its `call` id (a grid may take several calls, in several sessions: its wall time is the sum of
    theirs)."""
    calls = grid_calls(path)
    same = [i for i, c in enumerate(calls) if "call" in record and c.get("call") == record["call"]]
    if same:
        calls[same[0]] = record
    else:
        calls.append(record)
    save_json({"calls": calls}, path)


def grid_calls(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    return data["calls"]
