"""
Experiment tooling, kept apart from the teaching core at the top level (model, losses, train, ...):
the comparison grids (grids.py, runner.py, report.py, claims.py, stats.py, figures.py, with
compare.py as their command line), the loss benchmarks (bench.py: bench_losses.py, bench_systems.py),
the GPU check (gpu_check.py: gpu_steps.py, gpu_correctness.py, gpu_measurements.py), the memory
estimates of the paper-scale configs (memory.py), one run's curves (plot_run.py), and the export of
a checkpoint to Hugging Face format (export_hf.py, hf_tokenizer.py) with an offline
lm-evaluation-harness task (lm_eval_task.py; docs/export.md). Run them as modules from the repository
root, e.g. `python -m tools.compare lowres --table_only` or `python -m tools.bench --section toy`.
"""
