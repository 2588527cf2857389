"""
A lecture's demo of Stop Jostling (Turumtaev 2024): cross-entropy pushes a rare token's embedding
away from every context where it is a wrong answer; thresholding at margin 0.6 stops most of that
push. It trains the low-resource toy twice for a few hundred steps, CE and margin 0.6, side by
side, and prints each run's gradient parts of the rarest low-resource rows:

    python -m tools.demo                        # 300 steps each, the two runs at once
    python -m tools.demo --max_iters 600 --data_source=/path/to/input.txt

Ratio of Average (metrics.marginalization_ratios) below 1: the row moved mostly as a wrong answer.
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"CE": "config/lowres_ce.py", "margin 0.6": "config/lowres_margin_0.6.py"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--max_iters", type=int, default=300, help="steps of each run")
    parser.add_argument("--out_dir", default="out/demo", help="where the two runs go")
    parser.add_argument("--rows", type=int, default=8, help="how many of the rarest rows to print")
    args, train_args = parser.parse_known_args(argv)
    keys = [f"--max_iters={args.max_iters}", f"--lr_decay_iters={args.max_iters}",
            "--eval_interval=100", "--eval_iters=20", "--final_eval=False",
            "--log_marginalization=True", "--num_threads=1", "--overwrite=True", *train_args]
    os.makedirs(os.path.join(REPO, args.out_dir), exist_ok=True)
    runs = {}
    for name, config in RUNS.items():
        out = os.path.join(REPO, args.out_dir, name.replace(" ", "_"))
        log = open(out + ".log", "w")  # its progress bars
        runs[name] = out, subprocess.Popen(
            [sys.executable, "train.py", config, f"--out_dir={out}", *keys],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    print(f"training {', '.join(RUNS)} for {args.max_iters} steps each, at once "
          f"(logs: {args.out_dir}/*.log)")
    reports = []
    for name, (out, run) in runs.items():
        if run.wait():
            with open(out + ".log") as f:
                sys.exit(f"the {name} run failed:\n" + f.read()[-2000:])
        with open(os.path.join(out, "marginalization.json")) as f:
            reports.append(json.load(f))
    print(f"Ratio of Average of the {args.rows} rarest low-resource rows after "
          f"{args.max_iters} steps (< 1: moved mostly as a wrong answer)\n")
    cells = lambda values, spec=">11": " ".join(f"{v:{spec}}" for v in values)  # noqa: E731
    print(f"{'token':>6} {'in text':>7} " + cells(RUNS))
    rarest = [report["tokens_rarest_first"] for report in reports]
    for i, row in enumerate(rarest[0][:args.rows]):
        ratios = [rows[i]["ratio_of_average"] for rows in rarest]
        print(f"{row['char']!r:>6} {row['train_count']:>7} " + cells(ratios, ">11.3f"))
    means = [report["mean_ratio_of_average"] for report in reports]
    print(f"\n{'all rows':>14} " + cells(means, ">11.3f") + "   (mean)")
    below = [report["n_ratio_of_average_below_1"] for report in reports]
    print(f"{'rows < 1':>14} " + cells(below))


if __name__ == "__main__":
    main()
