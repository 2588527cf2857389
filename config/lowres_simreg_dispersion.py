# SimReg and dispersion together on the char experiment (methods/simreg_dispersion.py).
include = ["lowres_baseline.py", "methods/simreg_dispersion.py"]
out_dir = "out/lowres_simreg_dispersion"
