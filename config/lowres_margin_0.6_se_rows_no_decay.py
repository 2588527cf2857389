# Margin 0.6 + separated embeddings with the embedding rows NOT weight-decayed. Built as a candidate
# reason for the authors' SE run (LR accuracy .487), on the reading that their 1-D rows (Stop Jostling,
# App. C, Listing 2) escape nanoGPT's decay rule; their SE model decays them explicitly, so this row
# measures weight decay on the rows under SE, not anything the authors ran (docs/fidelity.md).
include = "lowres_margin_0.6_se.py"
embedding_weight_decay = 0.0
out_dir = "out/lowres_margin_0.6_se_rows_no_decay"
