"""
How much GPU memory does each paper-scale config need? Prints a Markdown table:

    python -m tools.memory_table config/baseline_350m.py config/simreg_7b.py ... [--gpus 8]

One row per config, for the parallelism the config names (its `parallel` key; 'none' counts as
DDP's states without buckets) on --gpus processes. The figures are plan.py's (what
`train.py --dry_run=True` prints): states from the parameter count, activations measured by a
forward pass at the config's real width (see plan.py's docstring).
"""

import argparse
import os

import torch

from configurator import parse_config, train_defaults
from errors import UserError, end_with
from plan import make_plan


def read_config(path):
    """A config file as a run reads it: train.py's defaults, then the file (its includes followed)."""
    return parse_config([path], train_defaults())


def table_lines(paths, gpus, measure=True):
    """The Markdown table for each config file (tools/bench.py puts it in results/bench.md)."""
    lines = [f"GiB per GPU on {gpus} GPU(s), the config's own parallelism; activations of one micro-batch, "
             "in the compute dtype", "",
             "| config | params | parallel | micro-batch x T x micro-steps | weights + grads + AdamW (+ "
             "FSDP's gathered unit and unsharded grads) | activations | with activation checkpointing | "
             "total |",
             "|---|---|---|---|---|---|---|---|"]
    for path in paths:
        p = make_plan(read_config(path), gpus, measure=measure)
        mode = "fsdp" if p["parallel"] == "fsdp" else "ddp"
        parts = p["memory_parts"]
        total = p["memory"][mode]["checkpointed" if p["activation_checkpointing"] else "plain"]
        lines.append(f"| {os.path.basename(path)} | {p['params'] / 1e9:.2f}B | {p['parallel']} | "
                     f"{p['micro_batch']} x {p['seq_len']} x {p['micro_steps']} | {parts[mode]:.1f} | "
                     f"{parts['act']:.1f} | {parts['act_ckpt']:.1f} | {total:.1f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--gpus", type=int, default=8, help="processes, one per GPU")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    missing = [path for path in args.configs if not os.path.exists(path)]
    if missing:
        raise UserError(f"no config file {missing[0]}")
    print("\n".join(table_lines(args.configs, args.gpus)))  # a config, a key or --gpus: a ConfigError, status 2


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # the one place a problem the user can fix ends the process
        end_with(e)
