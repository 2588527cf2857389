# CE-only baseline of the SimReg paper's 350m model (App. A.1, Tables 4-5) on C4.
include = "llama_c4.py"
out_dir = "out/baseline_350m"
n_layer = 24
n_head = 16
n_embd = 1024
ffn_hidden = 2371          # as printed in the SimReg paper's Table 4; 8/3 d = 2731 may be meant (we keep the printed value)
n_expert = 1
global_batch_size = 512      # sequences of 2048 per optimizer step
batch_size = 1              # per process and micro-step: raise it as far as memory allows
learning_rate = 4e-4
min_lr = 4e-4 / 10
max_iters = 12500
lr_decay_iters = 12500
parallel = "ddp"              # 0.38B x 16 B = 6 GB of weights, gradients and AdamW state fit on every GPU: DDP, no all-gathers
grad_clip_mode = "adagc"      # AdaGC (SimReg paper, App. A.1, Table 5; optim.AdaGC), global clipping at 1.0 for 100 steps first (our default)
