# The dispersion loss, l2_repel variant on the BPE toy (methods/dispersion_l2_repel.py).
include = ["bpe_baseline.py", "methods/dispersion_l2_repel.py"]
out_dir = "out/bpe_dispersion_l2_repel"
