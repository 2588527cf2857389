# SimReg (SimReg paper, Sec. 3, Eq. 3) on the moe_8x1b model: tau 0.01, lambda = 10 sqrt(d / 1024) = 14.14 (App. A.2), on the final normed state.
include = "baseline_moe_8x1b.py"
out_dir = "out/simreg_moe_8x1b"
simreg_weight = 14.14
simreg_tau = 0.01
