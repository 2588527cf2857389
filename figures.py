"""
Figures of a grid's runs, so the geometry the papers talk about can be looked at, not only read
as numbers. matplotlib is an optional extra (`pip install matplotlib`): without it every
function here returns None and nothing else in the repo changes.

    val_loss_curves        validation loss against step, mean over seeds, one line per method
    condensation_heatmaps  per method, depth x pairwise-cosine histogram of the hidden states
                           (the dispersion paper's picture of condensation: mass moving to the
                           right with depth means the states of a sequence crowd together)
    embedding_similarity   cosine similarity of every pair of embedding rows, HR block then LR
                           block, each sorted by letter (Stop Jostling Fig. 5): twins show up as
                           the off-diagonal stripes
    embedding_pca          the rows projected on their first two principal components, every HR
                           letter joined to its LR twin (Stop Jostling Fig. 6)

compare.py calls make_figures() after writing a grid's table; each function takes plain data
(lists, numpy arrays) and a path, and writes one PNG atomically.
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


def _save(fig, plt, path):
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path


def val_loss_curves(curves, path, title="validation loss"):
    """curves: {method: [(steps, losses), ...] one pair of lists per seed} -> PNG of the mean."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, seeds in curves.items():
        n = min(len(s[0]) for s in seeds)  # runs of one method log the same steps
        steps = np.asarray(seeds[0][0][:n])
        mean = np.mean([np.asarray(s[1][:n]) for s in seeds], axis=0)
        ax.plot(steps, mean, label=f"{method} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})")
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (mixed HR/LR, nats)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def condensation_heatmaps(histograms, path):
    """histograms: {method: (depths, bins) fractions of pairwise cosines in equal bins over [-1, 1]}."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(histograms), figsize=(4.6 * len(histograms), 3.4), squeeze=False,
                             layout="constrained")
    for k, (ax, (method, hist)) in enumerate(zip(axes[0], histograms.items())):
        hist = np.asarray(hist)
        image = ax.imshow(hist, aspect="auto", origin="lower", extent=(-1, 1, -0.5, hist.shape[0] - 0.5), cmap="magma")
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("pairwise cosine")
        if k == 0:
            ax.set_ylabel("depth (0 = embedding)")
        fig.colorbar(image, ax=ax, fraction=0.046, label="fraction of pairs" if k == len(histograms) - 1 else None)
    return _save(fig, plt, path)


def letter_order(itos, shift):
    """Row ids of the letters, HR first then LR, each as A a B b ... (twins line up)."""
    letters = sorted((ch for ch in itos if ch.isalpha()), key=lambda ch: (ch.lower(), ch.islower()))
    ids = [itos.index(ch) for ch in letters]
    return ids + [i + shift for i in ids], letters


def embedding_similarity(embeddings, itos, path):
    """embeddings: {method: (V, C) array with V = 2 * len(itos) (HR rows, then LR rows)}."""
    plt = _pyplot()
    if plt is None:
        return None
    order, letters = letter_order(itos, len(itos))
    fig, axes = plt.subplots(1, len(embeddings), figsize=(5 * len(embeddings), 4.6), squeeze=False,
                             layout="constrained")
    for ax, (method, E) in zip(axes[0], embeddings.items()):
        W = np.asarray(E, dtype=np.float64)[order]
        W = W / np.linalg.norm(W, axis=1, keepdims=True)
        image = ax.imshow(W @ W.T, cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_title(method, fontsize=9)
        n = len(letters)
        ax.set_xticks([n / 2, 3 * n / 2], ["HR letters", "LR letters"])
        ax.set_yticks([n / 2, 3 * n / 2], ["HR", "LR"])
        ax.axhline(n - 0.5, color="k", lw=0.5)
        ax.axvline(n - 0.5, color="k", lw=0.5)
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(fig, plt, path)


def embedding_pca(embeddings, itos, path):
    """Every letter's HR and LR row on the first two principal components of all rows, joined."""
    plt = _pyplot()
    if plt is None:
        return None
    order, letters = letter_order(itos, len(itos))
    n = len(letters)
    fig, axes = plt.subplots(1, len(embeddings), figsize=(5 * len(embeddings), 4.6), squeeze=False,
                             layout="constrained")
    for ax, (method, E) in zip(axes[0], embeddings.items()):
        W = np.asarray(E, dtype=np.float64)
        centred = W - W.mean(axis=0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        xy = centred[order] @ vt[:2].T
        for i in range(n):
            ax.plot([xy[i, 0], xy[n + i, 0]], [xy[i, 1], xy[n + i, 1]], color="0.75", lw=0.6, zorder=1)
        ax.scatter(xy[:n, 0], xy[:n, 1], s=12, label="HR", zorder=2)
        ax.scatter(xy[n:, 0], xy[n:, 1], s=12, label="LR", zorder=2)
        for i, ch in enumerate(letters):
            ax.annotate(ch, xy[i], fontsize=6)
        ax.set_title(method, fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, plt, path)
