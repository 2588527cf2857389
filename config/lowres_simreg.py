# SimReg on the char experiment (methods/simreg.py).
include = ["lowres_baseline.py", "methods/simreg.py"]
out_dir = "out/lowres_simreg"
