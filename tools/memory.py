"""
How much GPU memory does each paper-scale config need? Prints a Markdown table:

    python -m tools.memory config/baseline_350m.py config/simreg_7b.py ... [--gpus 8] [--seq_len 2048]

Parameters, gradients and AdamW state follow from the parameter count (exact). Activations are
*measured*, not guessed: the model is built at the config's real width with 1 and 2 blocks, one
forward pass runs on the CPU at a short sequence with a hook that adds up every tensor autograd
saves for the backward pass (views of one tensor and the weights themselves counted once / not
at all). The 2-block minus the 1-block figure is one block; the rest is embedding, head and loss.
With flash-style attention (PyTorch SDPA) nothing grows with T^2, so the bytes per token scale
to the config's sequence length linearly. Measured in float32; bf16 autocast on GPU stores most
of them at half size, so the fp32 figure is an upper bound.

Activation checkpointing keeps only each block's input and recomputes one block at a time in the
backward pass: L x (B T C) + one block + the rest.
"""

import argparse
import os
import sys

import torch

from configurator import parse_config, train_defaults
from model import GPT, GPTConfig

GiB = 2 ** 30


def read_config(path):
    """The model and micro-batch of a train.py config file: train.py's defaults, then the file (its
    includes followed), checked by the same configurator as a run."""
    config = parse_config([path], train_defaults())
    fields = {k: config[k] for k in GPTConfig.__dataclass_fields__ if k in config}
    return GPTConfig(**fields), config["batch_size"]


def saved_activation_bytes(config, n_layer, batch_size, seq_len):
    """Bytes autograd keeps for backward after one forward + cross-entropy, on the CPU in fp32."""
    cfg = GPTConfig(**{**config.__dict__, "n_layer": n_layer, "block_size": seq_len})
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")  # sizes are all we need: leave the memory uninitialised...
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)  # ...but finite, so routing and softmax behave
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
    del loss, logits
    return total


def estimate(config, batch_size, seq_len, gpus, measure_len=64):
    """-> dict of GiB per GPU: params, grads, adam, activations (without / with checkpointing)."""
    one = saved_activation_bytes(config, 1, batch_size, measure_len)
    two = saved_activation_bytes(config, 2, batch_size, measure_len)
    scale = seq_len / measure_len
    block, rest = (two - one) * scale, (2 * one - two) * scale
    L = config.n_layer
    with torch.device("meta"):
        n_params = GPT(config).num_params()
    block_input = batch_size * seq_len * config.n_embd * 4
    return {"params": n_params,
            # FSDP shards fp32 master weights, gradients and AdamW's two moments over the GPUs
            "weights": 4 * n_params / gpus / GiB, "grads": 4 * n_params / gpus / GiB,
            "adam": 8 * n_params / gpus / GiB,
            "act": (rest + L * block) / GiB, "act_ckpt": (rest + L * block_input + block) / GiB,
            "block": block / GiB}


def table_lines(paths, gpus, seq_len=0, batch_size=0):
    """The Markdown table of estimate() for each config file (tools/bench.py puts it in results/bench.md)."""
    lines = [f"GiB per GPU, FSDP over {gpus} GPU(s); activations of one micro-batch, fp32 upper bound", "",
             "| config | params | micro-batch x T | weights + grads + AdamW (sharded) | activations | "
             "with activation checkpointing | one block |", "|---|---|---|---|---|---|---|"]
    for path in paths:
        config, config_batch = read_config(path)
        batch, T = batch_size or config_batch, seq_len or config.block_size
        e = estimate(config, batch, T, gpus)
        lines.append(f"| {os.path.basename(path)} | {e['params'] / 1e9:.2f}B | {batch} x {T} | "
                     f"{e['weights'] + e['grads'] + e['adam']:.1f} | {e['act']:.1f} | {e['act_ckpt']:.1f} | {e['block']:.2f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs the FSDP states are sharded over")
    parser.add_argument("--seq_len", type=int, default=0, help="0 = the config's block_size")
    parser.add_argument("--batch_size", type=int, default=0, help="micro-batch; 0 = the config's")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    missing = [path for path in args.configs if not os.path.exists(path)]
    if missing:
        sys.exit(f"error: no config file {missing[0]}")
    print("\n".join(table_lines(args.configs, args.gpus, args.seq_len, args.batch_size)))


if __name__ == "__main__":
    main()
