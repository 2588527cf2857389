"""
How much GPU memory does each paper-scale config need? Prints a Markdown table:

    python -m tools.memory_table config/baseline_350m.py config/simreg_7b.py ... [--gpus 8]

One row per config, for its own parallelism ('none' counts as DDP) on --gpus
processes: plan.py's figures.
"""

import argparse
import os

from configurator import parse_config, train_defaults
from errors import UserError, run_script
from plan import make_plan
from utils import markdown_table

HEADER = ["config", "params", "parallel", "micro-batch x T x micro-steps",
          "weights + grads + AdamW (+ FSDP's gathered unit and unsharded grads)",
          "activations", "with activation checkpointing", "total"]


def read_config(*args):
    """A run's config from train.py's arguments (config files, --key=value)."""
    return parse_config(list(args), train_defaults())


def table_lines(paths, gpus, measure=True):
    rows = []
    for path in paths:
        config = read_config(path)
        if config["parallel"] == "none":  # a one-process config, counted as DDP on gpus
            config["parallel"] = "ddp"
        p = make_plan(config, gpus, measure=measure)
        mode = p["parallel"]
        parts = p["memory_parts"]
        total = p["memory"][mode]["checkpointed" if p["activation_checkpointing"] else "plain"]
        rows.append((os.path.basename(path), f"{p['params'] / 1e9:.2f}B", mode,
                     f"{p['micro_batch']} x {p['seq_len']} x {p['micro_steps']}",
                     *(f"{x:.1f}" for x in (parts[mode], parts["act"], parts["act_ckpt"], total))))
    return [f"GiB per GPU on {gpus} GPU(s), the config's own parallelism; activations of one "
            "micro-batch, in the compute dtype", "", *markdown_table(HEADER, rows)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--gpus", type=int, default=8, help="processes, one per GPU")
    args = parser.parse_args()
    for path in args.configs:
        if not os.path.exists(path):
            raise UserError(f"no config file {path}")
    print("\n".join(table_lines(args.configs, args.gpus)))  # a bad key or --gpus: ConfigError, status 2


if __name__ == "__main__":
    run_script(main)
