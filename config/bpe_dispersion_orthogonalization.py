# The dispersion loss, orthogonalization variant on the BPE toy (methods/dispersion_orthogonalization.py).
include = ["bpe_baseline.py", "methods/dispersion_orthogonalization.py"]
out_dir = "out/bpe_dispersion_orthogonalization"
