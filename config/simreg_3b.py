# SimReg (SimReg paper, Sec. 3, Eq. 3) on the 3b model: tau 0.01, lambda = 10 sqrt(d / 1024) = 17.32 (App. A.2), on the final normed state.
import os
exec(open(os.path.join(os.path.dirname(__file__), "baseline_3b.py")).read())
out_dir = "out/simreg_3b"
simreg_weight = 17.32
simreg_tau = 0.01
