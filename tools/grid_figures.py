"""
The figures of a grid's archived runs (tools/compare.py draws them after tools/report.py has
written the grid's table), drawn with tools/figures.py's functions from the runs as
tools/grid_runs.py reads them.
"""

import os

import numpy as np

from tools import claims, figures, preregistered, stats, transition
from tools.figures import (condensation_heatmaps, embedding_pca, embedding_similarity, forest_plot,
                           method_colours, seed_curves, strip_plot, val_loss_differences)
from tools.grid_runs import Grid, paired_columns
from tools.grids import PAPER_SE_LR_ACCURACY, SEEDS
from utils import read_log


def make_figures(grid, root, out_dir):
    """PNGs of a grid's archived runs under root into out_dir/figures (needs matplotlib):
    the forest plot of paired differences, per-seed strip plots, val-loss differences to the
    baseline, condensation of every method, and (char grids) the embedding of the baseline and
    margin 0.6 + SE. Returns [(title, path relative to out_dir)] of those written."""
    if figures._pyplot() is None:
        return []
    g = Grid(grid, root)
    results, runs, low_resource = g.results, g.runs, g.low_resource
    if not results:
        return []
    methods = [m for m in g.methods if m in results]
    baseline = methods[0]
    colours = method_colours(list(g.methods))
    written, base = [], os.path.join(out_dir, "figures")

    def add(title, path):
        if path:
            written.append((title, os.path.relpath(path, out_dir)))

    forest = {}
    for title, lang, key in paired_columns(results):
        # perplexities in the hundreds (BPE) vary by orders of magnitude across methods: relative changes
        relative = "ppl" in key and np.mean([r[lang][key] for r in results[baseline].values()]) > 100
        rows = []
        for method in methods[1:]:
            shared = sorted(set(results[method]) & set(results[baseline]))
            if shared:
                mine, theirs = ([results[m][s][lang][key] for s in shared] for m in (method, baseline))
                r = stats.paired([100 * (a / b - 1) if relative else a - b for a, b in zip(mine, theirs)])
                rows.append((method, r["mean"], r["low"], r["high"], r["n"]))
        forest[f"{title} (%)" if relative else title] = rows
    add(f"Paired differences to {baseline} (same seeds), mean and 95 % t interval", forest_plot(
        forest, os.path.join(base, f"{grid}_forest.png"), baseline, colours))

    def per_seed(get):
        return {m: [get(r) for r in results[m].values()] for m in methods}
    if low_resource:
        strips = {"LR accuracy": per_seed(lambda r: r["low"]["accuracy"]),
                  "twin in top-3 (fraction of 130 rows)":
                      per_seed(lambda r: r["translations"]["twin_top3_fraction"])}
        references = {"LR accuracy": ("paper, margin 0.6 + SE (1 run)", PAPER_SE_LR_ACCURACY)}
    else:
        strips = {"PPL": per_seed(lambda r: r["val"]["ppl"]),
                  "accuracy": per_seed(lambda r: r["val"]["accuracy"])}
        if all("rare" in r for m in methods for r in results[m].values()):
            strips["rare-target MRR"] = per_seed(lambda r: r["rare"]["mrr"])
        references = None
    add("Every seed's value per method", strip_plot(strips, os.path.join(base, f"{grid}_seeds.png"),
                                                            references, colours))

    differences = {}
    for method in methods[1:]:
        if isinstance(g.methods[method][0], tuple):
            continue  # a chained run's log holds its last stage (the fine-tune): not on the same axis
        steps, rows = None, []
        for seed in sorted(set(results[method]) & set(results[baseline])):
            mine, theirs = (dict(claims.val_curve(runs[m][seed]["dir"])) for m in (method, baseline))
            common = sorted(set(mine) & set(theirs))
            steps = common if steps is None else [s for s in steps if s in common]
            rows.append((mine, theirs))
        if steps:
            differences[method] = (steps, [[mine[s] - theirs[s] for s in steps] for mine, theirs in rows])
    add(f"Val loss minus {baseline}'s on the same seed (mean, ±2 standard errors); chained methods left out",
        val_loss_differences(differences, os.path.join(base, f"{grid}_val_loss.png"), baseline,
                                     "mixed HR/LR val loss" if low_resource else "val loss", colours))

    if low_resource:  # the LR val loss of every seed of the Stop Jostling trio: does any seed depart?
        trio = [m for m in methods if m in (baseline, "margin 0.6", "margin 0.6 + SE")]
        curves = {}
        for method in trio:
            for seed, run in runs[method].items():
                evals = [r for r in read_log(os.path.join(run["dir"], "log.jsonl")) if "val_low" in r]
                curves.setdefault(method, {})[seed] = ([r["iter"] for r in evals],
                                                       [r["val_low"] for r in evals])
        add("LR val loss (20 batches, never thresholded) of every seed", seed_curves(
            curves, os.path.join(base, f"{grid}_lr_val_per_seed.png"), "LR val loss (nats)", colours))

    histograms, split = {}, "val"
    for method in methods:
        geometries = [r["geometry"] for r in results[method].values() if r.get("geometry")]
        if geometries:
            split = "HR val" if "high" in geometries[0] else "val"  # the char grids: the HR language
            histograms[method] = np.mean([np.asarray(g.get("high", g.get("val"))["cosine_histograms"])
                                          for g in geometries], axis=0)
    if histograms:
        add(f"Condensation: pairwise-cosine histogram per depth ({split}, mean over seeds)",
            condensation_heatmaps(histograms, os.path.join(base, f"{grid}_condensation.png")))

    embeddings, itos = {}, None
    for method in [baseline, "margin 0.6 + SE"] if low_resource else []:
        # first seed
        path = os.path.join(runs.get(method, {}).get(SEEDS[0], {}).get("dir", ""), "embedding.npz")
        if os.path.exists(path):
            with np.load(path) as data:
                embeddings[f"{method} (seed {SEEDS[0]})"], itos = data["wte"], [str(c) for c in data["itos"]]
    if embeddings and all(len(E) == 2 * len(itos) for E in embeddings.values()):
        add("Embedding cosine similarity, letters sorted, HR then LR (Stop Jostling Fig. 5)",
            embedding_similarity(embeddings, itos,
                                         os.path.join(base, f"{grid}_embedding_similarity.png")))
        add("Embedding PCA, each letter joined to its twin (Stop Jostling Fig. 6)",
            embedding_pca(embeddings, itos, os.path.join(base, f"{grid}_embedding_pca.png")))
    if grid == "jostling":
        for title, path in transition.twin_figure(g, out_dir):
            add(title, path)
    # issue 40's runs (results/preregistration.md, T3 and T5)
    if grid in ("jostling_prereg", "jostling_swap"):
        for title, path in preregistered.twin_figure(g, out_dir):
            add(title, path)
    return written
