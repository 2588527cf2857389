# A laptop-sized LLaMA-style run on C4-format data: the scale-up recipe (llama_c4.py: RMSNorm, RoPE,
# SwiGLU, untied, GPT-2 BPE) cut to 4 x 128 and sequences of 128, minutes on 2 CPU cores.
# Real C4:      python prepare_c4.py --shards 1 --out_dir data/c4
# Without internet: python prepare_c4.py --from_text input.txt --out_dir data/c4_tiny (any plain text)
include = "llama_c4.py"
out_dir = "out/c4_tiny"
data_dir = "data/c4_tiny"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 8
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 100
max_iters = 1000
lr_decay_iters = 1000
grad_clip_mode = "norm"     # plain global-norm clipping: the toy needs no per-tensor AdaGC
eval_interval = 100
eval_iters = 10
final_eval = True            # val metrics of best.pt (streamed: the logits of 50304 tokens are never all held)
