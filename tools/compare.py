"""
Run a named grid of methods x seeds (tools/grids.py) and write its results table, e.g.

    python -m tools.compare jostling               # the Stop Jostling reproduction (its Sec. 4)
    python -m tools.compare lowres                 # every loss on the char experiment
    python -m tools.compare bpe                    # every loss on the GPT-2 BPE toy
    python -m tools.compare jostling --table_only  # only rebuild results/jostling.md from finished runs

Each run is `python train.py <config> --seed=S --out_dir=<root>/<grid>/<method>/seed<S>`. When it
finishes, its small files (metrics.json, marginalization.json, run.json and a thinned log.jsonl)
are copied to results/runs/<grid>/<method>/seed<S>, which is committed: the tables are built from
there, and a run found there (or finished in <root>) is skipped, so an interrupted grid resumes
where it stopped, in this checkout or a fresh one. Ctrl-C (or `kill`) stops a call cleanly.
tools/runner.py runs the grid, tools/report.py writes results/<grid>.md and its figures.
"""

import argparse
import os
import signal

from configurator import TRAIN_RULES, ConfigError, check_values, exit_config_error, parse_config, train_defaults
from tools.grids import GRIDS, runs_of, stages
from tools.report import build_table, make_figures
from tools.runner import run_grid, sync_archive
from utils import exit_on_bad_arguments, exit_unless_writable, save_text


def check_overrides(grid, overrides):
    """Every run's train.py arguments (its config files, its own and the grid's overrides) as train.py
    would read them, before any run starts: a misspelt key is one line (exit 2), not the first run's
    failure an hour in."""
    defaults = train_defaults()
    for _, seed, config, args, _ in runs_of(grid, "."):
        for config_file in stages(config):
            try:
                check_values(parse_config([config_file, f"--seed={seed}", *args, *overrides], defaults), TRAIN_RULES)
            except ConfigError as e:
                exit_config_error(e)


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
    exit_on_bad_arguments((args.workers < 1, f"--workers must be >= 1 (runs at a time), got {args.workers}"))
    if not args.table_only:
        check_overrides(args.grid, overrides)
    for name in ("results", "archive") if args.table_only else ("results", "archive", "root"):
        exit_unless_writable(getattr(args, name), f"--{name}", directory=True)  # before hours of runs
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
