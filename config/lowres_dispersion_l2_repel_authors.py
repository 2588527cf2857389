# The dispersion loss (l2_repel) in the form of the authors' released code (docs/fidelity.md), beside
# config/lowres_dispersion_l2_repel.py, which follows the paper's Algorithm 1.
include = "lowres_dispersion_l2_repel.py"
dispersion_form = "authors"
out_dir = "out/lowres_dispersion_l2_repel_authors"
