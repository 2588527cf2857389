"""
Issue 61's pre-registered intervention (results/preregistration_intervention.md): does the step-1000
alignment of the low-resource (LR) embedding rows with their high-resource (HR) twins cause the
Stop Jostling transition, or only predict it?

Each seed trains a trunk to step 1000 (margin 0.6; the first 8 seeds also under CE). Branches
continue the trunk's checkpoint to step 8000 exactly; only the LR rows of the tied embedding
change (`rotate_twins`):

    untouched, raised, sham, lowered: as the pre-registration defines them

One branch by hand, then its training:

    python -m tools.intervention branch out/trunk out/raised --arm=raised --seed=1391
    python train.py config/lowres_margin_0.6.py --seed=1391 --out_dir=out/raised --init_from=resume

The whole study (Ctrl-C stops it at a checkpoint; the next call goes
on from there), and its registered tests (tools/intervention_tests.py):

    python -m tools.intervention run --root out/intervention --workers 2
    python -m tools.intervention_tests
"""

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

from errors import UsageError, run_script
from metrics import twin_alignment
from tools import identity, runner
from tools.grids import run_dir
from utils import read_log, save_json, torch_save

GRID = "jostling_intervention"
SEEDS = list(range(1391, 1407))
CE_SEEDS = SEEDS[:8]
TRUNK_STEP = 1000
RAISED_COS = 0.20
LOWERED_COS = 0.05
CUTOFF = 0.1224  # the registered predictor's (results/preregistration.md)
CONFIGS = {"margin 0.6": "config/lowres_margin_0.6.py", "CE": "config/lowres_ce.py"}
ARMS = {"margin 0.6": ("untouched", "raised", "sham", "lowered"), "CE": ("untouched", "raised")}
TARGETS = {"untouched": None, "raised": RAISED_COS, "sham": RAISED_COS, "lowered": LOWERED_COS}


def rotate_twins(E, shift, arm, target=None, generator=None):
    """(E, theta): E with its LR rows shift..2*shift-1 turned by the
    common angle theta relative to their HR twins 0..shift-1 (generator
    draws the sham's directions); theta is bisected on the mean twin
    cosine, monotone in it; a mean already past the target is kept.
    The arms: results/preregistration_intervention.md."""
    if arm == "untouched":
        return E.clone(), 0.0
    X = E.double()
    h = torch.nn.functional.normalize(X[:shift], dim=1)
    e = X[shift:2 * shift]
    norm = e.norm(dim=1, keepdim=True)
    a = (e * h).sum(dim=1, keepdim=True)  # along the twin
    rest = e - a * h
    b = rest.norm(dim=1, keepdim=True)  # orthogonal to it
    u = rest / b.clamp(min=1e-30)
    phi = torch.atan2(b, a)  # the angle to the twin, in [0, pi]
    sign = 1 if arm in ("raised", "sham") else -1  # towards the twin, or away

    def turn(theta):  # each row's new phi, stopping on the twin or opposite it
        return (phi - sign * theta).clamp(0, math.pi)

    if sign * torch.cos(phi).mean().item() >= sign * target:
        return E.clone(), 0.0
    low, high = 0.0, math.pi
    for _ in range(100):
        theta = (low + high) / 2
        if sign * torch.cos(turn(theta)).mean().item() < sign * target:
            low = theta
        else:
            high = theta
    theta = high
    new_phi = turn(theta)
    if arm == "sham":
        # a unit w orthogonal to the twin and to u: turning u towards w
        # by beta keeps the twin cosine; beta moves the row by the
        # raised angle
        w = torch.randn(e.shape, generator=generator, dtype=torch.float64)
        w = w - (w * h).sum(dim=1, keepdim=True) * h
        w = torch.nn.functional.normalize(w - (w * u).sum(dim=1, keepdim=True) * u, dim=1)
        sin2 = torch.sin(phi) ** 2
        cos_beta = (torch.cos(phi - new_phi) - torch.cos(phi) ** 2) / sin2.clamp(min=1e-30)
        cos_beta = cos_beta.clamp(-1, 1)
        beta = torch.where(sin2 > 1e-24, torch.acos(cos_beta), torch.zeros_like(cos_beta))
        moved = a * h + b * (torch.cos(beta) * u + torch.sin(beta) * w)
    else:
        moved = norm * (torch.cos(new_phi) * h + torch.sin(new_phi) * u)
    out = E.clone()
    out[shift:2 * shift] = moved.to(E.dtype)
    return out, theta


def make_branch(trunk_dir, out_dir, arm, seed):
    """The trunk's ckpt.pt and log copied to out_dir, its LR rows
    rotated by arm, its best validation loss reset; out_dir appears
    only complete. Returns the intervention record."""
    if os.path.exists(out_dir):
        raise UsageError(f"{out_dir} already exists: a branch is made once "
                         "(remove it to make it again)")
    path = os.path.join(trunk_dir, "ckpt.pt")
    if not os.path.exists(path):
        raise UsageError(f"no trunk checkpoint at {path}: a branch starts from "
                         "the trunk's ckpt.pt")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if "model" not in checkpoint or not checkpoint["config"].get("low_resource", True):
        raise UsageError(f"{path} is not a whole-weights checkpoint of a two-language run")
    shift = checkpoint["meta"]["vocab_size"]
    weights = checkpoint["model"]
    before = twin_alignment(weights["wte.weight"], shift)["twin_cos"]
    generator = torch.Generator().manual_seed(seed)
    rotated, theta = rotate_twins(weights["wte.weight"], shift, arm, TARGETS[arm], generator)
    weights["wte.weight"] = rotated
    if "lm_head.weight" in weights and checkpoint["model_config"].get("tie_weights", True):
        weights["lm_head.weight"] = rotated  # tied: the same tensor
    checkpoint["best_val_loss"] = float("inf")
    record = {"arm": arm, "target": TARGETS[arm], "theta": theta, "seed": seed,
              "step": checkpoint["iter_num"], "twin_cos_before": before,
              "twin_cos_after": twin_alignment(rotated, shift)["twin_cos"],
              "trunk": os.path.abspath(trunk_dir)}
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    torch_save(checkpoint, os.path.join(tmp, "ckpt.pt"))
    shutil.copyfile(os.path.join(trunk_dir, "log.jsonl"), os.path.join(tmp, "log.jsonl"))
    save_json(record, os.path.join(tmp, "intervention.json"))
    os.rename(tmp, out_dir)
    return record


