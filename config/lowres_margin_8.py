# Stop Jostling logit thresholding, margin 8: logits below z[target] - 8 are removed from training CE (the paper's Sec. 3.1, Algorithm 1).
include = "lowres_baseline.py"
margin = 8
out_dir = "out/lowres_margin_8"
