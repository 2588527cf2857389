# SimReg (SimReg paper, Sec. 3, Eq. 3) on the 350m model: tau 0.01, lambda = 10 sqrt(d / 1024) = 10.0 (App. A.2), on the final normed state.
include = "baseline_350m.py"
out_dir = "out/simreg_350m"
simreg_weight = 10.0
simreg_tau = 0.01
