# The dispersion loss (angular) on the BPE toy (methods/dispersion.py).
include = ["bpe_baseline.py", "methods/dispersion.py"]
out_dir = "out/bpe_dispersion"
