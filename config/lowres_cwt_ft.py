# CWT's second stage on the char experiment (methods/cwt_ft.py), scaled to the toy: 2 % of the pre-training
# tokens (8000 x 12 x 64 x 0.02 = 640 steps at batch 3), warm-up over the first 128 steps, lr 1e-4 (1/10 of the
# toy's peak; the paper's 1e-5 is 1/10-1/30 of its pre-training peak). Run after lowres_cwt.py.
include = ["lowres_baseline.py", "methods/cwt_ft.py"]
init_from = "out/lowres_cwt/best.pt"
batch_size = 3
max_iters = 640
warmup_iters = 128
learning_rate = 1e-4
eval_interval = 40
out_dir = "out/lowres_cwt_ft"
