# The dispersion loss, decorrelation variant on the BPE toy (methods/dispersion_decorrelation.py).
include = ["bpe_baseline.py", "methods/dispersion_decorrelation.py"]
out_dir = "out/bpe_dispersion_decorrelation"
