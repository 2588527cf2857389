# Chunk-wise SimReg: 32-token chunks, half the sequence (the paper: 1024 of 2048 at scale).
include = "lowres_baseline.py"
simreg_weight = 3.54
simreg_tau = 0.01
simreg_chunk_size = 32
out_dir = "out/lowres_simreg_chunk"
