# The authors' "separated embeddings" as it actually runs in PyTorch (SPEC section 1): one
# nn.Parameter per row, torch.stack-ed, so every row gets a (zero) gradient and plain AdamW still
# steps it -- the optimizer behaves as without SE. What does differ from the baseline is the rows'
# init: torch.randn, std 1 (the model's default is 0.02). This config reproduces that setup with
# plain AdamW; add --separate_embeddings=True for the intended SE with the same init.
import os
exec(open(os.path.join(os.path.dirname(__file__), "lowres_baseline.py")).read())
margin = 0.6
embedding_init_std = 1.0
out_dir = "out/lowres_margin0.6_se_authors"
