"""figures.py: each figure function writes a PNG when matplotlib is installed, and every one of
them returns None (writing nothing) when it is not."""

import os
import sys

import numpy as np
import pytest

from tools import figures  # noqa: E402

ITOS = list("\n !,.ABCabc")
PNG = b"\x89PNG\r\n\x1a\n"


def calls(tmp_path):
    rng = np.random.default_rng(0)
    E = {"CE": rng.normal(size=(2 * len(ITOS), 8)), "margin": rng.normal(size=(2 * len(ITOS), 8))}
    hist = rng.random((5, 40))
    return [
        (figures.val_loss_differences, ({"SimReg": ([0, 250, 500], [[0.0, -0.1, -0.1], [0.0, -0.05, -0.12]]),
                                         "NITP": ([0, 250, 500], [[0.0, 0.02, 0.01]])}, str(tmp_path / "val.png"))),
        (figures.forest_plot, ({"LR acc": [("SimReg", 0.01, -0.01, 0.03, 5), ("NITP", 0.0, None, None, 1)],
                                "HR PPL": [("SimReg", -0.05, -0.09, -0.01, 5)]}, str(tmp_path / "forest.png"))),
        (figures.seed_curves, ({"CE": {1: ([0, 250, 500], [4.0, 2.5, 2.0]), 2: ([0, 250, 500], [4.1, 2.6, 2.2])}},
                               str(tmp_path / "per_seed.png"), "LR val loss")),
        (figures.strip_plot, ({"LR accuracy": {"CE": [0.30, 0.31, 0.29], "SE": [0.37, 0.49]}},
                              str(tmp_path / "seeds.png"), {"LR accuracy": ("paper", 0.487)})),
        (figures.condensation_heatmaps, ({"CE": hist, "dispersion": hist / 2}, str(tmp_path / "cond.png"))),
        (figures.embedding_similarity, (E, ITOS, str(tmp_path / "sim.png"))),
        (figures.embedding_pca, (E, ITOS, str(tmp_path / "pca.png"))),
    ]


def test_each_figure_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    for function, args in calls(tmp_path):
        path = function(*args)
        assert path == next(a for a in args if isinstance(a, str) and a.endswith(".png"))
        with open(path, "rb") as f:
            assert f.read(8) == PNG, function.__name__
    # no temp files left
    assert sorted(os.listdir(tmp_path)) == ["cond.png", "forest.png", "pca.png", "per_seed.png", "seeds.png", "sim.png", "val.png"]


def test_without_matplotlib_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    for function, args in calls(tmp_path):
        assert function(*args) is None
    assert os.listdir(tmp_path) == []


def test_letters_line_up_with_their_twins():
    order, letters = figures.letter_order(ITOS, len(ITOS))
    assert letters == list("AaBbCc")
    assert order[len(letters):] == [i + len(ITOS) for i in order[:len(letters)]]
