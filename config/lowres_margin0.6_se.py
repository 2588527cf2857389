# Margin 0.6 + separated embeddings (the paper's best run): embedding rows without gradient are not stepped by AdamW.
include = "lowres_baseline.py"
margin = 0.6
separate_embeddings = True
out_dir = "out/lowres_margin0.6_se"
