# The dispersion loss, l2_repel variant on the char experiment (methods/dispersion_l2_repel.py).
include = ["lowres_baseline.py", "methods/dispersion_l2_repel.py"]
out_dir = "out/lowres_dispersion_l2_repel"
