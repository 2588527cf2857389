# Chunk-wise SimReg on the BPE toy (methods/simreg_chunk.py).
include = ["bpe_baseline.py", "methods/simreg_chunk.py"]
out_dir = "out/bpe_simreg_chunk"
