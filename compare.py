"""
Run a named grid of methods x seeds and write a results table, e.g.

    python compare.py jostling               # the Stop Jostling reproduction (its Sec. 4)
    python compare.py lowres                 # every loss on the char experiment
    python compare.py bpe                    # every loss on the GPT-2 BPE toy
    python compare.py jostling --table_only  # only rebuild results/jostling.md from finished runs

Each run is `python train.py <config> --seed=S --out_dir=<root>/<grid>/<method>/seed<S>`. When it
finishes, its small files (metrics.json, marginalization.json, run.json and a thinned log.jsonl)
are copied to results/runs/<grid>/<method>/seed<S>, which is committed: the tables are built from
there, and a run found there (or finished in <root>) is skipped, so an interrupted grid resumes
where it stopped, in this checkout or a fresh one. Ctrl-C (or `kill`) stops a call cleanly: its
wall time is recorded and the runs it stopped go on from their last checkpoint next time. Runs go
`--workers` at a time, each on cores/workers threads (two 1-thread processes keep both cores of
a laptop busier than one 2-thread process). The table gives mean +- std over seeds of every
metric in metrics.json, the paper's number beside ours where it has one, and each method's
paired difference to the baseline on the same seeds with its 95 % t interval -- a seed moves every
method together, so the paired figure is what separates an effect from noise. It opens with the
papers' claims, each judged by the rule in claims.py / stats.py.

Speed: before a call starts its runs it measures the machine's matmul peak on all cores; each run
reports the FLOPs it executed (train.py, evaluate.py); wall.json keeps one record per call, and
the table ends with the grid's efficiency = (grid FLOPs / peak) / wall time over all its calls.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
import torch
from tqdm import tqdm

import claims
import evaluate
import figures
import stats

from utils import atomic_write, measure_matmul_flops, save_json, save_text

SEEDS = list(range(1337, 1347))  # 10 seeds; a method uses the first n

# method -> (config file, extra overrides, number of seeds). The first method is the baseline.
# A tuple of config files is a chain: stage k starts from stage k-1's best.pt (--init_from).
# The Stop Jostling trio (CE, margin 0.6, margin 0.6 + SE) has 10 seeds: its LR accuracy varies a
# lot from seed to seed. The jostling grid's runs with the same command as a lowres run are copied
# from it (reuse_identical), not trained twice.
GRIDS = {
    "jostling": {
        "baseline": ("config/lowres_baseline.py", ["--log_marginalization=True"], 10),
        "margin 2": ("config/lowres_margin_2.py", ["--log_marginalization=True"], 3),
        "margin 1": ("config/lowres_margin_1.py", [], 3),
        "margin 0.6": ("config/lowres_margin_0.6.py", [], 10),
        "margin 0.6 + SE": ("config/lowres_margin0.6_se.py", [], 10),
        "monolingual": ("config/lowres_monolingual.py", [], 3),
        # a candidate explanation of the authors' SE run (rows undecayed), against margin 0.6 + SE
        "margin 0.6 + SE, rows not decayed": ("config/lowres_margin0.6_se_rows_no_decay.py", [], 5),
    },
    "lowres": {
        "CE": ("config/lowres_baseline.py", ["--log_marginalization=True"], 10),
        "margin 0.6": ("config/lowres_margin_0.6.py", [], 10),
        "margin 0.6 + SE": ("config/lowres_margin0.6_se.py", [], 10),
        "SimReg": ("config/lowres_simreg.py", [], 5),
        "SimReg chunk 32": ("config/lowres_simreg_chunk.py", [], 5),
        "dispersion": ("config/lowres_dispersion.py", [], 5),
        "dispersion decorrelation": ("config/lowres_dispersion_decorrelation.py", [], 5),
        "dispersion l2_repel": ("config/lowres_dispersion_l2_repel.py", [], 5),
        "dispersion orthogonalization": ("config/lowres_dispersion_orthogonalization.py", [], 5),
        "NITP": ("config/lowres_nitp.py", [], 5),
        "CWT + FT": (("config/lowres_cwt.py", "config/lowres_cwt_ft.py"), [], 5),
        "SimReg + dispersion": ("config/lowres_simreg_dispersion.py", [], 5),
    },
}
# The same methods on the BPE toy (config/bpe_baseline.py), with the settings of the lowres_*.py
# configs given as overrides; CWT's two stages have their own configs.
BPE = "config/bpe_baseline.py"
GRIDS["bpe"] = {
    "CE": (BPE, [], 5),
    "margin 0.6 + SE": (BPE, ["--margin=0.6", "--separate_embeddings=True"], 5),
    "SimReg": (BPE, ["--simreg_weight=3.54"], 5),
    "SimReg chunk 32": (BPE, ["--simreg_weight=3.54", "--simreg_chunk_size=32"], 5),
    **{f"dispersion{'' if variant == 'angular' else ' ' + variant}": (BPE, ["--dispersion_weight=0.1", f"--dispersion_variant={variant}"], 5)
       for variant in ("angular", "decorrelation", "l2_repel", "orthogonalization")},
    "NITP": (BPE, ["--nitp_weight=1.0", "--nitp_layer=1"], 5),
    "CWT + FT": (("config/bpe_cwt.py", "config/bpe_cwt_ft.py"), [], 5),
    "SimReg + dispersion": (BPE, ["--simreg_weight=3.54", "--dispersion_weight=0.1"], 5),
}

# The authors' numbers, HR / LR: margins 2 and 1 from Stop Jostling's Table 7; the baseline and
# margin 0.6 + SE from the authors' published code, one seed each (the paper's text gives LR PPL_best
# 10.63 -> 6.11 for its best run: close to, not the same as, that row). (ppl, ppl_best, t_best, acc, r@5, mrr, I(W))
PAPER = {
    "jostling": {
        "baseline": [(5.04, 10.65), (5.01, 10.63), (1.08, 0.95), (.519, .315), (.830, .688), (.654, .480), (.842, .417)],
        "margin 2": [(5.82, 11.56), (5.07, 9.62), (0.71, 0.67), (.529, .358), (.834, .717), (.661, .516), (.850, .642)],
        "margin 1": [(9.33, 17.30), (5.13, 9.54), (0.48, 0.46), (.530, .371), (.834, .720), (.663, .526), (.888, .765)],
        "margin 0.6 + SE": [(14.94, 19.94), (5.15, 6.17), (0.34, 0.32), (.527, .487), (.836, .809), (.661, .628), (.893, .762)],
    },
}
METRICS = ["ppl", "ppl_best", "t_best", "accuracy", "recall_at_5", "mrr", "isotropy"]


def run_dir(root, grid, method, seed):
    return os.path.join(root, grid, method.replace(" ", "_").replace("+", "plus"), f"seed{seed}")


def runs_of(grid, root):
    """Seed-major order: every method's first seed, then every method's second seed, ... so a
    grid cut short still holds paired runs of all methods."""
    for seed in SEEDS:
        for method, (config, extra, n_seeds) in GRIDS[grid].items():
            if seed in SEEDS[:n_seeds]:
                yield method, seed, config, extra, run_dir(root, grid, method, seed)


def launch(config, extra, seed, out_dir, threads, overrides):
    """One training run in its own process (or a chain of them); output in out_dir/train.out.
    A run finished meanwhile (e.g. by another compare.py call) is skipped; a run an earlier call
    stopped part-way goes on from its last checkpoint (train.py --init_from=resume, which
    continues exactly: weights, optimizer, data and RNG state), and a chain from its first
    unfinished stage."""
    if os.path.exists(os.path.join(out_dir, "metrics.json")):
        return 0.0
    configs = config if isinstance(config, tuple) else (config,)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0, commands = time.time(), []
    # the time earlier calls spent on this run before they were stopped: its wall time is the sum
    stopped_path = os.path.join(out_dir, "stopped_wall.json")
    earlier = 0.0
    if os.path.exists(stopped_path):
        with open(stopped_path) as f:
            earlier = json.load(f)["wall_s"]
    try:
        flops = run_stages(configs, extra, seed, out_dir, threads, overrides, env, commands)
    except BaseException:
        os.makedirs(out_dir, exist_ok=True)
        save_json({"wall_s": earlier + time.time() - t0}, stopped_path)
        raise
    wall = earlier + time.time() - t0
    save_json({"wall_s": wall, "threads": threads, "commands": commands, "flops": flops}, os.path.join(out_dir, "run.json"))
    return wall


def run_stages(configs, extra, seed, out_dir, threads, overrides, env, commands):
    """launch's stages, one train.py process each (appended to commands); returns their FLOPs."""
    previous, flops = None, 0
    for stage, config_file in enumerate(configs):
        # earlier stages of a chain go to out_dir/stage<k>; the last one is the run itself
        stage_dir = out_dir if stage == len(configs) - 1 else os.path.join(out_dir, f"stage{stage}")
        os.makedirs(stage_dir, exist_ok=True)
        cmd = planned_commands(config_file, extra, seed, overrides)[0] + [f"--out_dir={stage_dir}", f"--num_threads={threads}"]
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
            raise RuntimeError(f"run failed ({code}): {' '.join(cmd)}; see {stage_dir}/train.out")
        flops += run_flops(stage_dir) or 0
    return flops


