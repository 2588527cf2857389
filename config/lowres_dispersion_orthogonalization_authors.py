# The dispersion loss (orthogonalization) in the form of the authors' released code (docs/fidelity.md), beside
# config/lowres_dispersion_orthogonalization.py, which follows the paper's Algorithm 1.
include = "lowres_dispersion_orthogonalization.py"
dispersion_form = "authors"
out_dir = "out/lowres_dispersion_orthogonalization_authors"
