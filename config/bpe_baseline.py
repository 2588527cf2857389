# The second toy setting: tiny Shakespeare in GPT-2 BPE, the toy analogue of the papers'
# pre-training runs -- a 50304-token vocabulary (11,234 distinct tokens in the 302k training tokens,
# most of them rare) instead of 65 characters. The char experiment's 4 x 128 GPT-2-style model with a
# tied head (train.py's defaults) on sequences of 128, sized to train in minutes on one CPU core. No
# simulated low-resource language here.
#   python prepare_shakespeare.py --tokenizer gpt2     # -> data/shakespeare_gpt2
# (offline: --input input.txt, and TIKTOKEN_CACHE_DIR pointing at a cache that holds the GPT-2 ranks)
out_dir = "out/bpe_baseline"
data_dir = "data/shakespeare_gpt2"
low_resource = False
block_size = 128
batch_size = 8
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 40
max_iters = 400
lr_decay_iters = 400
eval_interval = 50
eval_iters = 10
