# The dispersion loss, decorrelation variant on the char experiment (methods/dispersion_decorrelation.py).
include = ["lowres_baseline.py", "methods/dispersion_decorrelation.py"]
out_dir = "out/lowres_dispersion_decorrelation"
