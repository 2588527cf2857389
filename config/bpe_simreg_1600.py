# SimReg on the BPE toy at 1600 steps (bpe_baseline_1600.py, methods/simreg.py).
include = ["bpe_baseline_1600.py", "methods/simreg.py"]
out_dir = "out/bpe_simreg_1600"
