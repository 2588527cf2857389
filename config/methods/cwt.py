# Headless CWT (headless LM paper, Sec. 3.2): no LM head; each final state must pick the input embedding of its
# next token among those at every position of the batch. A second stage (cwt_ft.py) fine-tunes a head.
ce_weight = 0.0
cwt_weight = 1.0
