# Dispersion loss, l2_repel variant (dispersion paper, Sec. 4.4, Table 1), every block, lambda 0.1 and tau 1.0 as for angular (our choice).
include = "lowres_baseline.py"
dispersion_weight = 0.1
dispersion_tau = 1.0
dispersion_variant = "l2_repel"
out_dir = "out/lowres_dispersion_l2_repel"
