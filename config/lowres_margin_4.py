# Stop Jostling logit thresholding, margin 4: logits below z[target] - 4 are removed from training CE (the paper's Sec. 3.1, Algorithm 1).
include = "lowres_baseline.py"
margin = 4
out_dir = "out/lowres_margin_4"
