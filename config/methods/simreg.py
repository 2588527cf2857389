# SimReg (SimReg paper, Sec. 3, Eq. 3) on the final normed states, tau 0.01 (train.py's default), lambda =
# 10 * sqrt(128 / 1024) = 3.54: the paper's rule of thumb (App. A.2) extrapolated below C = 1024 to both toys' width 128.
simreg_weight = 3.54
