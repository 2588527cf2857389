"""
Generate text from a checkpoint written by train.py:

    python sample.py out/lowres_baseline/best.pt --start "ROMEO:" --lang low

In the low-resource experiment every character exists twice, as an HR
id and as its LR twin (id + vocab). `--lang` picks the language of the
prompt; the model may switch language mid-sample, so the output reports
how many generated characters were LR. A checkpoint trained on GPT-2 BPE
data (prepare_c4.py) is decoded with tiktoken.
"""

import argparse

import torch

from checkpoint import load_model
from errors import UserError, run_script
from utils import check_arguments, choose_device


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arg = parser.add_argument
    arg("checkpoint")
    arg("--start", default="\n", help="prompt text")
    arg("--lang", choices=("high", "low"), default="high",
        help="language of the prompt: the high-resource one or its "
             "low-resource copy")
    arg("--num_samples", type=int, default=1)
    arg("--max_new_tokens", type=int, default=300)
    arg("--temperature", type=float, default=0.8)
    arg("--top_k", type=int, default=None)
    arg("--seed", type=int, default=1337)
    arg("--device", default="auto")
    args = parser.parse_args(argv)
    check_arguments(  # before the checkpoint is read: one line each
        (args.num_samples < 1,
         f"--num_samples must be >= 1, got {args.num_samples}"),
        (args.max_new_tokens < 1,
         f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"),
        (not 0 < args.temperature < float("inf"),
         f"--temperature must be a finite number > 0 (lower: closer to "
         f"the most likely token), got {args.temperature}"),
        (args.top_k is not None and args.top_k < 1,
         f"--top_k must be >= 1, got {args.top_k}"),
        (args.start == "",
         "--start must not be empty (the default is a newline)"))

    try:
        device = choose_device(args.device)
        model, checkpoint = load_model(args.checkpoint, device)
    except ValueError as e:
        raise UserError(str(e)) from None
    meta = checkpoint["meta"]
    shift = 0
    if meta.get("tokenizer", "char") != "char":  # BPE data (prepare_c4.py)
        import tiktoken
        enc = tiktoken.get_encoding(meta["tokenizer"])
        start = "<|endoftext|>" if args.start == "\n" else args.start
        ids = enc.encode(start, allowed_special={"<|endoftext|>"})

        def decode(ids):  # the padding up to vocab_size prints as nothing
            return enc.decode([i for i in ids if i < enc.n_vocab])
    else:
        itos = meta["itos"]
        stoi = {ch: i for i, ch in enumerate(itos)}
        missing = sorted(set(args.start) - set(stoi))
        if missing:
            raise UserError(f"--start contains characters not in the "
                            f"vocabulary of {args.checkpoint}: {missing}")
        if checkpoint["config"]["low_resource"]:
            shift = len(itos)
        ids = [stoi[ch] for ch in args.start]

        def decode(ids):  # both languages print as the same characters
            return "".join(itos[i % len(itos)] for i in ids)
    if args.lang == "low" and not shift:
        raise UserError(
            "--lang low needs a checkpoint trained with low_resource=True")
    offset = shift if args.lang == "low" else 0
    prompt = torch.tensor([ids], device=device) + offset
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for _ in range(args.num_samples):
        out = model.generate(prompt, args.max_new_tokens, args.temperature,
                             args.top_k, generator)[0].tolist()
        print(decode(out))
        new = out[len(ids):]
        lr = sum(i >= shift for i in new)
        print(f"--- {lr} of {len(new)} generated characters are LR"
              if shift else "---")


if __name__ == "__main__":
    run_script(main)
