# SimReg on the BPE toy (methods/simreg.py).
include = ["bpe_baseline.py", "methods/simreg.py"]
out_dir = "out/bpe_simreg"
