"""
A lecture's demo of Stop Jostling (Turumtaev 2024): cross-entropy pushes a rare token's embedding
away from every context where it is a wrong answer; thresholding at margin 0.6 stops most of that
push. It trains the low-resource toy twice for a few hundred steps, CE and margin 0.6, side by
side, and prints each run's gradient parts of the rarest low-resource rows:

    python -m tools.demo                        # 300 steps each, the two runs at once
    python -m tools.demo --max_iters 600 --data_source=/path/to/input.txt

Ratio of Average = avg(input + target part) / avg(non-target part) of a row over the steps
(metrics.marginalization_ratios): below 1, the row is moved mostly by being a wrong answer.
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
    keys = [f"--max_iters={args.max_iters}", f"--lr_decay_iters={args.max_iters}", "--eval_interval=100",
            "--eval_iters=20", "--final_eval=False", "--log_marginalization=True", "--num_threads=1",
            "--overwrite=True", *train_args]
    outs = {name: os.path.join(REPO, args.out_dir, name.replace(" ", "_")) for name in RUNS}
    os.makedirs(os.path.join(REPO, args.out_dir), exist_ok=True)
    logs = {name: open(out + ".log", "w") for name, out in outs.items()}  # their progress bars
    runs = {name: subprocess.Popen([sys.executable, "train.py", config, f"--out_dir={outs[name]}", *keys],
                                   cwd=REPO, stdout=logs[name], stderr=subprocess.STDOUT)
            for name, config in RUNS.items()}
    print(f"training {', '.join(RUNS)} for {args.max_iters} steps each, at once (logs: {args.out_dir}/*.log)")
    for name, run in runs.items():
        if run.wait():
            logs[name].close()
            with open(outs[name] + ".log") as f:
                sys.exit(f"the {name} run failed:\n" + f.read()[-2000:])
    reports = {}
    for name, out in outs.items():
        with open(os.path.join(out, "marginalization.json")) as f:
            reports[name] = json.load(f)
    print(f"Ratio of Average of the {args.rows} rarest low-resource rows after {args.max_iters} steps "
          "(< 1: moved mostly as a wrong answer)\n")
    print(f"{'token':>6} {'in text':>7} " + " ".join(f"{name:>11}" for name in RUNS))
    for i, row in enumerate(reports["CE"]["tokens_rarest_first"][:args.rows]):
        ratios = [reports[name]["tokens_rarest_first"][i]["ratio_of_average"] for name in RUNS]
        print(f"{row['char']!r:>6} {row['train_count']:>7} " + " ".join(f"{r:>11.3f}" for r in ratios))
    print(f"\n{'all rows':>14} " + " ".join(f"{reports[n]['mean_ratio_of_average']:>11.3f}" for n in RUNS)
          + "   (mean)")
    print(f"{'rows < 1':>14} " + " ".join(f"{reports[n]['n_ratio_of_average_below_1']:>11}" for n in RUNS))


if __name__ == "__main__":
    main()
