# Stop Jostling logit thresholding, margin 2: logits below z[target] - 2 are removed from training CE (the paper's
# Sec. 3.1, Algorithm 1). The paper's Table 7 measures marginalization for this margin, so this run records it too.
include = "lowres_baseline.py"
margin = 2
log_marginalization = True
out_dir = "out/lowres_margin_2"