def step_reading(run_directory, step):
    """twin_cos logged at the evaluation of that step, or None."""
    return next((r["twin_cos"] for r in read_log(os.path.join(run_directory, "log.jsonl"))
                 if r["iter"] == step and "twin_cos" in r), None)


def job(loss, arm, seed, root, archive, trunk=None):
    """Train and archive the seed's trunk (arm "trunk") or, after the
    future trunk, a branch of it (lowered only above the cut-off).
    Returns the archive's folder if this call archived it."""
    if trunk is not None:
        trunk.result()
    out, dest = (run_dir(d, GRID, f"{loss} {arm}", seed) for d in (root, archive))
    if runner.has_metrics(dest):
        return None
    cmd = [sys.executable, "train.py", CONFIGS[loss], f"--seed={seed}", f"--out_dir={out}",
           "--num_threads=1"]
    extra = {}
    if arm == "trunk":
        cmd.insert(4, f"--max_iters={TRUNK_STEP}")
    else:
        trunk_out, trunk_dest = (run_dir(d, GRID, f"{loss} trunk", seed) for d in (root, archive))
        if arm == "lowered" and not step_reading(trunk_dest, TRUNK_STEP) > CUTOFF:
            return None
        if not os.path.exists(out):
            make_branch(trunk_out, out, arm, seed)
        extra["intervention"] = identity.read_json(os.path.join(out, "intervention.json"))
        extra["branch_command"] = [sys.executable, "-m", "tools.intervention", "branch",
                                   trunk_out, out, f"--arm={arm}", f"--seed={seed}"]
    if not runner.has_metrics(out):
        os.makedirs(out, exist_ok=True)
        identity.mark_start(out)
        runner.run_stage(cmd, out, dict(os.environ, OMP_NUM_THREADS="1"))
    save_json({"commands": [cmd], **extra, "identity": identity.record([cmd]),
               "provenance": identity.provenance([cmd], identity.started(out))},
              os.path.join(out, "run.json"))
    runner.archive_run(out, dest)
    if extra:
        shutil.copyfile(os.path.join(out, "intervention.json"),
                        os.path.join(dest, "intervention.json"))
    return dest


def jobs():
    """(loss, arm, seed): every trunk first, then the branches seed by seed."""
    seeds = {"margin 0.6": SEEDS, "CE": CE_SEEDS}
    trunks = [(loss, "trunk", s) for loss in CONFIGS for s in seeds[loss]]
    branches = [(loss, arm, s) for s in SEEDS for loss in CONFIGS for arm in ARMS[loss]
                if s in seeds[loss]]
    return trunks + branches


def run_study(root, archive, workers):
    """Every trunk and branch not yet archived, `workers` train.py
    processes at a time; a branch's trunk is queued before it, so no
    worker waits on unstarted work. The call's record in the study's
    wall.json names the runs it archived."""
    t0 = time.time()
    wall_path = os.path.join(archive, GRID, "wall.json")
    call = f"pid {os.getpid()} on {socket.gethostname()}, started {identity.utc(t0)}"
    record = {"call": call, "workers": workers, "threads_per_run": 1,
              "cpu": identity.cpu_name(), "cores": os.cpu_count(),
              "torch": torch.__version__, "wall_s": 0.0, "runs": []}
    pool = ThreadPoolExecutor(workers)
    futures = {}
    try:
        for loss, arm, seed in jobs():
            trunk = futures.get((loss, "trunk", seed))  # None for a trunk
            futures[loss, arm, seed] = pool.submit(job, loss, arm, seed, root, archive, trunk)
        for future in as_completed(futures.values()):
            archived = future.result()
            if archived is not None:
                record["runs"].append(archived)
                record.update(wall_s=time.time() - t0)
                runner.record_call(wall_path, record)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        print(f"stopped: {runner.stop_runs()} running run(s) go on from their last "
              "checkpoint next time", file=sys.stderr)
        raise
    finally:
        pool.shutdown(wait=True)
        record.update(wall_s=time.time() - t0)
        runner.record_call(wall_path, record)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.intervention",
                                     description=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("branch", help="make one branch from a trunk's ckpt.pt")
    one.add_argument("trunk")
    one.add_argument("out_dir")
    one.add_argument("--arm", choices=list(TARGETS), required=True)
    one.add_argument("--seed", type=int, required=True,
                     help="the run's seed (it seeds the sham's directions)")
    study = sub.add_parser("run", help="train every trunk and branch of the study")
    study.add_argument("--root", default="out/intervention")
    study.add_argument("--archive", default="results/runs")
    study.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "branch":
        print(json.dumps(make_branch(args.trunk, args.out_dir, args.arm, args.seed)))
    else:
        run_study(args.root, args.archive, args.workers)


if __name__ == "__main__":
    try:
        run_script(main)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the runs stopped at a checkpoint
        sys.exit(130)
