# Dispersion loss (dispersion paper, Sec. 4.4, Eq. 2), angular variant over every block's output, lambda 0.1, tau 1.0 (the paper's defaults, Sec. 5.3).
include = "lowres_baseline.py"
dispersion_weight = 0.1
dispersion_tau = 1.0
dispersion_variant = "angular"
dispersion_layers = "all"
out_dir = "out/lowres_dispersion"