# The train.py processes of this call. On Ctrl-C or SIGTERM, run_grid stops them and starts no
# new one; each goes on from its last checkpoint in the next call.
_running, _running_lock, _stopping = set(), threading.Lock(), threading.Event()


class Stopped(Exception):
    pass


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


def planned_commands(config, extra, seed, overrides):
    configs = config if isinstance(config, tuple) else (config,)
    return [[sys.executable, "train.py", c, f"--seed={seed}", *extra, *overrides] for c in configs]


def finished_runs(root, needed):
    """{run identity: directory} of the finished runs under root that hold the files `needed`."""
    finished = {}
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.endswith(".tmp")]
        if "run.json" in files and all(name in files for name in needed):
            with open(os.path.join(dirpath, "run.json")) as f:
                record = json.load(f)
            commands = record.get("commands") or [record["command"]]  # older run.json: one command
            finished.setdefault(run_identity(commands), dirpath)
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
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate.py"),
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
    for method, seed, config, extra, out in todo:
        identity = run_identity(planned_commands(config, extra, seed, overrides))
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


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def archive_run(out_dir, dest):
    """Copy what the tables need from a finished run into the committed archive: the metric
    files, and the log thinned to every evaluation plus every 50th training step."""
    os.makedirs(dest, exist_ok=True)
    for name in ("metrics.json", "marginalization.json", "run.json"):
        if os.path.exists(os.path.join(out_dir, name)):
            source = os.path.join(out_dir, name)
            atomic_write(os.path.join(dest, name), lambda tmp: shutil.copyfile(source, tmp))
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if "val" in r or (r["iter"] + 1) % 50 == 0]
    save_text("".join(json.dumps(r) + "\n" for r in kept), os.path.join(dest, "log.jsonl"))
    archive_embedding(out_dir, dest)


