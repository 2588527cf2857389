# The dispersion loss (angular) on the char experiment (methods/dispersion.py).
include = ["lowres_baseline.py", "methods/dispersion.py"]
out_dir = "out/lowres_dispersion"
