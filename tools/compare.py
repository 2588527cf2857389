"""
Run a named grid of methods x seeds (tools/grids.py) and write its results table, e.g.

    python -m tools.compare jostling               # the Stop Jostling reproduction (its Sec. 4)
    python -m tools.compare jostling --table_only  # only rebuild results/jostling.md
    python -m tools.compare lowres --methods CE SimReg --seeds 1337 --archive out/short \\
        --max_iters=400

Each run trains in <root>/<grid>/<method>/seed<S>; its small files, which the
tables are built from, are archived in results/runs/<grid>/<method>/seed<S>.
How a call runs, resumes and refuses runs: docs/runs.md#a-grids-runs.
"""

import argparse
import os
import signal
import sys

from configurator import check_values, parse_config, train_defaults, train_rules
from errors import run_script
from tools import figures
from tools.grid_figures import make_figures
from tools.grids import GRIDS, runs_of
from tools.report import build_table
from tools.runner import (check_like, check_pooled_call, planned_commands, run_grid,
                          sync_archive)
from utils import check_arguments, check_writable, save_text

FIGURES = "\n## Figures\n"
NOT_REDRAWN = ("Not redrawn by the last call (matplotlib, an optional extra, is not "
               "installed): the figures of the call before.")


def check_overrides(grid, overrides):
    """Read every run's train.py arguments as train.py would, before any run starts: a
    misspelt key is a ConfigError (one line, exit 2), not a failure an hour in."""
    defaults = train_defaults()
    rules = train_rules()
    for _, seed, config, args, _ in runs_of(grid, "."):
        for cmd in planned_commands(config, seed, [*args, *overrides]):
            check_values(parse_config(cmd[2:], defaults), rules)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", choices=sorted(GRIDS))
    parser.add_argument("--root", default="out/compare",
                        help="where the runs go (checkpoints included)")
    parser.add_argument("--archive", default="results/runs",
                        help="where the finished runs' small files are kept")
    parser.add_argument("--results",
                        help="where <grid>.md is written (default: results, or the --archive "
                        "given)")
    parser.add_argument("--methods", nargs="+", help="train only these methods (and the baseline)")
    parser.add_argument("--seeds", nargs="+", type=int, help="train only these seeds")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time")
    parser.add_argument("--table_only", action="store_true", help="only rebuild the table")
    parser.add_argument("overrides", nargs="*",
                        help="--key=value passed to every run (e.g. --max_iters=50)")
    args, unknown = parser.parse_known_args(argv)
    overrides = args.overrides + unknown
    check_arguments((args.workers < 1,
                     f"--workers must be >= 1 (runs at a time), got {args.workers}"))
    only = selection(args.grid, args.methods, args.seeds)
    if args.results is None:
        default = args.archive == parser.get_default("archive")
        args.results = "results" if default else args.archive
    names = ("results", "archive") + (() if args.table_only else ("root",))
    if not args.table_only:
        check_overrides(args.grid, overrides)
    # before hours of runs: writable folders, like runs in the archive and the root
    for name in names:
        check_writable(getattr(args, name), f"--{name}", directory=True)
    for name in names[1:]:
        check_like(args.grid, getattr(args, name), overrides, only)
    if not args.table_only:
        check_pooled_call(args.grid, args.archive, only)  # what the table would pair
        # `kill` stops the grid as Ctrl-C does
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        run_grid(args.grid, args.root, args.workers, overrides, args.archive, only)
    sync_archive(args.grid, args.root, args.archive)
    check_like(args.grid, args.archive, overrides)  # again, on what the table reads
    table, _ = build_table(args.grid, args.archive)
    path = os.path.join(args.results, f"{args.grid}.md")
    drawn = make_figures(args.grid, args.archive, args.results)
    if drawn:
        links = [f"{title}:\n\n![{title}]({link})" for title, link in drawn]
        table += FIGURES + "\n" + "\n\n".join(links) + "\n"
    elif figures._pyplot() is None:
        table += kept_figures(path)
    save_text(table, path)
    print(table)
    print(f"wrote {path}")


def kept_figures(path):
    """A call without matplotlib's Figures section: the links of the page
    at path under NOT_REDRAWN, or why there are none."""
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if FIGURES not in old:
        return (FIGURES + "\nNone: matplotlib (an optional extra, requirements-extras.txt) is "
                "not installed.\n")
    kept = old.partition(FIGURES)[2].replace(NOT_REDRAWN + "\n\n", "")
    return FIGURES + "\n" + NOT_REDRAWN + "\n" + kept


def selection(grid, methods, seeds):
    """The (method, seed) pairs --methods and --seeds name (None: all), the baseline always
    among the methods; an unknown method, or a seed no chosen method uses, is a UsageError."""
    if methods is None and seeds is None:
        return None
    runs = {(method, seed) for method, seed, *_ in runs_of(grid, "")}
    known = sorted({method for method, _ in runs})
    unknown = [m for m in methods or () if m not in known]
    check_arguments((unknown, f"--methods: {', '.join(map(repr, unknown))} not in grid "
                              f"'{grid}' ({', '.join(map(repr, known))})"))
    chosen = {next(iter(GRIDS[grid])), *methods} if methods else set(known)
    only = {(m, s) for m, s in runs if m in chosen and (seeds is None or s in seeds)}
    unused = [s for s in seeds or () if s not in {seed for _, seed in only}]
    check_arguments((unused,
                     f"--seeds: {', '.join(map(str, unused))} not among the chosen methods' seeds"))
    return only


if __name__ == "__main__":
    try:
        run_script(main)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: run_grid printed what stopped
        sys.exit(130)
