# SimReg and dispersion together (CE + 3.54 SimReg + 0.1 dispersion).
include = "lowres_baseline.py"
simreg_weight = 3.54
dispersion_weight = 0.1
out_dir = "out/lowres_simreg_dispersion"
