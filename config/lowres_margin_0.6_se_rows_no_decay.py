# Margin 0.6 + separated embeddings with the embedding rows NOT weight-decayed: one candidate
# reason the authors' SE run reached LR accuracy .487. Their rows (Stop Jostling, App. C, Listing 2)
# are 1-D nn.Parameters, and nanoGPT's optimizer rule decays only tensors of 2 or more dimensions.
include = "lowres_margin_0.6_se.py"
embedding_weight_decay = 0.0
out_dir = "out/lowres_margin_0.6_se_rows_no_decay"
