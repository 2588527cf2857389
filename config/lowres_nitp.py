# NITP on the char experiment (methods/nitp.py).
include = ["lowres_baseline.py", "methods/nitp.py"]
out_dir = "out/lowres_nitp"
