# Stop Jostling logit thresholding, margin 0.6: logits below z[target] - 0.6 are removed from training CE (the paper's Sec. 3.1, Algorithm 1).
include = "lowres_baseline.py"
margin = 0.6
out_dir = "out/lowres_margin_0.6"
