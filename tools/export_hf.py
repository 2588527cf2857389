"""
Export a checkpoint written by train.py as a Hugging Face model directory (model.safetensors,
config.json and, when the dataset's vocabulary is known, tokenizer files), so that
transformers.AutoModelForCausalLM / AutoTokenizer and lm-evaluation-harness can load it:

    python -m tools.export_hf out/lowres_baseline/best.pt hf/lowres_baseline
    python -m tools.export_hf run/best.pt hf/run --data_dir=data/shakespeare_char --overwrite

What becomes what, and what is refused: docs/export.md
"""

import argparse
import gc
import json
import os
import shutil

import torch

import checkpoint as checkpoints
import run
from data import DataError, read_meta
from errors import UserError, run_script
from model import GPT, GPTConfig
from tools import hf_tokenizer
from utils import check_writable

CHECK_TOLERANCE = 1e-4  # max |logit difference| / max(1, max |logit|) the check accepts


class ExportError(UserError):
    """A checkpoint, dataset or out_dir that cannot be exported as asked."""


def require_hf():
    try:
        import transformers  # noqa: F401
        import safetensors.torch  # noqa: F401
    except ImportError as e:
        raise ExportError("exporting to Hugging Face format needs transformers and "
                          f"safetensors ({e}): pip install transformers safetensors") from None


def read_checkpoint(path):
    """(GPTConfig, checkpoint) of `path`, its weights memory-mapped."""
    try:
        ckpt = checkpoints.load_with_weights(path, mmap=True)
    except checkpoints.CheckpointError as e:
        raise ExportError(str(e)) from None
    try:
        config = GPTConfig.from_checkpoint(ckpt["model_config"])
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: its 'model_config' is not a model.GPTConfig ({e})") from None
    if ckpt["config"].get("ce_weight", 1.0) == 0:
        raise ExportError(f"{path} is a headless run (key 'ce_weight' is 0): its LM head was "
                          "never trained, so it is no language model for Hugging Face; "
                          "fine-tune a head first (config/*_cwt_ft.py) and export that run")
    return config, ckpt


def permute_heads(weight, n_head):
    """The rows of a (C, C) q or k projection, head by head, from our
    interleaved RoPE pairs to HF's halves: HF dimension j < d/2 takes
    our 2j, d/2 + j our 2j + 1."""
    C = weight.shape[0]
    d = C // n_head
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return weight.view(n_head, d, -1)[:, order].reshape(C, -1)


def gpt2_weights(sd, config):
    """HF GPT-2's weights: Conv1D stores (in, out), the transpose of
    nn.Linear; a model without biases gets zero ones."""
    C = config.n_embd
    bias = lambda key, n: sd.get(key, torch.zeros(n, dtype=sd["wte.weight"].dtype))  # noqa: E731
    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"],
           "transformer.ln_f.bias": bias("ln_f.bias", C)}
    widths = {"ln_1": C, "ln_2": C, "attn.c_attn": 3 * C, "attn.c_proj": C,
              "mlp.c_fc": 4 * C, "mlp.c_proj": C}
    for i in range(config.n_layer):
        for name, width in widths.items():
            ours = f"h.{i}.{name}."
            hf = f"transformer.h.{i}.{name}."
            out[hf + "weight"] = sd[ours + "weight"].t()  # a norm's vector stays as it is
            out[hf + "bias"] = bias(ours + "bias", width)
    return out


def llama_weights(sd, config):
    """HF LLaMA / Mixtral weights (one w1/w2/w3 per expert, as every
    transformers version loads them); interleaved q and k permuted."""
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"]}
    for i in range(config.n_layer):
        ours = f"h.{i}."
        hf = f"model.layers.{i}."
        q, k, v = sd[ours + "attn.wqkv.weight"].split(config.n_embd)
        if config.rope_layout != "half":
            q = permute_heads(q, config.n_head)
            k = permute_heads(k, config.n_head)
        out.update({hf + "input_layernorm.weight": sd[ours + "attn_norm.weight"],
                    hf + "post_attention_layernorm.weight": sd[ours + "mlp_norm.weight"],
                    hf + "self_attn.q_proj.weight": q,
                    hf + "self_attn.k_proj.weight": k,
                    hf + "self_attn.v_proj.weight": v,
                    hf + "self_attn.o_proj.weight": sd[ours + "attn.wo.weight"]})
        moe = hf + "block_sparse_moe."
        if config.n_expert > 1:
            out[moe + "gate.weight"] = sd[ours + "mlp.router.weight"]
            for e in range(config.n_expert):  # ours stacked (E, out, in)
                for theirs, mine in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
                    out[f"{moe}experts.{e}.{theirs}.weight"] = sd[f"{ours}mlp.{mine}"][e]
        else:
            for theirs, mine in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                out[f"{hf}mlp.{theirs}.weight"] = sd[f"{ours}mlp.{mine}.weight"]
    return out


