# Stop Jostling's simulated low-resource experiment, baseline (the paper's Sec. 4.1 and App. D, Table 4):
# a 0.8M-parameter char GPT (4 x 128, sequences of 64, batch 12) with weight tying, 2 % of training windows
# in the low-resource language, AdamW (0.9, 0.99) at 1e-3 with cosine decay to 1e-4 over 8000 steps.
# Those are train.py's defaults, so this file only names the run; every lowres_*.py builds on it.
out_dir = "out/lowres_baseline"
