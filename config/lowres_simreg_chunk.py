# Chunk-wise SimReg: 32-token chunks, half the sequence (the paper: 1024 of 2048 at scale).
import os
exec(open(os.path.join(os.path.dirname(__file__), "lowres_baseline.py")).read())
simreg_weight = 3.54
simreg_tau = 0.01
simreg_chunk_size = 32
out_dir = "out/lowres_simreg_chunk"
