# Stop Jostling logit thresholding, margin 2: logits below z[target] - 2 are removed from training CE (the paper's Sec. 3.1, Algorithm 1).
include = "lowres_baseline.py"
margin = 2
out_dir = "out/lowres_margin_2"
