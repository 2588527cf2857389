"""tools/plot_run.py: the figure of a real tiny run draws exactly log.jsonl's values (read back
from the matplotlib Figure's lines), the PNG is written whole, and a missing, empty or damaged log
is one error line."""

import os
import subprocess
import sys

import pytest

from errors import UserError
from test_train import REPO, read_log, train
from tools import plot_run

PNG = b"\x89PNG\r\n\x1a\n"
SPEED = ("ms_per_iter", "tokens_per_s", "mfu")  # the log's keys that are not drawn


@pytest.fixture(scope="module")
def run_with_terms(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("plot") / "run"
    train(str(out), data_dir, "--simreg_weight=1.0", "--dispersion_weight=0.1", "--final_eval=False")
    return str(out)


def test_every_line_is_a_log_key_with_its_values(run_with_terms):
    pytest.importorskip("matplotlib")
    records = read_log(run_with_terms)
    fig = plot_run.draw(plot_run.read_log(os.path.join(run_with_terms, "log.jsonl")))
    drawn = {}
    for ax in (ax for ax in fig.axes if ax.get_visible()):  # the grid's unused cells are hidden
        drawn[ax.get_title()] = [line.get_label() for line in ax.get_lines()]
        for line in ax.get_lines():
            key = line.get_label()
            expected = [(r["iter"], r[key]) for r in records if key in r]
            assert list(zip(line.get_xdata(), line.get_ydata())) == expected, key
    assert drawn == {"loss": ["loss", "val_high", "val_low", "val"], "ce": ["ce"],
                     "simreg": ["simreg", "val_simreg"], "dispersion": ["dispersion", "val_dispersion"],
                     "LR rows and their HR twins": ["twin_cos", "twin_top3"], "learning rate": ["lr"]}
    every_key = {key for r in records for key in r} - {"iter", *SPEED}
    assert {key for keys in drawn.values() for key in keys} == every_key


def test_cli_writes_the_png_whole(run_with_terms, tmp_path):
    pytest.importorskip("matplotlib")
    assert plot_run.main([run_with_terms]) == os.path.join(run_with_terms, "log.png")
    other = tmp_path / "figures" / "run.png"
    plot_run.main([run_with_terms, "--out", str(other)])
    for path in (os.path.join(run_with_terms, "log.png"), other):
        with open(path, "rb") as f:
            assert f.read(8) == PNG
    assert not [name for name in os.listdir(run_with_terms) if name.endswith(".tmp")]
    assert os.listdir(tmp_path / "figures") == ["run.png"]


@pytest.mark.slow
def test_bad_logs_are_one_error_line(tmp_path):
    pytest.importorskip("matplotlib")
    result = subprocess.run([sys.executable, "-m", "tools.plot_run", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: cannot read {tmp_path / 'log.jsonl'}: No such file or directory (is {tmp_path} a train.py out_dir?)"]
    log = tmp_path / "log.jsonl"
    for text, message in (("", "holds no records yet"),
                          ('{"iter": 0, "val": 1.', "holds no records yet"),  # only a torn line
                          ('{"it\n{"iter": 0}\n', "line 1 of .* is not JSON"),
                          ('[1, 2]\n', "line 1 of .* is not a train.py record")):
        log.write_text(text)
        with pytest.raises(UserError, match=message):
            plot_run.main([str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]  # no figure of a bad log


def test_without_matplotlib_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails, as when not installed
    with pytest.raises(UserError, match=r"^tools.plot_run needs matplotlib \(pip install matplotlib\)$"):
        plot_run.main([str(tmp_path)])
