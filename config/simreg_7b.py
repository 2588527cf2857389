# SimReg (SimReg paper, Sec. 3, Eq. 3) on the 7b model: tau 0.01, lambda = 10 sqrt(d / 1024) = 20.0 (App. A.2), on the final normed state.
include = "baseline_7b.py"
out_dir = "out/simreg_7b"
simreg_weight = 20.0
simreg_tau = 0.01
