"""
How much the released l2_repel's repulsion pushes on a checkpoint's states (issue 40, T6).

What it measures per block, why, and what it found: results/README.md, T6.

    python -m tools.repulsion out/compare/lowres/<method>/seed1337/best.pt [more checkpoints]
"""

import argparse

import torch

import losses
from checkpoint import data_dir_of, load_model
from errors import run_script
from scoring import val_blocks
from utils import markdown_table

CLOSE = 10.0  # exp(-10) = 4.5e-5 still counts beside the diagonal's 1


def repulsion_to_norm(z):
    """|d repulsion / dz| / |d norm term / dz| of one layer's states z
    (B,T,C); the repulsion is the released l2_repel less its norm term."""
    z = z.detach().requires_grad_()
    full, = torch.autograd.grad(losses._dispersion_l2_repel(z, 1.0, "authors"), z)
    norm, = torch.autograd.grad(losses._dispersion_l2_repel_norm(z, 1.0, "authors"), z)
    return ((full - norm).norm() / norm.norm()).item()


def layer_rows(model, x):
    """The table's row of every block's output on the tokens x (B,T)."""
    with torch.no_grad():
        _, hidden_states = model(x, return_hidden_states=True)
    off_diagonal = ~torch.eye(x.size(1), dtype=torch.bool)
    rows = []
    for block, z in enumerate(hidden_states[1:model.config.n_layer + 1], 1):
        squared = torch.cdist(z.double(), z.double()).square()[:, off_diagonal]
        close = (squared < CLOSE).double().mean().item()
        rows.append((block, f"{squared.median().item():.0f}", f"{100 * close:.2f} %",
                     f"{repulsion_to_norm(z):.3g}"))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="best.pt or ckpt.pt files written by train.py")
    parser.add_argument("--blocks", type=int, default=96, help="val blocks (sequences) to read")
    parser.add_argument("--data_dir", help="default: the checkpoint's own data_dir")
    args = parser.parse_args(argv)
    for path in args.checkpoints:
        model, checkpoint = load_model(path)
        data_dir = data_dir_of(checkpoint, path, args.data_dir)
        x, _ = val_blocks(data_dir, model.config.block_size)
        print(f"{path} (first {min(args.blocks, len(x))} val blocks)\n")
        header = ["block", "median squared distance", "pairs closer than 10",
                  "repulsion / norm term (gradient)"]
        print("\n".join(markdown_table(header, layer_rows(model, x[:args.blocks]))) + "\n")


if __name__ == "__main__":
    run_script(main)
