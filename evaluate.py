"""
Evaluate a saved checkpoint with the metrics of Stop Jostling (Sec. 4.3,
Table 1) on the whole val split, in each language:

    python evaluate.py out/lowres_baseline/best.pt  # writes eval_best.json
    python evaluate.py run/best.pt --data_dir=DIR --out=scores.json

An existing file is replaced only with --overwrite; a run's
metrics.json keeps its training FLOPs.
The metrics and design notes: docs/metrics.md
"""

import argparse
import json
import os

import checkpoint as checkpoints
from errors import UserError, run_script
from scoring import evaluate_checkpoint, format_metrics, with_run_flops
from utils import (PathError, check_writable, choose_device,
                   keep_freed_memory, save_json, write_failure)


def flops_of_run(checkpoint_path, out):
    """The FLOPs a run executed: those in `out` if it is a run's
    metrics.json; else, if `out` is the metrics.json path of
    checkpoint_path's run, its ckpt.pt's flops_done; else None."""
    previous = {}
    if os.path.exists(out):
        try:
            with open(out) as f:
                previous = json.load(f)
        except ValueError:
            pass
    if isinstance(previous, dict) and "train" in previous.get("flops", {}):
        return previous["flops"]
    run_dir = os.path.dirname(os.path.abspath(checkpoint_path))
    ckpt = os.path.join(run_dir, "ckpt.pt")
    is_run_metrics = (os.path.abspath(out)
                      == os.path.join(run_dir, "metrics.json"))
    if not is_run_metrics or not os.path.isfile(ckpt):
        return None
    try:
        return checkpoints.load(ckpt, need=(), mmap=True).get("flops_done")
    except checkpoints.CheckpointError:
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arg = parser.add_argument
    arg("checkpoint",
        help="path to a checkpoint written by train.py (best.pt or ckpt.pt)")
    arg("--out", default=None,
        help="where to write the metrics (default: eval_<name>.json beside it)")
    arg("--overwrite", action="store_true", help="replace --out if it exists")
    arg("--data_dir", default=None,
        help="the dataset, if not where the run found it")
    arg("--device", default="auto")
    args = parser.parse_args(argv)
    keep_freed_memory()
    path = args.checkpoint.rstrip("/")
    stem = os.path.splitext(os.path.basename(path))[0]
    out = args.out or os.path.join(os.path.dirname(path), f"eval_{stem}.json")
    if os.path.exists(out) and not args.overwrite:
        raise UserError(f"{out} exists; pass --overwrite to replace it or "
                        f"--out to write elsewhere")
    # now, not after the evaluation (no checkpoint: say that instead)
    if args.out or os.path.exists(args.checkpoint):
        check_writable(out, "--out" if args.out else "the output")
    try:
        device = choose_device(args.device)
        result = evaluate_checkpoint(args.checkpoint, device, args.data_dir)
    except ValueError as e:  # no such --device, a foreign checkpoint
        raise UserError(str(e)) from None
    run_flops = flops_of_run(args.checkpoint, out)
    if run_flops is not None:
        result = with_run_flops(result, run_flops)
    try:
        save_json(result, out)
        failure = None
    except OSError as e:  # a full disk: the figures still reach the screen
        failure = write_failure(out, e)
    print(format_metrics(result))
    print(json.dumps(result["checkpoint"]))
    if failure:
        raise PathError(failure)


if __name__ == "__main__":
    run_script(main)
