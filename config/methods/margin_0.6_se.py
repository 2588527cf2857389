# Stop Jostling's best run: logit thresholding at margin 0.6 (Sec. 3.1, Algorithm 1) + separated embeddings
# as Sec. 4.5's text describes them: rows without gradient in a step are not stepped by AdamW (the
# released Listing 2 steps every row, as one table would: docs/fidelity.md).
margin = 0.6
separate_embeddings = True
