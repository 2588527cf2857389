# CE-only baseline of the SimReg paper's 1b3 model (App. A.1, Tables 4-5) on C4.
include = "llama_c4.py"
out_dir = "out/baseline_1b3"
n_layer = 24
n_head = 32
n_embd = 2048
ffn_hidden = 5461
global_batch_size = 2048      # sequences of 2048 per optimizer step
learning_rate = 3e-4
min_lr = 3e-4 / 10
parallel = "fsdp"             # FSDP2: weights, gradients and AdamW state (16 B per parameter) sharded over the GPUs
fsdp_keep_gathered = True     # gather each block once per optimizer step, not twice per micro-step (--dry_run: the bytes)
