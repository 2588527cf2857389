# Dispersion loss, orthogonalization variant (dispersion paper, Sec. 4.4, Table 1); lambda and tau as for angular (our choice).
include = "dispersion.py"
dispersion_variant = "orthogonalization"
