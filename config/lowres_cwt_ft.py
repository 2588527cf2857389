# CWT second stage (headless LM paper, Sec. 4.2 and App. B.3): a new untied LM head, a copy of the headless model's input
# embedding, fine-tuned with cross-entropy only. The paper's recipe scaled to the toy: 2 % of the
# pre-training tokens (8000 x 12 x 64 x 0.02 = 640 steps at batch 3, 4x smaller), linear warm-up
# over the first 20 % then constant, weight decay 0, lr 1e-4 (1/10 of the toy's peak; the paper's
# 1e-5 is 1/10-1/30 of its pre-training peak). Run after lowres_cwt.py.
include = "lowres_baseline.py"
init_from = "out/lowres_cwt/best.pt"
head_from_embedding = True
tie_weights = False
ce_weight = 1.0
cwt_weight = 0.0
batch_size = 3
max_iters = 640
warmup_iters = 128
lr_schedule = "constant"
learning_rate = 1e-4
weight_decay = 0.0
eval_interval = 40
out_dir = "out/lowres_cwt_ft"
