# CE-only baseline of the SimReg paper's 3b model (App. A.1, Tables 4-5) on C4.
include = "llama_c4.py"
out_dir = "out/baseline_3b"
n_layer = 26
n_head = 32
n_embd = 3072
ffn_hidden = 8640
n_expert = 1
global_batch_size = 2048      # sequences of 2048 per optimizer step
batch_size = 1              # per process and micro-step: raise it as far as memory allows
learning_rate = 3e-4
min_lr = 3e-4 / 10
max_iters = 12500
lr_decay_iters = 12500
parallel = "fsdp"             # FSDP2: weights, gradients and AdamW state (16 B per parameter) sharded over the GPUs
grad_clip_mode = "adagc"      # AdaGC (SimReg paper, App. A.1, Table 5; optim.AdaGC), global clipping at 1.0 for 100 steps first (our default)
