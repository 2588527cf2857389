"""
One run's log.jsonl as one figure, to look at a run while it trains or after:

    python -m tools.plot_run out/lowres_baseline                # writes out/lowres_baseline/log.png
    python -m tools.plot_run out/lowres_baseline --out run.png

Its panels, each line labelled with its log.jsonl key: docs/tracking.md. Needs matplotlib.
"""

import argparse
import os

from errors import UserError, run_script
from tools.figures import _panels, _pyplot, _save
from utils import check_writable, read_log

# a training record's keys that are not loss terms; speed is not drawn
NOT_TERMS = ("iter", "loss", "lr", "ms_per_iter", "tokens_per_s", "mfu", "loss_scale")
TWINS = ("twin_cos", "twin_top3")  # the embedding's measures, one panel


def panels(records):
    """{panel title: [log key, ...]}: which keys are drawn together, in drawing order."""
    keys = list(dict.fromkeys(key for record in records for key in record))

    def logged(*names):
        return [key for key in keys if key in names]
    terms = [key for key in keys if key not in NOT_TERMS + TWINS and not key.startswith("val")]
    val = [key for key in keys if key.startswith("val") and key[4:] not in terms]
    grouped = {"loss": logged("loss") + val,
               **{term: [term] + logged(f"val_{term}") for term in terms},
               "LR rows and their HR twins": logged(*TWINS),
               "learning rate": logged("lr")}
    return {title: names for title, names in grouped.items() if names}


def draw(records, title=""):
    """The matplotlib Figure; None without matplotlib or panels."""
    grouped = panels(records)
    fig, axes = _panels(len(grouped), 3.8, 2.6)
    if fig is None:
        return None
    for ax, (panel, keys) in zip(axes, grouped.items()):
        for key in keys:
            iters = [record["iter"] for record in records if key in record]
            values = [record[key] for record in records if key in record]
            marker = "o" if key.startswith("val") else None  # one point per evaluation
            ax.plot(iters, values, label=key, lw=1.0, marker=marker, ms=3)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("out_dir", help="a train.py out_dir (its log.jsonl is read)")
    parser.add_argument("--out", help="the PNG to write (default: OUT_DIR/log.png)")
    args = parser.parse_args(argv)
    if _pyplot() is None:
        raise UserError("tools.plot_run needs matplotlib (pip install matplotlib)")
    records = read_log(os.path.join(args.out_dir, "log.jsonl"))  # a LogError goes to the caller
    path = args.out or os.path.join(args.out_dir, "log.png")
    check_writable(path, "--out" if args.out else "the figure")
    _save(draw(records, title=os.path.normpath(args.out_dir)), path)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    run_script(main)
