# CWT's second stage on the BPE toy (methods/cwt_ft.py), scaled to the toy: 2 % of the pre-training tokens
# (400 x 8 x 128 x 0.02 -> 32 steps at batch 2), warm-up over the first 6 steps, lr 2e-4 (1/10 of the toy's peak).
# Run after bpe_cwt.py (tools/compare.py passes that stage's best.pt as init_from).
include = ["bpe_baseline.py", "methods/cwt_ft.py"]
init_from = "out/bpe_cwt/best.pt"
batch_size = 2
max_iters = 32
warmup_iters = 6
learning_rate = 2e-4
eval_interval = 4
out_dir = "out/bpe_cwt_ft"