def archive_embedding(out_dir, dest):
    """The input embedding of best.pt and the vocabulary, for the figures (embedding.npz, ~70 KB
    for the char model; skipped for big vocabularies and when the checkpoint is gone)."""
    source, target = os.path.join(out_dir, "best.pt"), os.path.join(dest, "embedding.npz")
    if os.path.exists(target) or not os.path.exists(source):
        return
    checkpoint = torch.load(source, map_location="cpu", weights_only=True)
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
    for (method, seed, _, _, out), (_, _, _, _, dest) in zip(runs_of(grid, root), runs_of(grid, archive)):
        if not os.path.exists(os.path.join(dest, "metrics.json")) and os.path.exists(os.path.join(out, "metrics.json")):
            archive_run(out, dest)
        if os.path.exists(os.path.join(dest, "metrics.json")):
            done.add((method, seed))
            archive_embedding(out, dest)  # runs archived before the figures existed
    return done


def run_grid(grid, root, workers, overrides, archive="results/runs"):
    done = sync_archive(grid, root, archive)
    todo = [r for r in runs_of(grid, root) if (r[0], r[1]) not in done]
    reused = reuse_identical(grid, todo, root, archive, overrides)
    if reused:
        print(f"reused {len(reused)} identical finished run(s) of other grids: {reused}")
        done = sync_archive(grid, root, archive)
        todo = [r for r in todo if (r[0], r[1]) not in done]
    total = sum(1 for _ in runs_of(grid, root))
    print(f"grid '{grid}': {total} runs, {total - len(todo)} already done, {len(todo)} to run, {workers} at a time")
    if not todo:
        return 0.0
    threads = max(1, (os.cpu_count() or 1) // workers)
    peak = machine_peak()  # before any run starts: the cores are idle
    print(f"machine peak: {peak['peak_flops'] / 1e9:.0f} GFLOP/s ({peak['peak_dtype']} 2048^2 matmul on "
          f"{os.cpu_count()} cores, {cpu_name()})")
    t0, finished, flops = time.time(), 0, 0
    record = {"runs": 0, "workers": workers, "threads_per_run": threads, "cpu": cpu_name(), "cores": os.cpu_count(),
              "torch": torch.__version__, **peak}
    pool = ThreadPoolExecutor(workers)
    try:
        with tqdm(total=len(todo), desc=grid, unit="run") as bar:
            futures = {pool.submit(launch, config, extra, seed, out, threads, overrides): (method, seed, out)
                       for method, seed, config, extra, out in todo}
            for future in as_completed(futures):
                future.result()
                method, seed, out = futures[future]
                archive_run(out, run_dir(archive, grid, method, seed))
                finished += 1
                run = run_flops(out)
                flops = None if flops is None or run is None else flops + run
                bar.update(1)
    except BaseException:  # Ctrl-C, SIGTERM or a failed run: stop everything, keep what finished
        pool.shutdown(wait=False, cancel_futures=True)
        stopped = stop_runs()
        print(f"stopped: {finished} run(s) finished in this call; {stopped} running one(s) go on from their last "
              f"checkpoint in the next call", file=sys.stderr)
        raise
    finally:  # every call's wall time counts, an interrupted one too (the steps since a run's
        # last checkpoint are lost; those runs' FLOPs count when they finish)
        pool.shutdown(wait=True)
        _stopping.clear()
        record.update(wall_s=time.time() - t0, runs=finished, flops=flops)
        record_call(os.path.join(archive, grid, "wall.json"), record)
    return record["wall_s"]


def record_call(path, record):
    """Append one compare.py call's record to wall.json (a grid may take several calls, in
    several sessions: its wall time is the sum of theirs)."""
    calls = grid_calls(path)
    save_json({"calls": calls + [record]}, path)


def grid_calls(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    return data.get("calls", [data])  # an older wall.json held one call


def mean_std(values):
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(values) > 1 else 0.0)


def fmt(values, digits=3):
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


# the Stop Jostling run the strip plots mark (the authors' single notebook run), and the LR accuracy
# from which we say a seed made the jump towards it
PAPER_SE_LR_ACCURACY = 0.487
TRANSITION_LR_ACCURACY = 0.43


def load_runs(grid, root):
    """The archived runs of a grid: ({method: {seed: metrics}}, {method: {seed: {"dir", "metrics"}}})."""
    results, runs = {}, {}
    for method, seed, _, _, out in runs_of(grid, root):
        path = os.path.join(out, "metrics.json")
        if os.path.exists(path):
            with open(path) as f:
                results.setdefault(method, {})[seed] = json.load(f)
            runs.setdefault(method, {})[seed] = {"dir": out, "metrics": results[method][seed]}
    return results, runs


def paired_columns(results):
    """(title, language, metric) of the paired-difference table and the forest plot."""
    runs = [r for per_seed in results.values() for r in per_seed.values()]
    if any("lr" in r for r in runs):
        return [("LR acc", "lr", "accuracy"), ("LR MRR", "lr", "mrr"), ("LR PPL_best", "lr", "ppl_best"),
                ("HR acc", "hr", "accuracy"), ("HR PPL_best", "hr", "ppl_best"), ("LR I(W)", "lr", "isotropy")]
    columns = [("acc", "val", "accuracy"), ("MRR", "val", "mrr"), ("PPL", "val", "ppl"),
               ("PPL_best", "val", "ppl_best"), ("I(W)", "val", "isotropy")]
    if runs and all("rare" in r for r in runs):
        columns += [("rare acc", "rare", "accuracy"), ("rare PPL", "rare", "ppl")]
    return columns


def build_table(grid, root):
    """results/<grid>.md from the archived runs under root (metrics.json, marginalization.json,
    run.json, log.jsonl) and root/<grid>/wall.json."""
    methods = GRIDS[grid]
    results, runs = load_runs(grid, root)
    baseline = next(iter(methods))
    # the char grids score the val split in two languages (HR, LR); the BPE grid in one ("val")
    low_resource = any("lr" in r for runs in results.values() for r in runs.values())
    langs = ("hr", "lr") if low_resource else ("val",)
    lines = [f"# Grid `{grid}`", "",
             f"Produced by `python compare.py {grid}` from the runs' `metrics.json` (mean ± std over seeds "
             f"{', '.join(map(str, SEEDS))}, as many as each method lists). Evaluation on the whole val split, "
             "never thresholded; the checkpoint with the best " + ("mixed " if low_resource else "") + "val loss." +
             (" `paper` rows: the authors' numbers (Stop Jostling Table 7; baseline and margin 0.6 + SE from "
              "their published single-seed runs)." if grid in PAPER else ""), ""]
    claim_lines = claims.claims_table(grid, runs, baseline)
    if claim_lines:
        lines += ["## The papers' claims", ""] + claim_lines + [""]
    # where the paper's I(W) sits beside ours, ours is also computed the authors' way (a different metric:
    # metrics.isotropy_authors), from the archived tied embedding; the paper's value goes in that column
    with_authors = grid in PAPER
    header = [*METRICS, "isotropy, authors' way"] if with_authors else METRICS
    if with_authors:
        lines += ["`isotropy` is our I(W), well defined (both signs of each eigenvector); `isotropy, authors' way` is "
                  "I(W) computed as the paper computed its I(W) column (the general eigensolver's eigenvectors with the "
                  "signs it returns), so the paper's value sits in that column only.", ""]
    for lang in langs:
        lines += [f"## {lang.upper()} validation" if low_resource else "## Validation", "",
                  "| method | seeds | " + " | ".join(header) + " |", "|---" * (len(header) + 2) + "|"]
        for method in methods:
            method_runs = results.get(method, {})
            if method_runs:
                cells = [fmt([r[lang][k] for r in method_runs.values()], 2 if k in ("ppl", "ppl_best", "t_best") else 3)
                         for k in METRICS]
                if with_authors:
                    cells.append(fmt([claims.isotropy_authors_of(lang)(run) for run in runs[method].values()]))
                lines.append(f"| {method} | {len(method_runs)} | " + " | ".join(cells) + " |")
            paper = PAPER.get(grid, {}).get(method)
            if paper:
                values = [f"*{v[0 if lang == 'hr' else 1]}*" for v in paper]
                if with_authors:
                    values = values[:-1] + ["—", values[-1]]
                lines.append(f"| *paper: {method}* | 1 | " + " | ".join(values) + " |")
        lines.append("")
    # paired differences to the baseline on shared seeds
    base = results.get(baseline, {})
    # (column title, language, metric)
    columns = paired_columns(results)
    with_rare = any(lang == "rare" for _, lang, _ in columns)
    if with_rare:
        rare_max = evaluate.RARE_MAX_COUNT
        lines += ["## Rare targets", "",
                  f"The val positions whose target token occurs at most {rare_max} times in the training split "
                  "(the long tail; Stop Jostling's low-resource tokens on a natural vocabulary).", "",
                  "| method | seeds | fraction of val | PPL | accuracy | MRR |", "|---|---|---|---|---|---|"]
        for method in methods:
            runs = [r["rare"] for r in results.get(method, {}).values()]
            if runs:
                lines.append(f"| {method} | {len(runs)} | {fmt([r['fraction'] for r in runs])} | "
                             f"{fmt([r['ppl'] for r in runs], 0)} | {fmt([r['accuracy'] for r in runs])} | "
                             f"{fmt([r['mrr'] for r in runs])} |")
        lines.append("")
    lines += [f"## Paired difference to {baseline} (same seeds, method − {baseline})", "",
              "Each cell: the mean of the per-seed differences, its 95 % t interval (n − 1 degrees of freedom, not "
              "adjusted for multiple comparisons) and how many of the n seeds go the way of the mean.", "",
              "| method | seeds | " + " | ".join(c[0] for c in columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for method in list(methods)[1:]:
        runs_m = results.get(method, {})
        shared = sorted(set(runs_m) & set(base))
        if not shared:
            continue
        def diff(lang, key):
            digits = 3  # rates; perplexities with as many decimals as their size needs
            if key in ("ppl", "ppl_best"):
                digits = 2 if mean_std([base[s][lang][key] for s in shared])[0] < 100 else 0
            return claims.paired_cell(stats.paired([runs_m[s][lang][key] - base[s][lang][key] for s in shared]), digits)
        lines.append(f"| {method} | {len(shared)} | " + " | ".join(diff(lang, key) for _, lang, key in columns) + " |")
    # SimReg's claim: the same loss in fewer steps (claims.speed_up)
    lines += [] if "SimReg" not in methods else ["", f"## Steps to reach {baseline}'s final val loss (same seed)", "",
              f"Speed-up = 1 − (steps a method needs to first reach the {'mixed ' if low_resource else ''}val loss of "
              f"{baseline}'s last evaluation on the same seed) / ({baseline}'s total steps); the crossing is linearly "
              f"interpolated between evaluations (every eval_interval steps), and a run that never reaches it counts "
              f"as 0. {baseline}'s own row is the noise floor: its curve can dip below its final value before the end. "
              "Chained methods (CWT + FT) are left out: their log holds the fine-tune only.", "",
              "| method | seeds that reach it | speed-up in %, mean [95 % CI], k/n |", "|---|---|---|"]
    for method in methods if "SimReg" in methods else []:
        shared = sorted(set(results.get(method, {})) & set(base))
        if not shared or isinstance(methods[method][0], tuple):
            continue
        curves = [(claims.val_curve(run_dir(root, grid, method, s)), claims.val_curve(run_dir(root, grid, baseline, s)))
                  for s in shared]
        reached = sum(claims.steps_to_reach(mine, base[-1][1]) is not None for mine, base in curves)
        speed = [100 * claims.speed_up_of_curves(mine, base) for mine, base in curves]
        lines.append(f"| {method} | {reached} of {len(shared)} | {claims.paired_cell(stats.paired(speed), 1)} |")
    # Stop Jostling's headline run may be a transition some seeds make, not a shift of the mean
    if low_resource:
        lines += ["", "## Per seed: LR accuracy and the Stop Jostling transition", "",
                  f"A seed \"makes the transition\" when its LR accuracy reaches {TRANSITION_LR_ACCURACY} (about halfway "
                  f"from the ≈ .37 of thresholded runs to the authors' {PAPER_SE_LR_ACCURACY}). Values sorted, best "
                  "checkpoint (best mixed val loss).", "",
                  "| method | seeds | LR accuracy per seed | seeds at or above the threshold | twin in top-3 per seed |",
                  "|---|---|---|---|---|"]
        for method in methods:
            method_runs = results.get(method, {})
            if method_runs:
                acc = sorted(r["lr"]["accuracy"] for r in method_runs.values())
                twins = sorted(r["translations"]["twin_top3_fraction"] for r in method_runs.values())
                lines.append(f"| {method} | {len(acc)} | {' '.join(f'{a:.3f}' for a in acc)} | "
                             f"{sum(a >= TRANSITION_LR_ACCURACY for a in acc)} of {len(acc)} | "
                             f"{' '.join(f'{t:.3f}' for t in twins)} |")
    # geometry of the embedding (the char grids: twins across languages)
    lines += [] if not low_resource else ["", "## Embedding geometry", "",
              "| method | I(W) all rows | twin in top-3 (of 130 rows) | 12 cases (A/a, HR/LR) | all letters (of 312) |",
              "|---|---|---|---|---|"]
    for method in methods if low_resource else []:
        runs = list(results.get(method, {}).values())
        if runs:
            t = [r["translations"] for r in runs]
            lines.append(f"| {method} | {fmt([r['isotropy_all'] for r in runs])} | "
                         f"{fmt([x['twin_top3_fraction'] for x in t])} | {fmt([x['cases_12'] for x in t], 1)} | "
                         f"{fmt([x['cases_letters'] for x in t], 1)} |")
    # hidden-state geometry (runs evaluated with geometry metrics)
    if any("geometry" in r for runs in results.values() for r in runs.values()):
        lines += ["", "## Hidden-state geometry" + (" (HR val)" if low_resource else " (val)"), "",
                  "mu(l): mean pairwise cosine of a sequence's states after block l; rho / tau: Spearman and "
                  "Kendall correlation of mu(l) with depth (positive = condensing with depth); SimReg value of "
                  "the final states at tau 0.01.", "",
                  "| method | mu(last block) | Spearman rho | Kendall tau | final-state cosine | SimReg(final) |",
                  "|---|---|---|---|---|---|"]
        for method in methods:
            runs = [r["geometry"][langs[0]] for r in results.get(method, {}).values() if "geometry" in r]
            if runs:
                simreg_values = [g["simreg_final"] for g in runs]
                corr = {k: [g[k] for g in runs if g[k] is not None] for k in ("spearman_rho", "kendall_tau")}
                rho, tau = (fmt(corr[k], 2) if corr[k] else "n/a" for k in ("spearman_rho", "kendall_tau"))
                lines.append(f"| {method} | {fmt([g['mu'][-1] for g in runs])} | {rho} | {tau} | {fmt([g['final_cosine'] for g in runs])} | "
                             f"{mean_std(simreg_values)[0]:.1e} ± {mean_std(simreg_values)[1]:.1e} |")
    # marginalization ratios
    marg = {}
    for method, seed, _, _, out in runs_of(grid, root):
        path = os.path.join(out, "marginalization.json")
        if os.path.exists(path):
            with open(path) as f:
                marg.setdefault(method, []).append(json.load(f))
    if marg:
        lines += ["", "## Marginalization of low-resource tokens (gradient-norm ratios, whole run)", "",
                  "Per LR token: Ratio of Average = (avg g_input + avg g_target) / avg g_non-target; Average of "
                  "Ratio = avg over steps of (g_input + g_target) / g_non-target (Stop Jostling Sec. 4.2). Means over "
                  "the 65 LR tokens, then mean ± std over seeds. Paper: baseline has the 14 rarest tokens below 1 "
                  "in Ratio of Average and all 65 below 1 in Average of Ratio; thresholding raises them by 12 % "
                  "and 45 %.", "",
                  "| method | seeds | mean Ratio of Average | mean Average of Ratio | tokens with RoA < 1 | tokens with AoR < 1 |",
                  "|---|---|---|---|---|---|"]
        for method, reports in marg.items():
            lines.append(f"| {method} | {len(reports)} | {fmt([r['mean_ratio_of_average'] for r in reports])} | "
                         f"{fmt([r['mean_average_of_ratio'] for r in reports])} | "
                         f"{fmt([r['n_ratio_of_average_below_1'] for r in reports], 1)} | "
                         f"{fmt([r['n_average_of_ratio_below_1'] for r in reports], 1)} |")
        marg_seeds = {}
        for method, seed, _, _, out in runs_of(grid, root):
            if os.path.exists(os.path.join(out, "marginalization.json")):
                with open(os.path.join(out, "marginalization.json")) as f:
                    marg_seeds.setdefault(method, {})[seed] = json.load(f)
        names = list(marg_seeds)
        if len(names) >= 2:
            a, b = marg_seeds[names[0]], marg_seeds[names[1]]
            shared = sorted(set(a) & set(b))
            cells = [claims.paired_cell(stats.paired([100 * (b[s][key] / a[s][key] - 1) for s in shared]), 1)
                     for key in ("mean_ratio_of_average", "mean_average_of_ratio")]
            lines += ["", f"{names[1]} vs {names[0]}, paired on seeds {', '.join(map(str, shared))} (relative change per "
                      f"seed, %): Ratio of Average {cells[0]}; Average of Ratio {cells[1]} (paper: +12 % and +45 %)."]
    # speed: training throughput from each run's log, wall times from run.json / wall.json
    lines += ["", "## Speed", "", "| method | runs | median tokens/s per run | median ms/iter | median MFU | mean wall time per run |",
              "|---|---|---|---|---|---|"]
    seconds = {"steps": 0.0, "single_stage_runs": 0.0, "runs": 0.0}  # for time_breakdown
    for method in methods:
        speeds, walls = [], []
        for m, seed, _, _, out in runs_of(grid, root):
            if m != method or not os.path.exists(os.path.join(out, "metrics.json")):
                continue
            with open(os.path.join(out, "log.jsonl")) as f:
                run_speeds = [json.loads(line) for line in f if '"tokens_per_s"' in line]
            speeds += run_speeds
            if os.path.exists(os.path.join(out, "run.json")):
                with open(os.path.join(out, "run.json")) as f:
                    run = json.load(f)
                walls.append(run["wall_s"])
                seconds["runs"] += run["wall_s"]
                if run_speeds and len(run.get("commands", [])) == 1:  # a chained run's log holds its last stage
                    iterations = run_speeds[-1]["iter"] + 1
                    seconds["steps"] += iterations * statistics.median(r["ms_per_iter"] for r in run_speeds) / 1000
                    seconds["single_stage_runs"] += run["wall_s"]
        if speeds:
            med = {k: torch.tensor([r[k] for r in speeds]).median().item() for k in ("tokens_per_s", "ms_per_iter", "mfu")}
            wall = f"{sum(walls) / len(walls) / 60:.1f} min" if walls else "n/a"
            lines.append(f"| {method} | {len(results.get(method, {}))} | {med['tokens_per_s']:.0f} | "
                         f"{med['ms_per_iter']:.1f} | {med['mfu']:.2f} | {wall} |")
    lines += speed_summary(grid, root, seconds)
    return "\n".join(lines) + "\n", results


def peak_range(calls):
    """'measured peak of 176 GFLOP/s (float32, all cores)', or, when calls measured different
    peaks, their range: each call's FLOPs are divided by the peak measured at that call's start."""
    calls = [c for c in calls if c["flops"]] or calls  # a call stopped before any FLOPs used no peak
    peaks, dtype = sorted({round(c["peak_flops"] / 1e9) for c in calls}), calls[-1]["peak_dtype"]
    if len(peaks) == 1:
        return f"measured peak of {peaks[0]} GFLOP/s ({dtype}, all cores)"
    return f"peaks measured at each call's start ({dtype}, all cores: {peaks[0]}–{peaks[-1]} GFLOP/s)"


def speed_summary(grid, root, seconds):
    """The grid's wall time over all compare.py calls and its efficiency:
    (grid FLOPs / peak) / wall time, where grid FLOPs are what the runs executed (training,
    evaluation, fine-tuning; train.py counts them) and peak is the matmul peak each call
    measured on all cores before starting; then where the time went (time_breakdown of the
    `seconds` build_table summed while it read the runs' logs)."""
    calls = grid_calls(os.path.join(root, grid, "wall.json"))
    lines = ["", "MFU per run = model FLOPs (6N + attention) / that run's own measured fp32 2048² matmul peak "
             "on its thread(s), measured while other runs may share the machine."]
    if not calls:
        return lines
    wall = sum(c["wall_s"] for c in calls)
    runs = sum(c["runs"] for c in calls)
    last = calls[-1]
    lines += ["", f"Wall time: {runs} runs in {wall / 3600:.2f} h over {len(calls)} `compare.py {grid}` call(s), "
              f"{last['workers']} runs at a time with {last['threads_per_run']} thread(s) each, on {last['cpu']} "
              f"({last['cores']} cores), torch {last['torch']}."]
    counted = [c for c in calls if c.get("flops") is not None and c.get("peak_flops")]
    if counted:
        flops = sum(c["flops"] for c in counted)
        at_peak = sum(c["flops"] / c["peak_flops"] for c in counted)
        counted_wall = sum(c["wall_s"] for c in counted)
        scope = "" if len(counted) == len(calls) else \
            f" (the {len(counted)} call(s) whose runs counted their FLOPs: {sum(c['runs'] for c in counted)} runs, {counted_wall / 3600:.2f} h)"
        lines += ["", f"**Efficiency = (grid FLOPs / peak) / wall time = {at_peak / counted_wall:.2f}**{scope}: "
                  f"{flops / 1e15:.3f} PFLOP executed (training, evaluation and fine-tuning), which at the "
                  f"{peak_range(counted)} would take {at_peak / 60:.1f} min."]
    else:
        lines += ["", "Efficiency: not available (these runs were made before train.py counted the FLOPs it executes)."]
    return lines + time_breakdown(seconds, wall, last["workers"])


def time_breakdown(seconds, grid_wall, workers):
    """Where a grid's wall time went: the share of the runs' wall time spent in training steps
    (each run's iterations x its median ms/iter; single-stage runs only, since a chained run's log
    holds its last stage), and how much of workers x grid wall time the runs themselves filled
    (the rest: the grid's tail, when fewer runs than workers are left, and the gaps between runs).
    `seconds` is summed over the runs by build_table."""
    step_s, run_s, all_runs_s = seconds["steps"], seconds["single_stage_runs"], seconds["runs"]
    if not run_s:
        return []
    return ["", f"Where the time went: training steps (iterations × median ms/iter) are {100 * step_s / run_s:.0f} % "
            f"of the single-stage runs' wall time, the rest being evaluation, checkpoints and process start; "
            f"the runs' wall times fill {100 * all_runs_s / (workers * grid_wall):.0f} % of {workers} × the grid's "
            f"wall time, the rest being the grid's tail (fewer runs left than run at a time) and the gaps between runs."]




def make_figures(grid, root, out_dir):
    """PNGs of the archived runs under root into out_dir/figures (figures.py; needs matplotlib):
    the forest plot of paired differences, per-seed strip plots, val-loss differences to the
    baseline, condensation of every method, and (char grids) the embedding of the baseline and
    margin 0.6 + SE. Returns [(title, path relative to out_dir)] of those written."""
    if figures._pyplot() is None:
        return []
    results, runs = load_runs(grid, root)
    if not results:
        return []
    methods = [m for m in GRIDS[grid] if m in results]
    baseline = methods[0]
    colours = figures.method_colours(list(GRIDS[grid]))
    written, base = [], os.path.join(out_dir, "figures")
    low_resource = any("lr" in r for per_seed in results.values() for r in per_seed.values())

    def add(title, path):
        if path:
            written.append((title, os.path.relpath(path, out_dir)))

    forest = {}
    for title, lang, key in paired_columns(results):
        # perplexities in the hundreds (BPE) vary by orders of magnitude across methods: relative changes
        relative = "ppl" in key and np.mean([r[lang][key] for r in results[baseline].values()]) > 100
        rows = []
        for method in methods[1:]:
            shared = sorted(set(results[method]) & set(results[baseline]))
            if shared:
                mine, theirs = ([results[m][s][lang][key] for s in shared] for m in (method, baseline))
                r = stats.paired([100 * (a / b - 1) if relative else a - b for a, b in zip(mine, theirs)])
                rows.append((method, r["mean"], r["low"], r["high"], r["n"]))
        forest[f"{title} (%)" if relative else title] = rows
    add(f"Paired differences to {baseline} (same seeds), mean and 95 % t interval", figures.forest_plot(
        forest, os.path.join(base, f"{grid}_forest.png"), baseline, colours))

    def per_seed(get):
        return {m: [get(r) for r in results[m].values()] for m in methods}
    if low_resource:
        strips = {"LR accuracy": per_seed(lambda r: r["lr"]["accuracy"]),
                  "twin in top-3 (fraction of 130 rows)": per_seed(lambda r: r["translations"]["twin_top3_fraction"])}
        references = {"LR accuracy": ("paper, margin 0.6 + SE (1 run)", PAPER_SE_LR_ACCURACY)}
    else:
        strips = {"PPL": per_seed(lambda r: r["val"]["ppl"]), "accuracy": per_seed(lambda r: r["val"]["accuracy"])}
        if all("rare" in r for m in methods for r in results[m].values()):
            strips["rare-target MRR"] = per_seed(lambda r: r["rare"]["mrr"])
        references = None
    add("Every seed's value per method", figures.strip_plot(strips, os.path.join(base, f"{grid}_seeds.png"),
                                                            references, colours))

    differences = {}
    for method in methods[1:]:
        if isinstance(GRIDS[grid][method][0], tuple):
            continue  # a chained run's log holds its last stage (the fine-tune): not on the same axis
        steps, rows = None, []
        for seed in sorted(set(results[method]) & set(results[baseline])):
            mine, theirs = (dict(claims.val_curve(runs[m][seed]["dir"])) for m in (method, baseline))
            common = sorted(set(mine) & set(theirs))
            steps = common if steps is None else [s for s in steps if s in common]
            rows.append((mine, theirs))
        if steps:
            differences[method] = (steps, [[mine[s] - theirs[s] for s in steps] for mine, theirs in rows])
    add(f"Val loss minus {baseline}'s on the same seed (mean, ±2 standard errors); chained methods left out",
        figures.val_loss_differences(differences, os.path.join(base, f"{grid}_val_loss.png"), baseline,
                                     "mixed HR/LR val loss" if low_resource else "val loss", colours))

    if low_resource:  # the LR val loss of every seed of the Stop Jostling trio: does any seed depart?
        trio = [m for m in methods if m in (baseline, "margin 0.6", "margin 0.6 + SE")]
        curves = {}
        for method in trio:
            for seed, run in runs[method].items():
                with open(os.path.join(run["dir"], "log.jsonl")) as f:
                    evals = [r for r in map(json.loads, f) if "val_lr" in r]
                curves.setdefault(method, {})[seed] = ([r["iter"] for r in evals], [r["val_lr"] for r in evals])
        add("LR val loss (20 batches, never thresholded) of every seed", figures.seed_curves(
            curves, os.path.join(base, f"{grid}_lr_val_per_seed.png"), "LR val loss (nats)", colours))

    histograms, split = {}, "val"
    for method in methods:
        geometries = [r["geometry"] for r in results[method].values() if r.get("geometry")]
        if geometries:
            split = "HR val" if "hr" in geometries[0] else "val"  # the char grids: the HR language
            histograms[method] = np.mean([np.asarray(g.get("hr", g.get("val"))["cosine_histograms"])
                                          for g in geometries], axis=0)
    if histograms:
        add(f"Condensation: pairwise-cosine histogram per depth ({split}, mean over seeds)",
            figures.condensation_heatmaps(histograms, os.path.join(base, f"{grid}_condensation.png")))

    embeddings, itos = {}, None
    for method in [baseline, "margin 0.6 + SE"] if low_resource else []:
        path = os.path.join(runs.get(method, {}).get(SEEDS[0], {}).get("dir", ""), "embedding.npz")  # first seed
        if os.path.exists(path):
            with np.load(path) as data:
                embeddings[f"{method} (seed {SEEDS[0]})"], itos = data["wte"], [str(c) for c in data["itos"]]
    if embeddings and all(len(E) == 2 * len(itos) for E in embeddings.values()):
        add("Embedding cosine similarity, letters sorted, HR then LR (Stop Jostling Fig. 5)",
            figures.embedding_similarity(embeddings, itos, os.path.join(base, f"{grid}_embedding_similarity.png")))
        add("Embedding PCA, each letter joined to its twin (Stop Jostling Fig. 6)",
            figures.embedding_pca(embeddings, itos, os.path.join(base, f"{grid}_embedding_pca.png")))
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", choices=sorted(GRIDS))
    parser.add_argument("--root", default="out/compare", help="where the runs go (checkpoints included)")
    parser.add_argument("--archive", default="results/runs", help="where the finished runs' small files are kept")
    parser.add_argument("--results", default="results", help="where <grid>.md is written")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time")
    parser.add_argument("--table_only", action="store_true", help="only rebuild the table")
    parser.add_argument("overrides", nargs="*", help="--key=value passed to every run (e.g. --max_iters=50)")
    args, unknown = parser.parse_known_args(argv)
    overrides = args.overrides + unknown
    if not args.table_only:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the grid as Ctrl-C does
        run_grid(args.grid, args.root, args.workers, overrides, args.archive)
    sync_archive(args.grid, args.root, args.archive)
    table, _ = build_table(args.grid, args.archive)
    drawn = make_figures(args.grid, args.archive, args.results)
    if drawn:
        table += "\n## Figures\n\n" + "\n\n".join(f"{title}:\n\n![{title}]({path})" for title, path in drawn) + "\n"
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"{args.grid}.md")
    save_text(table, path)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
