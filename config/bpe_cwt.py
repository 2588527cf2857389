# Headless CWT on the BPE toy (methods/cwt.py): with a 50304-token vocabulary this is the setting CWT was made
# for (at V = 130 it is not). Fine-tune a head with bpe_cwt_ft.py.
include = ["bpe_baseline.py", "methods/cwt.py"]
out_dir = "out/bpe_cwt"
