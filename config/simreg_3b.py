# SimReg (SimReg paper, Sec. 3, Eq. 3) on the 3b model: tau 0.01, lambda = 10 sqrt(d / 1024) = 17.32 (App. A.2), on the final normed state.
include = "baseline_3b.py"
out_dir = "out/simreg_3b"
simreg_weight = 17.32
simreg_tau = 0.01
