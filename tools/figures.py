"""
Figures of a grid's runs: each function takes plain data (lists, numpy
arrays) and a path and writes one PNG atomically, or returns None
without matplotlib (an optional extra). tools/grid_figures.py draws a
grid's with them. Notes: docs/grids.md.
"""

import numpy as np

from utils import atomic_write


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path):
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    _pyplot().close(fig)
    return path


def method_colours(methods):
    """{method: its colour}, the same in every figure of a grid."""
    plt = _pyplot()
    palette = ([plt.get_cmap("tab10")(i) for i in range(10)]
               + [plt.get_cmap("Dark2")(i) for i in range(8)])
    return {m: palette[i % len(palette)] for i, m in enumerate(methods)}


def _panels(n_panels, width, height, ncols=3):
    """(figure, its first n_panels axes) on a grid of ncols columns;
    (None, []) without matplotlib or panels."""
    plt = _pyplot()
    if plt is None or not n_panels:
        return None, []
    ncols = min(ncols, n_panels)
    nrows = (n_panels + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False,
                             layout="constrained")
    flat = list(axes.flat)
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def _titled(ax, title, axis="both"):
    ax.set_title(title, fontsize=8)
    ax.tick_params(axis=axis, labelsize=7)
    ax.grid(axis=axis, alpha=0.3)


def forest_plot(panels, path, baseline="baseline", colours=None):
    """panels: {metric: [(method, mean, low, high, n), ...]} -> one panel per metric, a
    horizontal interval per method, and the zero line (no difference to the baseline)."""
    methods = list(dict.fromkeys(m for rows in panels.values() for m, *_ in rows))
    fig, axes = _panels(len(panels), 3.6, 0.32 * len(methods) + 1.2)
    if fig is None:
        return None
    colours = colours or method_colours(methods)
    for k, (ax, (metric, rows)) in enumerate(zip(axes, panels.items())):
        for method, mean, low, high, _ in rows:
            y = methods.index(method)
            if low is not None:
                ax.plot([low, high], [y, y], color=colours[method], lw=2)
            ax.plot([mean], [y], "o", color=colours[method], ms=4)
        ax.axvline(0, color="k", lw=0.8)
        labels = methods if k % 3 == 0 else [""] * len(methods)
        ax.set_yticks(range(len(methods)), labels, fontsize=7)
        ax.invert_yaxis()
        _titled(ax, f"{metric}, method − {baseline}", axis="x")
    return _save(fig, path)


