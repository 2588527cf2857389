# Monolingual reference: the same model trained only on low-resource windows for 2 % of the steps (Stop Jostling, Sec. 4.1).
import os
exec(open(os.path.join(os.path.dirname(__file__), "lowres_baseline.py")).read())
low_resource_prob = 1.0
max_iters = 160
lr_decay_iters = 160
warmup_iters = 2
eval_interval = 20
out_dir = "out/lowres_monolingual"
