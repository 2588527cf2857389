# Chunk-wise SimReg on the BPE toy at 1600 steps (bpe_baseline_1600.py, methods/simreg_chunk.py).
include = ["bpe_baseline_1600.py", "methods/simreg_chunk.py"]
out_dir = "out/bpe_simreg_chunk_1600"
