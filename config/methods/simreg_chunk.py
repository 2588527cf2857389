# Chunk-wise SimReg (SimReg paper, Sec. 3 and Sec. 5.4): the similarity matrix over chunks of 32 positions
# instead of whole sequences (at scale the paper uses chunks of 1024 of 2048).
include = "simreg.py"
simreg_chunk_size = 32
