# Margin 0.6 + separated embeddings on the BPE toy (methods/margin_0.6_se.py).
include = ["bpe_baseline.py", "methods/margin_0.6_se.py"]
out_dir = "out/bpe_margin_0.6_se"
