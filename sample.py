"""
Generate text from a checkpoint written by train.py:

    python sample.py out/lowres_baseline/best.pt --start "ROMEO:" --lang lr --temperature 0.8

In the low-resource experiment every character exists twice, as an HR id and as its LR twin (id +
vocab). `--lang` picks the language of the prompt; the model may switch language mid-sample, so
the output reports how many generated characters were LR. Both languages print as the same
characters. A checkpoint trained on GPT-2 BPE data (prepare_c4.py) is decoded with tiktoken.
"""

import argparse

import torch

from evaluate import load_model
from errors import UserError, end_with
from utils import check_arguments, choose_device


def sample_bpe(model, meta, args, device):
    """GPT-2 BPE checkpoints: ids past the tokenizer's vocabulary (the padding up to vocab_size)
    never occur in the data; should the model sample one anyway, it prints as nothing."""
    import tiktoken
    enc = tiktoken.get_encoding(meta["tokenizer"])
    if args.lang == "low":
        raise UserError("--lang low needs a checkpoint trained with low_resource=True")
    start = args.start if args.start != "\n" else "<|endoftext|>"
    prompt = torch.tensor([enc.encode(start, allowed_special={"<|endoftext|>"})], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for _ in range(args.num_samples):
        ids = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, generator)[0].tolist()
        print(enc.decode([i for i in ids if i < enc.n_vocab]))
        print("---")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--start", default="\n", help="prompt text")
    parser.add_argument("--lang", choices=("high", "low"), default="high",
                        help="language of the prompt: the high-resource one or its low-resource copy")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    check_arguments(  # before the checkpoint is read: one line, the usage error's status
        (args.num_samples < 1, f"--num_samples must be >= 1, got {args.num_samples}"),
        (args.max_new_tokens < 1, f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"),
        (not 0 < args.temperature < float("inf"),
         f"--temperature must be a finite number > 0 (lower: closer to the most likely token), "
         f"got {args.temperature}"),
        (args.top_k is not None and args.top_k < 1, f"--top_k must be >= 1, got {args.top_k}"),
        (args.start == "", "--start must not be empty (the default is a newline)"))

    try:
        device = choose_device(args.device)
        model, checkpoint = load_model(args.checkpoint, device)  # a CheckpointError goes to the caller
    except ValueError as e:
        raise UserError(str(e)) from None
    meta = checkpoint["meta"]
    if meta.get("tokenizer", "char") != "char":  # BPE data (prepare_c4.py): tiktoken encodes and decodes
        return sample_bpe(model, meta, args, device)
    itos = meta["itos"]
    stoi = {ch: i for i, ch in enumerate(itos)}
    missing = sorted(set(args.start) - set(stoi))
    if missing:
        raise UserError(f"--start contains characters not in the vocabulary of {args.checkpoint}: {missing}")
    shift = len(itos) if checkpoint["config"]["low_resource"] else 0
    if args.lang == "low" and not shift:
        raise UserError("--lang low needs a checkpoint trained with low_resource=True")
    offset = shift if args.lang == "low" else 0
    prompt = torch.tensor([[stoi[ch] + offset for ch in args.start]], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for _ in range(args.num_samples):
        ids = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, generator)[0].tolist()
        new = ids[len(args.start):]
        print("".join(itos[i % len(itos)] for i in ids))
        if shift:
            print(f"--- {sum(i >= shift for i in new)} of {len(new)} generated characters are LR")
        else:
            print("---")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # the one place a problem the user can fix ends the process
        end_with(e)
