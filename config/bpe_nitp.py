# NITP on the BPE toy (methods/nitp.py).
include = ["bpe_baseline.py", "methods/nitp.py"]
out_dir = "out/bpe_nitp"
