# Headless CWT on the char experiment (methods/cwt.py); fine-tune a head with lowres_cwt_ft.py.
include = ["lowres_baseline.py", "methods/cwt.py"]
out_dir = "out/lowres_cwt"
