# SimReg (SimReg paper, Sec. 3, Eq. 3) on the final normed states, tau 0.01, lambda = 10 * sqrt(128 / 1024) = 3.54
# (the paper's rule of thumb, App. A.2, extrapolated below C = 1024).
include = "lowres_baseline.py"
simreg_weight = 3.54
simreg_tau = 0.01
out_dir = "out/lowres_simreg"
