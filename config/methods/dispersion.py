# Dispersion loss (dispersion paper, Sec. 4.4, Eq. 2): the angular variant over every block's output, lambda 0.1
# and tau 1.0 (the paper's defaults, Sec. 5.3; tau, variant and layers are train.py's defaults).
dispersion_weight = 0.1
