# Margin 0.6 + separated embeddings, Stop Jostling's best run (methods/margin_0.6_se.py).
include = ["lowres_baseline.py", "methods/margin_0.6_se.py"]
out_dir = "out/lowres_margin_0.6_se"
