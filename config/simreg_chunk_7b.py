# Chunk-wise SimReg on the 7B model: each sequence's 2048 states in chunks of 1024 (SimReg paper, Sec. 3 and Sec. 5.4).
include = "simreg_7b.py"
out_dir = "out/simreg_chunk_7b"
simreg_chunk_size = 1024
