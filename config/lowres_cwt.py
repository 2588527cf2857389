# Headless CWT (headless LM paper, Sec. 3.2 and 4.2): no LM head; each final state must pick the input embedding of its
# next token among those at every position of the batch. Fine-tune a head with lowres_cwt_ft.py.
include = "lowres_baseline.py"
ce_weight = 0.0
cwt_weight = 1.0
out_dir = "out/lowres_cwt"
