# NITP (NITP paper, Method): a SwiGLU head (C -> 4C -> C; the paper says only "MLP", the form is ours) on the final
# normed state predicts block 1's output (~20 % of 4 layers, the paper's depth) at the next position; lambda 1.0 (the paper's).
nitp_weight = 1.0
nitp_layer = 1
