# NITP (SPEC section 4): a SwiGLU head (C -> 4C -> C) on the final normed state predicts block 1's output (~20 % of 4 layers) at the next position; lambda 1.0.
import os
exec(open(os.path.join(os.path.dirname(__file__), "lowres_baseline.py")).read())
nitp_weight = 1.0
nitp_layer = 1
out_dir = "out/lowres_nitp"
