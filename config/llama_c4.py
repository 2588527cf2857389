# The SimReg paper's pre-training recipe (Sec. 5 and App. A.1, Tables 4-5), shared by baseline_*.py and simreg_*.py:
# LLaMA blocks (RMSNorm, RoPE, SwiGLU, no biases, untied embeddings, init std 0.01) on C4 with GPT-2 BPE
# (our choice: the paper names no tokenizer),
# sequences of 2048, AdamW (0.9, 0.95), weight decay 0.1, 2000 warm-up steps, cosine to 10 % of the peak.
# Data: python prepare_c4.py --shards N (writes data/c4). A size config sets the width, batch, lr and steps.
data_dir = "data/c4"
low_resource = False
data_order = "epoch"        # every window of the training split once per epoch, in a seeded order (data.EpochWindows)
vocab_size = 50304          # GPT-2 BPE's 50257 padded to a multiple of 64
arch = "llama"
tie_weights = False
bias = False
dropout = 0.0
init_std = 0.01
rope_theta = 10000.0
ce_chunk_size = 4096        # LM head + CE 4096 positions at a time: no whole (B*T, 50304) float32 logits
block_size = 2048
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
warmup_iters = 2000
max_iters = 12500           # optimizer steps of global_batch_size x 2048 tokens (the MoE config sets its own)
lr_decay_iters = 12500
batch_size = "auto"         # sequences per process and micro-step: the most that fit the GPU (plan.py; a number to fix it)
grad_clip_mode = "adagc"    # AdaGC (App. A.1, Table 5; optim.AdaGC), global clipping at 1.0 for its first 100 steps
eval_interval = 500
checkpoint_interval = 100   # a full state between evaluations: a preempted 7B job loses at most 100 steps
eval_iters = 20
final_eval = False          # evaluate.py's full-vocabulary metrics are made for the char experiment
