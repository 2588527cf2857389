# Issue 40's ablation: the released l2_repel (config/lowres_dispersion_l2_repel_authors.py) with its norm term
# 0.1 * mean(z^2) alone and no repulsion (losses.dispersion, variant "l2_repel_norm"; the same in both forms), to
# ask whether the released l2_repel's effect on the char experiment is its norm penalty.
include = "lowres_dispersion_l2_repel_authors.py"
dispersion_variant = "l2_repel_norm"
out_dir = "out/lowres_dispersion_l2_norm_authors"
