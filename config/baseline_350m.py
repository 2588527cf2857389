# CE-only baseline of the SimReg paper's 350m model (App. A.1, Tables 4-5) on C4.
include = "llama_c4.py"
out_dir = "out/baseline_350m"
n_layer = 24
n_head = 16
n_embd = 1024
ffn_hidden = 2371          # as printed in the SimReg paper's Table 4; 8/3 d = 2731 may be meant (we keep the printed value)
global_batch_size = 512      # sequences of 2048 per optimizer step
learning_rate = 4e-4
min_lr = 4e-4 / 10
parallel = "ddp"              # 0.38B x 16 B = 6 GB of weights, gradients and AdamW state fit on every GPU: DDP, no all-gathers
