# Stop Jostling's best run: logit thresholding at margin 0.6 (Sec. 3.1, Algorithm 1) + separated embeddings
# (Sec. 3.2): embedding rows without gradient in a step are not stepped by AdamW.
margin = 0.6
separate_embeddings = True
