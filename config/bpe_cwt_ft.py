# CWT's second stage on the BPE toy (headless LM paper, Sec. 4.2 and App. B.3): a new untied LM head, a copy of the input
# embedding, trained with cross-entropy on 2 % of the pre-training tokens (400 x 8 x 128 -> 8192),
# a batch 4x smaller (2), warm-up over the first 20 % of steps, weight decay 0, lr 1/10 of the
# pre-training peak. compare.py passes the first stage's best.pt as init_from.
include = "bpe_baseline.py"
init_from = "out/bpe_cwt/best.pt"
head_from_embedding = True
tie_weights = False
ce_weight = 1.0
cwt_weight = 0.0
batch_size = 2
max_iters = 32
warmup_iters = 6
lr_schedule = "constant"
learning_rate = 2e-4
weight_decay = 0.0
eval_interval = 4
out_dir = "out/bpe_cwt_ft"
