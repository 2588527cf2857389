# SimReg and dispersion together on the BPE toy (methods/simreg_dispersion.py).
include = ["bpe_baseline.py", "methods/simreg_dispersion.py"]
out_dir = "out/bpe_simreg_dispersion"
