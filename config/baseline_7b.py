# CE-only baseline of the SimReg paper's 7b model (App. A.1, Tables 4-5) on C4.
include = "llama_c4.py"
out_dir = "out/baseline_7b"
n_layer = 32
n_head = 32
n_embd = 4096
ffn_hidden = 11008
global_batch_size = 2048      # sequences of 2048 per optimizer step
learning_rate = 3e-4
min_lr = 3e-4 / 10
parallel = "fsdp"             # FSDP2: 6.9B x 16 B = 110 GB of weights, gradients and AdamW state, sharded over the GPUs
fsdp_keep_gathered = True     # gather each block once per optimizer step, not twice per micro-step (--dry_run: the bytes)
activation_checkpointing = True   # 32 blocks of 2048 x 4096 activations: recompute them so batch_size can grow