def hf_config(config, tokenizer):
    """The transformers config of the same model (eps 1e-5, no dropout,
    block_size positions), naming the tokenizer's bos / eos / pad ids."""
    import transformers

    common = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id", None)
              for name in ("bos", "eos", "pad")}
    common.update(vocab_size=config.vocab_size, tie_word_embeddings=config.tie_weights)
    if config.arch == "gpt2":
        return transformers.GPT2Config(
            n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
            n_head=config.n_head, n_inner=4 * config.n_embd, activation_function="gelu",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
            architectures=["GPT2LMHeadModel"], **common)
    common.update(hidden_size=config.n_embd, intermediate_size=config.ffn_width,
                  num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                  num_key_value_heads=config.n_head, head_dim=config.n_embd // config.n_head,
                  hidden_act="silu", max_position_embeddings=config.block_size,
                  rms_norm_eps=1e-5, rope_theta=config.rope_theta, attention_dropout=0.0)
    if config.n_expert > 1:
        return transformers.MixtralConfig(
            num_local_experts=config.n_expert, num_experts_per_tok=config.top_k,
            sliding_window=None, router_jitter_noise=0.0,
            architectures=["MixtralForCausalLM"], **common)
    return transformers.LlamaConfig(attention_bias=False, mlp_bias=False,
                                    architectures=["LlamaForCausalLM"], **common)


def dataset_meta(ckpt, path, data_dir):
    """(meta, where it came from): --data_dir's meta.json if given, else
    the checkpoint's meta, else the run's data_dir's; (None, why)."""
    if not data_dir and isinstance(ckpt.get("meta"), dict):
        return ckpt["meta"], path
    run_dirs = (ckpt.get("data_dir_resolved"), ckpt["config"].get("data_dir"))
    candidates = [data_dir] if data_dir else [d for d in run_dirs if d]
    for candidate in candidates:
        meta_path = os.path.join(candidate, "meta.json")
        if data_dir or os.path.exists(meta_path):
            try:
                return read_meta(candidate), meta_path
            except DataError as e:
                raise ExportError(str(e)) from None
    where = " or ".join(map(repr, candidates)) or "the run's data_dir"
    return None, f"no meta.json at {where} (pass --data_dir=...)"


def save_tokenizer(meta, source, config, directory):
    """Save the tokenizer of meta (from source) into directory; returns
    it, or None, and a note saying what was saved."""
    kind = None if meta is None else hf_tokenizer.vocabulary(meta)
    if kind is None:
        if meta is not None:
            source = f"unknown tokenizer {meta.get('tokenizer')!r} in {source}"
        return None, f"no tokenizer: {source}"
    n_chars = len(meta.get("itos", ()))
    if n_chars > config.vocab_size:
        raise ExportError(f"the dataset's vocabulary has {n_chars} characters but the model "
                          f"only {config.vocab_size} tokens: this meta.json does not belong "
                          "to this checkpoint")
    try:
        if kind == "char":
            tokenizer = hf_tokenizer.char_tokenizer(meta["itos"], config.block_size)
        else:
            tokenizer = hf_tokenizer.bpe_tokenizer(config.block_size)
    except (DataError, ValueError) as e:
        raise ExportError(f"cannot build the tokenizer: {e}") from None
    tokenizer.save_pretrained(directory)
    edit_json(os.path.join(directory, "tokenizer_config.json"),
              tokenizer_class="PreTrainedTokenizerFast")
    return tokenizer, f"{kind} tokenizer from {source}"


@torch.no_grad()
def check_logits(directory, idx, ours):
    """The max |difference| between our logits on idx and those of the
    directory loaded back (ExportError beyond tolerance)."""
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                    output_loading_info=True)
    problems = {k: v for k, v in info.items()
                if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ExportError(f"transformers did not load every exported weight: {problems}")
    theirs = hf.eval()(idx).logits
    diff = (ours - theirs).abs().max().item()
    if not diff <= CHECK_TOLERANCE * max(1.0, ours.abs().max().item()):
        raise ExportError(f"the exported model's logits differ from ours by up to {diff:.3g}: "
                          "not exported")
    return diff


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                      torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


def write_safetensors(weights, path, metadata):
    """Write {name: tensor} as safetensors (the header's length, its
    JSON, the raw bytes) one tensor at a time; unlike save_file, a tied
    matrix needs no clone."""
    header = {"__metadata__": metadata}
    offset = 0
    for name, t in weights.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for t in weights.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def edit_json(path, **values):
    """Set keys of a JSON file transformers wrote, for other versions."""
    with open(path, encoding="utf-8") as f:
        content = json.load(f)
    content.update(values)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, ensure_ascii=False)
        f.write("\n")


