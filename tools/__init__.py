"""
Experiment tooling, kept apart from the teaching core at the top level
(model, losses, train, ...): the comparison grids, benchmarks, the GPU
check, the Hugging Face export and the studies' tools; each file's
docstring says what it does. Run them as modules from the repository
root, e.g. `python -m tools.compare lowres --table_only` or
`python -m tools.bench --section toy`.
"""
