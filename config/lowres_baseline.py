# Stop Jostling's simulated low-resource experiment, baseline (the paper's Sec. 4.1 and App. D, Table 4):
# 0.8M-parameter char GPT, weight tying, 2 % of training windows in the low-resource language.
out_dir = "out/lowres_baseline"
data_dir = "data/shakespeare_char"
low_resource = True
low_resource_prob = 0.02
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
dropout = 0.0
bias = False
tie_weights = True
batch_size = 12
learning_rate = 1e-3
min_lr = 1e-4
beta1 = 0.9
beta2 = 0.99
weight_decay = 0.1
grad_clip = 1.0
warmup_iters = 100
max_iters = 8000
lr_decay_iters = 8000
eval_interval = 250
eval_iters = 20
seed = 1337