def prepare_out_dir(out_dir, overwrite):
    """Refuse an out_dir that is a file, not empty without --overwrite,
    or holds a training run (a run file or run.lock in it or below)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"{out_dir} exists and is not a directory")
    if not os.path.isdir(out_dir):
        return
    if os.listdir(out_dir) and not overwrite:
        raise ExportError(f"{out_dir} is not empty; pass --overwrite to replace it, or give "
                          "another directory")
    marks = set(run.RUN_FILES) | {run.LOCK_FILE}
    for root, dirs, names in os.walk(out_dir):
        dirs.sort()
        found = sorted(marks.intersection(names))
        if found:
            raise ExportError(f"{out_dir} holds a training run ({os.path.join(root, found[0])}); "
                              "--overwrite never deletes one; give another directory")


def move_into_place(tmp, out_dir):
    """Rename tmp to out_dir; a previous out_dir is moved aside and
    deleted after, so a failure leaves the old or the new one whole."""
    old = None
    if os.path.exists(out_dir):
        old = tmp + ".old"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old)


def export(path, out_dir, data_dir=None, overwrite=False, tokenizer=True, check=True):
    """Write the HF directory of checkpoint `path` to out_dir. Returns
    {class, tokenizer, max_abs_logit_diff, params}."""
    require_hf()
    prepare_out_dir(out_dir, overwrite)
    config, ckpt = read_checkpoint(path)
    with torch.device("meta"):  # no init: the model takes the file's tensors
        model = GPT(config)
    try:
        model.load_state_dict(ckpt["model"], assign=True)
    except RuntimeError as e:
        raise ExportError(f"{path}: its weights do not fit its model_config "
                          f"({str(e).splitlines()[0]})") from None
    model.tie_weights()  # assign gave the tied matrix two parameters
    model.eval()
    params = model.num_params()
    sd = model.state_dict()  # our own key set, whatever extra keys the file had
    weights = (gpt2_weights if config.arch == "gpt2" else llama_weights)(sd, config)
    if not config.tie_weights:
        weights["lm_head.weight"] = sd["lm_head.weight"]
    meta, source = dataset_meta(ckpt, path, data_dir) if tokenizer else (None, "--no_tokenizer")

    parent, name = os.path.split(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{name}.export-{os.getpid()}.tmp")
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        tok, note = save_tokenizer(meta, source, config, tmp)
        cfg = hf_config(config, tok)
        cfg.save_pretrained(tmp)
        if config.arch == "llama":
            edit_json(os.path.join(tmp, "config.json"), rope_theta=config.rope_theta)
        write_safetensors(weights, os.path.join(tmp, "model.safetensors"), {"format": "pt"})
        diff = None
        if check:
            generator = torch.Generator().manual_seed(0)
            shape = (2, min(config.block_size, 32))
            idx = torch.randint(0, config.vocab_size, shape, generator=generator)
            with torch.no_grad():
                ours = model.float()(idx)
            # ours released before transformers loads its copy
            del model, sd, weights, ckpt
            gc.collect()
            diff = check_logits(tmp, idx, ours)
        prepare_out_dir(out_dir, overwrite)  # again: a run may have started there meanwhile
        move_into_place(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, no permission
            raise ExportError(f"could not write {out_dir}: {e}") from None
        raise
    return {"class": cfg.architectures[0], "tokenizer": note, "max_abs_logit_diff": diff,
            "params": params}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="best.pt (or the ckpt.pt of a run that was not sharded)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--data_dir", default=None, help="the dataset (meta.json) whose tokenizer "
                        "to export, if the checkpoint does not hold its meta and its data_dir "
                        "is not found from here")
    parser.add_argument("--no_tokenizer", action="store_true", help="export the model alone")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    parser.add_argument("--no_check", action="store_true",
                        help="skip loading the export back to compare logits")
    args = parser.parse_args(argv)
    check_writable(args.out_dir, "out_dir", directory=True)
    require_hf()
    import transformers
    # the check's load-back would print warnings meant for users
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    result = export(args.checkpoint, args.out_dir, args.data_dir, args.overwrite,
                    not args.no_tokenizer, not args.no_check)
    print(f"wrote {args.out_dir}: {result['class']}, {result['params']:,} parameters")
    note = result["tokenizer"]
    if note.startswith("no tokenizer"):
        note = f"note: {note}; AutoTokenizer will not load this directory"
    print(note)
    if result["max_abs_logit_diff"] is not None:
        print("checked: transformers loads it; max |logit difference| to our model "
              f"{result['max_abs_logit_diff']:.2e}")


if __name__ == "__main__":
    run_script(main)
