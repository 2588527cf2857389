# Monolingual reference: the same model trained only on low-resource windows for 2 % of the steps (Stop Jostling, Sec. 4.1).
include = "lowres_baseline.py"
low_resource_prob = 1.0
max_iters = 160
lr_decay_iters = 160
warmup_iters = 2
eval_interval = 20
out_dir = "out/lowres_monolingual"
