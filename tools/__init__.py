"""
Experiment tooling, kept apart from the teaching core at the top level (model, losses, train, ...):
the comparison grids (grids.py, runner.py, report.py, claims.py, stats.py, figures.py, with
compare.py as their command line), the loss benchmarks (bench.py), the memory estimates of the
paper-scale configs (memory.py) and one run's curves (plot_run.py). Run them as modules from the repository root, e.g.
`python -m tools.compare lowres --table_only` or `python -m tools.bench --section toy`.
"""
