# SimReg (SimReg paper, Sec. 3, Eq. 3) on the 1b3 model: tau 0.01, lambda = 10 sqrt(d / 1024) = 14.14 (App. A.2), on the final normed state.
include = "baseline_1b3.py"
out_dir = "out/simreg_1b3"
simreg_weight = 14.14
simreg_tau = 0.01