def strip_plot(panels, path, references=None, colours=None):
    """panels: {metric: {method: [value per seed]}}; references: {metric: (label, value)} drawn
    as a dashed line (e.g. the paper's single run). A short bar marks each method's mean."""
    methods = list(dict.fromkeys(m for per_method in panels.values() for m in per_method))
    fig, axes = _panels(len(panels), max(4.0, 0.55 * len(methods) + 1.0), 3.4, ncols=2)
    if fig is None:
        return None
    colours = colours or method_colours(methods)
    jitter = np.random.default_rng(0)
    for ax, (metric, per_method) in zip(axes, panels.items()):
        for x, method in enumerate(methods):
            values = np.asarray(per_method.get(method, []), dtype=float)
            if values.size == 0:
                continue
            ax.scatter(x + jitter.uniform(-0.15, 0.15, values.size), values, s=14,
                       color=colours[method], zorder=2)
            ax.plot([x - 0.3, x + 0.3], [values.mean()] * 2, color="k", lw=1.2, zorder=3)
        if references and metric in references:
            label, value = references[metric]
            ax.axhline(value, color="0.3", ls="--", lw=0.9, label=label)
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(methods)), methods, rotation=40, ha="right", fontsize=7)
        ax.set_title(f"{metric}: one point per seed, bar = mean", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def val_loss_differences(differences, path, baseline="baseline", ylabel="val loss", colours=None):
    """differences: {method: (steps, [per-seed differences to the baseline at those steps])} ->
    small multiples, one per method: the mean difference and the band of -+ 2 standard errors."""
    fig, axes = _panels(len(differences), 3.2, 2.4, ncols=4)
    if fig is None:
        return None
    colours = colours or method_colours(differences)
    for ax, (method, (steps, per_seed)) in zip(axes, differences.items()):
        d = np.asarray(per_seed, dtype=float)
        mean = d.mean(axis=0)
        se = d.std(axis=0, ddof=1) / np.sqrt(len(d)) if len(d) > 1 else np.zeros_like(mean)
        ax.fill_between(steps, mean - 2 * se, mean + 2 * se, color=colours[method],
                        alpha=0.25, lw=0)
        ax.plot(steps, mean, color=colours[method], lw=1.2)
        ax.axhline(0, color="k", lw=0.7)
        _titled(ax, f"{method} ({len(d)} seeds)")
    axes[0].set_ylabel(f"{ylabel}, method − {baseline}", fontsize=7)
    return _save(fig, path)


def seed_curves(curves, path, ylabel, colours=None):
    """curves: {method: {seed: (steps, values)}} -> one panel per method, one line per seed, on
    a shared y axis (its top skips the first tenth of each curve)."""
    fig, axes = _panels(len(curves), 3.6, 2.6)
    if fig is None:
        return None
    colours = colours or method_colours(curves)
    low = min(min(v) for per_seed in curves.values() for _, v in per_seed.values())
    high = max(max(v[len(v) // 10:]) for per_seed in curves.values() for _, v in per_seed.values())
    for ax, (method, per_seed) in zip(axes, curves.items()):
        for steps, values in per_seed.values():
            ax.plot(steps, values, color=colours[method], lw=0.8, alpha=0.8)
        ax.set_ylim(low - 0.02 * (high - low), high)
        _titled(ax, f"{method} ({len(per_seed)} seeds)")
    axes[0].set_ylabel(ylabel, fontsize=7)
    return _save(fig, path)


def marked_curves(panels, path, ylabel):
    """panels: {title: {label: (steps, values, marked)}} -> one panel each, one line per run,
    the marked runs in red (on top) and labelled, the rest grey."""
    fig, axes = _panels(len(panels), 4.0, 2.8)
    if fig is None:
        return None
    for ax, (title, runs) in zip(axes, panels.items()):
        for label, (steps, values, marked) in sorted(runs.items(), key=lambda item: item[1][2]):
            ax.plot(steps, values, color="tab:red" if marked else "0.6", lw=1.0 if marked else 0.7,
                    label=label if marked else None, zorder=3 if marked else 2)
        if any(marked for *_, marked in runs.values()):
            ax.legend(fontsize=6)
        _titled(ax, f"{title} ({len(runs)} runs)")
    axes[0].set_ylabel(ylabel, fontsize=7)
    return _save(fig, path)


def condensation_heatmaps(histograms, path):
    """histograms: {method: (depths, bins) fractions of pairwise cosines in equal bins over
    [-1, 1]} -> per method, depth x cosine (the dispersion paper's picture of condensation)."""
    fig, axes = _panels(len(histograms), 4.0, 3.0, ncols=4)
    if fig is None:
        return None
    for k, (ax, (method, hist)) in enumerate(zip(axes, histograms.items())):
        hist = np.asarray(hist)
        image = ax.imshow(hist, aspect="auto", origin="lower",
                          extent=(-1, 1, -0.5, hist.shape[0] - 0.5), cmap="magma")
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("pairwise cosine")
        if k % 4 == 0:
            ax.set_ylabel("depth (0 = embedding)")
        label = "fraction of pairs" if k % 4 == 3 else None
        fig.colorbar(image, ax=ax, fraction=0.046, label=label)
    return _save(fig, path)


def letter_order(itos, shift):
    """Row ids of the letters, HR first then LR, each as A a B b ... (twins line up)."""
    letters = sorted((ch for ch in itos if ch.isalpha()), key=lambda ch: (ch.lower(), ch.islower()))
    ids = [itos.index(ch) for ch in letters]
    return ids + [i + shift for i in ids], letters


def _embedding_panels(embeddings, itos):
    """(figure, [(axis, method, float64 rows)], *letter_order), a panel
    per method in one row; the figure is None without matplotlib."""
    fig, axes = _panels(len(embeddings), 5, 4.6, ncols=len(embeddings))
    panels = [(ax, method, np.asarray(E, dtype=np.float64))
              for ax, (method, E) in zip(axes, embeddings.items())]
    return fig, panels, *letter_order(itos, len(itos))


def embedding_similarity(embeddings, itos, path):
    """embeddings: {method: (V, C) array with V = 2 * len(itos) (HR rows, then LR rows)} ->
    the cosine of every pair of rows, letters sorted, HR block then LR
    (Stop Jostling Fig. 5)."""
    fig, panels, order, letters = _embedding_panels(embeddings, itos)
    if fig is None:
        return None
    n = len(letters)
    for ax, method, W in panels:
        W = W[order]
        W = W / np.linalg.norm(W, axis=1, keepdims=True)
        image = ax.imshow(W @ W.T, cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_title(method, fontsize=9)
        ax.set_xticks([n / 2, 3 * n / 2], ["HR letters", "LR letters"])
        ax.set_yticks([n / 2, 3 * n / 2], ["HR", "LR"])
        ax.axhline(n - 0.5, color="k", lw=0.5)
        ax.axvline(n - 0.5, color="k", lw=0.5)
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(fig, path)


def embedding_pca(embeddings, itos, path):
    """Every letter's HR and LR row on the first two principal components
    of all rows, joined (Stop Jostling Fig. 6)."""
    fig, panels, order, letters = _embedding_panels(embeddings, itos)
    if fig is None:
        return None
    n = len(letters)
    for ax, method, W in panels:
        centred = W - W.mean(axis=0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        xy = centred[order] @ vt[:2].T
        for i in range(n):
            ax.plot([xy[i, 0], xy[n + i, 0]], [xy[i, 1], xy[n + i, 1]], color="0.75", lw=0.6,
                    zorder=1)
        ax.scatter(xy[:n, 0], xy[:n, 1], s=12, label="HR", zorder=2)
        ax.scatter(xy[n:, 0], xy[n:, 1], s=12, label="LR", zorder=2)
        for i, ch in enumerate(letters):
            ax.annotate(ch, xy[i], fontsize=6)
        ax.set_title(method, fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, path)
