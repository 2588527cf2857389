# CE-only baseline of the SimReg paper's moe_8x1b model (App. A.1, Tables 4-5) on C4.
include = "llama_c4.py"
out_dir = "out/baseline_moe_8x1b"
n_layer = 24
n_head = 32
n_embd = 2048
ffn_hidden = 5632
n_expert = 8
top_k = 2
moe_aux_weight = 0.02     # Mixtral-8x7B's router load-balancing coefficient
global_batch_size = 512      # sequences of 2048 per optimizer step
batch_size = 1              # per process and micro-step: raise it as far as memory allows
learning_rate = 3e-4
min_lr = 3e-4 / 10
max_iters = 50000
lr_decay_iters = 50000
parallel = "fsdp"             # FSDP2: 7.3B parameters in all (2.3B active), sharded over the GPUs
grad_clip_mode = "adagc"      # AdaGC (SimReg paper, App. A.1, Table 5; optim.AdaGC), global clipping at 1.0 for 100 steps first (our default)
