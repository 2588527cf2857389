# The comparison grids' CE baseline: lowres_baseline.py, recording Stop Jostling's per-row gradient parts every
# step (Sec. 4.2: how strongly the low-resource tokens' rows are pushed away; writes marginalization.json).
include = "lowres_baseline.py"
log_marginalization = True
out_dir = "out/lowres_ce"
