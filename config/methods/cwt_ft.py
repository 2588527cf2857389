# CWT's second stage (headless LM paper, Sec. 4.2 and App. B.3): a new untied LM head, a copy of the headless
# model's input embedding, trained with cross-entropy only, linear warm-up then a constant lr, no weight decay.
# An experiment's *_cwt_ft.py scales the rest of the recipe to its toy: 2 % of the pre-training tokens at a
# batch 4x smaller, warm-up over the first 20 % of steps, lr 1/10 of the pre-training peak.
head_from_embedding = True
tie_weights = False
ce_weight = 1.0
cwt_weight = 0.0
lr_schedule = "constant"
weight_decay = 0.0
