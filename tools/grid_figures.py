"""
The figures of a grid's archived runs, drawn by tools/compare.py after
tools/report.py has written the grid's page. Notes: docs/grids.md.
"""

import operator
import os

import numpy as np

from tools import claims, figures, preregistered, stats, transition
from tools.grid_runs import Grid
from tools.grids import PAPER_SE_LR_ACCURACY, SEEDS

# the grids with a twin figure: the transition's, and issue 40's T3 and T5
TWIN_FIGURES = {"jostling": transition, "jostling_prereg": preregistered,
                "jostling_swap": preregistered}
SUMMARY = operator.itemgetter("mean", "low", "high", "n")


def make_figures(grid, root, out_dir):
    """Draw the grid's figures into out_dir/figures (needs matplotlib);
    returns [(title, path relative to out_dir)] of those written."""
    if figures._pyplot() is None:
        return []
    g = Grid(grid, root)
    results = g.results
    if not results:
        return []
    methods = [m for m in g.methods if m in results]
    baseline = methods[0]
    colours = figures.method_colours(list(g.methods))
    written = []

    def png(name):
        return os.path.join(out_dir, "figures", f"{grid}_{name}.png")

    def add(title, path):
        if path:
            written.append((title, os.path.relpath(path, out_dir)))

    forest = {}
    for title, lang, key in g.paired_columns():
        baseline_mean = np.mean([r[lang][key] for r in results[baseline].values()])
        relative = "ppl" in key and baseline_mean > 100
        kind = "relative" if relative else "difference"
        changes = [(m, g.paired(m, lang, key, kind, baseline)) for m in methods[1:]]
        forest[f"{title} (%)" if relative else title] = [
            (m, *SUMMARY(stats.paired(change))) for m, change in changes if change]
    add(f"Paired differences to {baseline} (same seeds), mean and 95 % t interval",
        figures.forest_plot(forest, png("forest"), baseline, colours))

    def per_seed(part, key):
        return {m: [r[part][key] for r in results[m].values()] for m in methods}
    references = None
    if g.low_resource:
        strips = {"LR accuracy": per_seed("low", "accuracy"),
                  "twin in top-3 (fraction of 130 rows)":
                      per_seed("translations", "twin_top3_fraction")}
        references = {"LR accuracy": ("paper, margin 0.6 + SE (1 run)", PAPER_SE_LR_ACCURACY)}
    else:
        strips = {"PPL": per_seed("val", "ppl"), "accuracy": per_seed("val", "accuracy")}
        if all("rare" in r for m in methods for r in results[m].values()):
            strips["rare-target MRR"] = per_seed("rare", "mrr")
    add("Every seed's value per method",
        figures.strip_plot(strips, png("seeds"), references, colours))

    differences = {}
    for method in methods[1:]:
        if isinstance(g.methods[method][0], tuple):  # chained: a log of its last stage
            continue
        rows = [[dict(claims.val_curve(g.runs[m][seed]["dir"])) for m in (method, baseline)]
                for seed in sorted(set(results[method]) & set(results[baseline]))]
        if not rows:
            continue
        steps = sorted(set.intersection(*(mine.keys() & theirs.keys() for mine, theirs in rows)))
        if steps:
            differences[method] = (steps, [[mine[s] - theirs[s] for s in steps]
                                           for mine, theirs in rows])
    add(f"Val loss minus {baseline}'s on the same seed (mean, ±2 standard errors); "
        "chained methods left out",
        figures.val_loss_differences(
            differences, png("val_loss"), baseline,
            "mixed HR/LR val loss" if g.low_resource else "val loss", colours))

    if g.low_resource:
        trio = (baseline, "margin 0.6", "margin 0.6 + SE")
        curves = {m: {seed: tuple(zip(*claims.val_curve(run["dir"], "val_low")))
                      for seed, run in g.runs[m].items()}
                  for m in methods if m in trio}
        add("LR val loss (20 batches, never thresholded) of every seed",
            figures.seed_curves(curves, png("lr_val_per_seed"), "LR val loss (nats)", colours))

    histograms = {}
    for method in methods:
        geometries = [r["geometry"][g.langs[0]] for r in results[method].values()
                      if r.get("geometry")]
        if geometries:
            histograms[method] = np.mean(
                [np.asarray(geo["cosine_histograms"]) for geo in geometries], axis=0)
    if histograms:
        split = "HR val" if g.low_resource else "val"
        add(f"Condensation: pairwise-cosine histogram per depth ({split}, mean over seeds)",
            figures.condensation_heatmaps(histograms, png("condensation")))

    embeddings = {}
    itos = None
    for method in [baseline, "margin 0.6 + SE"] if g.low_resource else []:
        first_seed = g.runs.get(method, {}).get(SEEDS[0], {})
        path = os.path.join(first_seed.get("dir", ""), "embedding.npz")
        if os.path.exists(path):
            with np.load(path) as data:
                embeddings[f"{method} (seed {SEEDS[0]})"] = data["wte"]
                itos = [str(c) for c in data["itos"]]
    if embeddings and all(len(E) == 2 * len(itos) for E in embeddings.values()):
        add("Embedding cosine similarity, letters sorted, HR then LR (Stop Jostling Fig. 5)",
            figures.embedding_similarity(embeddings, itos, png("embedding_similarity")))
        add("Embedding PCA, each letter joined to its twin (Stop Jostling Fig. 6)",
            figures.embedding_pca(embeddings, itos, png("embedding_pca")))
    if grid in TWIN_FIGURES:
        for title, path in TWIN_FIGURES[grid].twin_figure(g, out_dir):
            add(title, path)
    return written
