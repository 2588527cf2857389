# Chunk-wise SimReg on the char experiment (methods/simreg_chunk.py).
include = ["lowres_baseline.py", "methods/simreg_chunk.py"]
out_dir = "out/lowres_simreg_chunk"
