# The dispersion loss, orthogonalization variant on the char experiment (methods/dispersion_orthogonalization.py).
include = ["lowres_baseline.py", "methods/dispersion_orthogonalization.py"]
out_dir = "out/lowres_dispersion_orthogonalization"
