# Stop Jostling logit thresholding, margin 4: logits below z[target] - 4 are removed from training CE (the paper's Sec. 3.1, Algorithm 1).
import os
exec(open(os.path.join(os.path.dirname(__file__), "lowres_baseline.py")).read())
margin = 4
out_dir = "out/lowres_margin_4"
