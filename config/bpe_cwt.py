# CWT's first stage on the BPE toy (headless LM paper, Sec. 3.2): headless, no LM head is computed. With a
# 50304-token vocabulary this is the setting CWT was made for (at V = 130 it is not).
include = "bpe_baseline.py"
ce_weight = 0.0
cwt_weight = 1.0
out_dir = "out/bpe_cwt"
