# CE-only baseline of the SimReg paper's moe_8x1b model (App. A.1, Tables 4-5) on C4.
include = "llama_c4.py"
out_dir = "out/baseline_moe_8x1b"
n_layer = 24
n_head = 32
n_embd = 2048
ffn_hidden = 5632
n_expert = 8                 # 2 of them per token, router load-balancing weight 0.02 (train.py's defaults, Mixtral's)
moe_routing = "dropless"     # nothing dropped, as Mixtral, at the routed work: 2 experts' FLOPs a token (moe.py).
#                              The static path instead drops what exceeds capacity_factor: a toy MoE dropped 12 %, 3 %
#                              and 0 % of slots at 1.0, 1.25, 2.0 after 300 steps, up to 39 %, 33 %, 25 % early on
#                              (docs/performance.md); capacity N (0) drops nothing at 4x (8 / 2) the FLOPs
global_batch_size = 512      # sequences of 2048 per optimizer step
learning_rate = 3e-4
min_lr = 3e-4 / 10
max_iters = 50000
lr_decay_iters = 50000
parallel = "fsdp"             # FSDP2: 7.3B parameters in all (2.3B active), sharded over the GPUs
fsdp_keep_gathered = True     # gather each block once per optimizer step, not twice per micro-step (--dry_run: the bytes)
# on 64 H100s, --fsdp_shard_size=8 (shard within a node, replicate across) lets the routed compute (0.59 s a step)
# hide the communication: 0.21 s, where sharding over all 64 sends 0.86 s (--dry_run says so)
activation_checkpointing = True   # the experts' (routed tokens x 5632) activations: recompute them
