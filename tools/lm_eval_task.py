"""
A small lm-evaluation-harness task that runs offline, for models exported by tools/export_hf.py:
predict the last word of a line of a prepared dataset's validation split from the text before it
(LAMBADA-style: the context ends just before the word, the target is " word", punctuation after
it is not part of the target). Writes <name>.jsonl ({context, target} items) and <name>.yaml
(the task, pointing at the jsonl by absolute path) into --out:

    python -m tools.lm_eval_task --data_dir data/shakespeare_char --out lm_eval_tasks
    lm_eval --model hf --model_args pretrained=hf/lowres_baseline --include_path lm_eval_tasks \\
        --tasks shakespeare_lastword --device cpu

Its metrics (acc, perplexity) and what was measured: docs/export.md
"""

import argparse
import json
import os
import re

from data import DataError, gpt2_encoding, load_tokens, read_meta
from errors import UserError, run_script
from tools.hf_tokenizer import vocabulary
from utils import check_arguments, check_writable, save_text

# a line whose last word (letters, inner apostrophes) may be followed by punctuation and spaces
LAST_WORD = re.compile(r"^(.*\S)[ \t]+([A-Za-z]+(?:'[A-Za-z]+)*)[^A-Za-z0-9'\n]*$")

# lm-eval's --include_path task: a local json file, one test split, the item's fields as
# context and target (target_delimiter '' because the target brings its own space)
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: loglikelihood
test_split: test
doc_to_text: context
doc_to_target: target
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def validation_text(data_dir):
    """The val split of a prepared dataset, decoded back to text."""
    meta = read_meta(data_dir)
    ids = load_tokens(data_dir, "val", 1, meta["vocab_size"]).tolist()
    kind = vocabulary(meta)
    if kind is None:
        raise DataError(f"{os.path.join(data_dir, 'meta.json')}: neither 'itos' nor a "
                        "GPT-2 'tokenizer': cannot decode val.bin to text")
    if kind == "char":
        return "".join(meta["itos"][i] for i in ids)
    return gpt2_encoding().decode(ids)


def make_items(text, limit=500, context_chars=256, min_words=4):
    """[{context, target}]: an item per line of >= min_words words that
    ends in a word, the context the text up to that word (at most
    context_chars, cut at a line start); at most limit items, spread
    evenly over the text."""
    items = []
    offset = 0
    for line in text.split("\n"):
        match = LAST_WORD.match(line)
        if match and len(line.split()) >= min_words:
            end = offset + len(match.group(1))  # before the space and the word
            start = max(0, end - context_chars)
            newline = text.find("\n", start, end) if start else -1
            start = newline + 1 if newline >= 0 else start
            items.append({"context": text[start:end], "target": " " + match.group(2)})
        offset += len(line) + 1
    if len(items) > limit:
        items = [items[i * len(items) // limit] for i in range(limit)]
    return items


def write_task(data_dir, out, name="shakespeare_lastword", limit=500, context_chars=256,
               min_words=4):
    """Write <out>/<name>.jsonl and <out>/<name>.yaml; returns the items."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ValueError("--name must be letters, digits and underscores (a task name and "
                         f"file name), got {name!r}")
    items = make_items(validation_text(data_dir), limit, context_chars, min_words)
    if not items:
        raise DataError(f"the val split of {data_dir} has no line of >= {min_words} words "
                        "ending in a word")
    jsonl = os.path.join(out, f"{name}.jsonl")
    save_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), jsonl)
    yaml = TASK_YAML.format(name=name, path=json.dumps(os.path.abspath(jsonl)))
    save_text(yaml, os.path.join(out, f"{name}.yaml"))  # after the data it names
    return items


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True, help="a prepared dataset (meta.json, val.bin)")
    parser.add_argument("--out", required=True,
                        help="directory for the task files (lm_eval --include_path)")
    parser.add_argument("--name", default="shakespeare_lastword",
                        help="task name (lm_eval --tasks)")
    parser.add_argument("--limit", type=int, default=500,
                        help="at most this many items, spread over the split")
    parser.add_argument("--context_chars", type=int, default=256,
                        help="characters of context at most")
    parser.add_argument("--min_words", type=int, default=4,
                        help="lines with fewer words are not used")
    args = parser.parse_args(argv)
    check_arguments(*[(getattr(args, key) < 1, f"--{key} must be >= 1, got {getattr(args, key)}")
                      for key in ("limit", "context_chars", "min_words")],
                    (args.name.strip() == "", "--name must not be empty"))
    check_writable(args.out, "--out", directory=True)
    try:
        items = write_task(args.data_dir, args.out, args.name, args.limit, args.context_chars,
                           args.min_words)
    except (ValueError, OSError) as e:  # a DataError (a UserError) goes to the caller
        raise UserError(str(e)) from None
    print(f"wrote {len(items)} items: {os.path.join(args.out, args.name)}.jsonl and .yaml "
          f"(task '{args.name}')")


if __name__ == "__main__":
    run_script(main)
