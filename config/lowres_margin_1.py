# Stop Jostling logit thresholding, margin 1: logits below z[target] - 1 are removed from training CE (the paper's Sec. 3.1, Algorithm 1).
include = "lowres_baseline.py"
margin = 1
out_dir = "out/lowres_margin_1"
