"""
Export a checkpoint written by train.py as a Hugging Face model directory (model.safetensors,
config.json and, when the dataset's vocabulary is known, tokenizer files), so that
transformers.AutoModelForCausalLM / AutoTokenizer and lm-evaluation-harness can load it:

    python -m tools.export_hf out/lowres_baseline/best.pt hf/lowres_baseline
    python -m tools.export_hf run/best.pt hf/run --data_dir=data/shakespeare_char --overwrite

    arch gpt2                 -> GPT2LMHeadModel (exact GELU, zero biases when bias=False)
    arch llama                -> LlamaForCausalLM (wqkv split into q/k/v; interleaved RoPE pairs permuted)
    arch llama, n_expert > 1  -> MixtralForCausalLM

Our RoPE (model.apply_rope) rotates the pairs (i, i + head_dim/2) of a head, HF's layout; a model
trained before the layout was recorded rotates the interleaved pairs (2i, 2i+1). Permuting the rows
of its q and k projections within each head (even dimensions first, then odd ones) moves every pair
where HF expects it and leaves q . k unchanged, so the exported model computes the same function.
Our Mixtral router (softmax over all experts in fp32, top_k, renormalised to sum 1) is HF
Mixtral's, so the router weight is copied as it is.

Any checkpoint of a run exports, an FSDP run's ckpt.pt too (its weights are read back from the
shards). Refused with one error: a headless run (ce_weight=0, its LM head never trained: fine-tune
a head first).
After writing, the HF model is loaded back and its logits compared with ours on random tokens
(--no_check skips this); the directory appears only once everything is written and checked.
The export holds about one copy of the weights (issue 42): the checkpoint is memory-mapped into a
model built on the meta device, model.safetensors is written tensor by tensor from views of it, and
our model is released before transformers loads the export back for the check.
transformers and safetensors are optional dependencies, needed only here.
"""

import argparse
import gc
import importlib
import json
import os
import shutil

import torch

import checkpoint as checkpoints
import run
from data import DataError, read_meta
from errors import UserError, end_with
from model import GPT, GPTConfig
from tools import hf_tokenizer
from utils import check_writable

INSTALL = "pip install transformers safetensors"
CHECK_TOLERANCE = 1e-4  # max |logit difference| / max(1, max |logit|) the load-back check accepts


class ExportError(UserError):
    """A checkpoint, dataset or output directory that cannot be exported as asked."""


def require_hf():
    for name in ("transformers", "safetensors.torch"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ExportError(f"exporting to Hugging Face format needs transformers and safetensors ({e}): "
                              f"{INSTALL}") from None


def read_checkpoint(path):
    """(state dict, GPTConfig, train config, checkpoint) of a checkpoint that holds whole weights."""
    try:
        # memory-mapped: the weights are read from the file as they are used, never copied whole;
        # an FSDP run's ckpt.pt is read back from its shards
        ckpt = checkpoints.load_with_weights(path, mmap=True)
    except checkpoints.CheckpointError as e:
        raise ExportError(str(e)) from None
    try:
        config = GPTConfig.from_checkpoint(ckpt["model_config"])
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: its 'model_config' is not a model.GPTConfig ({e})") from None
    train_config = ckpt["config"]
    if train_config.get("ce_weight", 1.0) == 0:
        raise ExportError(f"{path} is a headless run (key 'ce_weight' is 0): its LM head was never trained, "
                          "so it is no language model for Hugging Face; fine-tune a head first "
                          "(config/*_cwt_ft.py) and export that run")
    return ckpt["model"], config, train_config, ckpt


# weights -----------------------------------------------------------------------------------------

def rope_permutation(head_dim):
    """Row order that turns our interleaved RoPE pairs into HF's halves: HF dimension j < d/2
    takes our 2j, HF dimension d/2 + j takes our 2j + 1."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_heads(weight, n_head):
    """Apply rope_permutation to the output rows of a (C, C) q or k projection, head by head."""
    C = weight.shape[0]
    head_dim = C // n_head
    return weight.view(n_head, head_dim, -1)[:, rope_permutation(head_dim)].reshape(C, -1)


def to_half_layout(weight, config):
    """A q or k projection as HF's LLaMA rotates it: the half layout is HF's own; an interleaved
    model's rows are permuted (permute_heads)."""
    return weight if config.rope_layout == "half" else permute_heads(weight, config.n_head)


def gpt2_weights(sd, config):
    """HF GPT-2 names; its Conv1D stores (in, out), the transpose of nn.Linear. HF GPT-2 always has
    biases: a model trained with bias=False gets zeros, the same function."""
    C = config.n_embd
    zeros = lambda n: torch.zeros(n, dtype=sd["wte.weight"].dtype)  # noqa: E731
    bias = lambda key, n: sd[key] if key in sd else zeros(n)  # noqa: E731
    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias": bias("ln_f.bias", C)}
    for i in range(config.n_layer):
        ours, hf = f"h.{i}.", f"transformer.h.{i}."
        for name in ("ln_1", "ln_2"):
            out[hf + name + ".weight"] = sd[ours + name + ".weight"]
            out[hf + name + ".bias"] = bias(ours + name + ".bias", C)
        for name, width in (("attn.c_attn", 3 * C), ("attn.c_proj", C), ("mlp.c_fc", 4 * C),
                            ("mlp.c_proj", C)):
            out[hf + name + ".weight"] = sd[ours + name + ".weight"].t()
            out[hf + name + ".bias"] = bias(ours + name + ".bias", width)
    if not config.tie_weights:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def llama_weights(sd, config):
    """HF LLaMA / Mixtral names (the layout of the published Mixtral checkpoints: one w1/w2/w3 per
    expert, which transformers loads in every version)."""
    C = config.n_embd
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"]}
    for i in range(config.n_layer):
        ours, hf = f"h.{i}.", f"model.layers.{i}."
        q, k, v = sd[ours + "attn.wqkv.weight"].split(C, dim=0)
        out.update({hf + "input_layernorm.weight": sd[ours + "attn_norm.weight"],
                    hf + "post_attention_layernorm.weight": sd[ours + "mlp_norm.weight"],
                    hf + "self_attn.q_proj.weight": to_half_layout(q, config),
                    hf + "self_attn.k_proj.weight": to_half_layout(k, config),
                    hf + "self_attn.v_proj.weight": v,
                    hf + "self_attn.o_proj.weight": sd[ours + "attn.wo.weight"]})
        if config.n_expert > 1:
            out[hf + "block_sparse_moe.gate.weight"] = sd[ours + "mlp.router.weight"]
            for e in range(config.n_expert):  # ours are stacked (E, out, in): expert e's matrix is row e
                for theirs, mine in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
                    out[f"{hf}block_sparse_moe.experts.{e}.{theirs}.weight"] = sd[f"{ours}mlp.{mine}"][e]
        else:
            for theirs, mine in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                out[f"{hf}mlp.{theirs}.weight"] = sd[f"{ours}mlp.{mine}.weight"]
    if not config.tie_weights:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def hf_config(config, special):
    """The transformers config of the same model: eps 1e-5 (our LayerNorm and RMSNorm), no
    dropout (inference), n_positions / max_position_embeddings = block_size."""
    import transformers

    if config.arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd,
            n_layer=config.n_layer, n_head=config.n_head, n_inner=4 * config.n_embd,
            activation_function="gelu",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
            tie_word_embeddings=config.tie_weights, architectures=["GPT2LMHeadModel"], **special)
    common = dict(vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.ffn_width,
                  num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                  num_key_value_heads=config.n_head, head_dim=config.n_embd // config.n_head,
                  hidden_act="silu",
                  max_position_embeddings=config.block_size, rms_norm_eps=1e-5, rope_theta=config.rope_theta,
                  attention_dropout=0.0, tie_word_embeddings=config.tie_weights, **special)
    if config.n_expert > 1:
        return transformers.MixtralConfig(num_local_experts=config.n_expert, num_experts_per_tok=config.top_k,
                                          sliding_window=None, router_jitter_noise=0.0,
                                          architectures=["MixtralForCausalLM"], **common)
    return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, architectures=["LlamaForCausalLM"],
                                    **common)


# tokenizer ---------------------------------------------------------------------------------------

def dataset_meta(ckpt, path, data_dir):
    """(meta, where it came from) of the checkpoint's dataset: --data_dir's meta.json if given, else
    the meta the run stored in its checkpoint, else meta.json in the run's data_dir; (None, why)
    when none exists."""
    if data_dir:
        try:
            return read_meta(data_dir), os.path.join(data_dir, "meta.json")
        except DataError as e:
            raise ExportError(str(e)) from None
    if isinstance(ckpt.get("meta"), dict):
        return ckpt["meta"], path
    candidates = [d for d in (ckpt.get("data_dir_resolved"), ckpt["config"].get("data_dir")) if d]
    for candidate in candidates:
        if os.path.exists(os.path.join(candidate, "meta.json")):
            try:
                return read_meta(candidate), os.path.join(candidate, "meta.json")
            except DataError as e:
                raise ExportError(str(e)) from None
    where = " or ".join(map(repr, candidates)) or "the run's data_dir"
    return None, f"no meta.json at {where} (pass --data_dir=...)"


def make_tokenizer(meta, config):
    if meta is None:
        return None
    if hf_tokenizer.tokenizer_kind(meta) == "char" and len(meta["itos"]) > config.vocab_size:
        raise ExportError(f"the dataset's vocabulary has {len(meta['itos'])} characters but the model only "
                          f"{config.vocab_size} tokens: this meta.json does not belong to this checkpoint")
    try:
        return hf_tokenizer.build(meta, config.block_size)
    except (DataError, ValueError) as e:
        raise ExportError(f"cannot build the tokenizer: {e}") from None


# checks and writing ------------------------------------------------------------------------------

@torch.no_grad()
def our_logits(model, seed=0):
    """(random token ids, our model's logits on them) for check_logits."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (2, min(model.config.block_size, 32)),
                        generator=generator)
    return idx, model.float()(idx)


@torch.no_grad()
def check_logits(directory, idx, ours):
    """Load the written directory with AutoModelForCausalLM and compare its logits on idx with ours
    (our_logits, taken before our model was released); return the max |difference|, raise
    ExportError if it is beyond tolerance."""
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items()
                if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ExportError(f"transformers did not load every exported weight: {problems}")
    theirs = hf.eval()(idx).logits
    diff = (ours - theirs).abs().max().item()
    if not diff <= CHECK_TOLERANCE * max(1.0, ours.abs().max().item()):
        raise ExportError(f"the exported model's logits differ from ours by up to {diff:.3g}: not exported")
    return diff


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                      torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(weights, path, metadata):
    """Write {name: tensor} in the safetensors format (8-byte little-endian header length, a JSON
    header of {name: {dtype, shape, data_offsets}} and "__metadata__", then the raw bytes), one
    tensor at a time: a transposed or permuted view is made contiguous only while it is written, so
    the export never holds a second copy of the model, and tensors that share storage (a tied
    matrix) need no clone, unlike safetensors.torch.save_file."""
    header, offset = {"__metadata__": metadata}, 0
    for name, t in weights.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors' bytes start 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for t in weights.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def edit_json(path, **values):
    """Set keys of a JSON file the installed transformers wrote, for readers of other versions:
    transformers 5 names the generic fast tokenizer class TokenizersBackend (4.x knows it as
    PreTrainedTokenizerFast, which 5 still reads) and keeps rope_theta only inside rope_parameters
    (4.x reads the top-level key, 5 accepts it)."""
    with open(path, encoding="utf-8") as f:
        content = json.load(f)
    content.update(values)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, ensure_ascii=False)
        f.write("\n")


def training_run_under(directory):
    """The first file under directory that makes it (or a folder in it) a training run's: a run
    file or a run.lock, held or not. None if there is none."""
    marks = set(run.RUN_FILES) | {run.LOCK_FILE}
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            if name in marks:
                return os.path.join(root, name)
    return None


def prepare_out_dir(out_dir, overwrite):
    """Refuse an out_dir that is a file, or not empty without --overwrite; --overwrite never replaces
    a directory that holds a training run (best.pt's own folder, or one above it)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"{out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(f"{out_dir} is not empty; pass --overwrite to replace it, or give another "
                          "directory")
    found = training_run_under(out_dir) if os.path.isdir(out_dir) else None
    if found:
        raise ExportError(f"{out_dir} holds a training run ({found}); --overwrite never deletes one; "
                          f"give another directory")


def move_into_place(tmp, out_dir):
    """Rename the finished tmp directory to out_dir; a previous out_dir is moved aside first and
    deleted only after the rename, so a failure leaves the old or the new directory, whole."""
    old = None
    if os.path.exists(out_dir):
        old = tmp + ".old"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old)


def export(path, out_dir, data_dir=None, overwrite=False, tokenizer=True, check=True):
    """Write the HF directory of checkpoint `path` to out_dir. Returns a summary dict (class,
    tokenizer, max |Δlogit| of the check)."""
    require_hf()
    prepare_out_dir(out_dir, overwrite)
    sd, config, _, ckpt = read_checkpoint(path)
    with torch.device("meta"):  # no memory, no random init: the model takes the file's tensors
        model = GPT(config)
    try:
        model.load_state_dict(sd, assign=True)
    except RuntimeError as e:
        raise ExportError(f"{path}: its weights do not fit its model_config "
                          f"({str(e).splitlines()[0]})") from None
    model.tie_weights()  # assign gave the tied matrix two parameters
    model.eval()
    params = model.num_params()
    sd = model.state_dict()  # our own key set, whatever extra keys the file had
    # views of the memory-mapped tensors (transposes, q/k permutations made while each is written)
    weights = gpt2_weights(sd, config) if config.arch == "gpt2" else llama_weights(sd, config)
    meta, source = dataset_meta(ckpt, path, data_dir) if tokenizer else (None, "--no_tokenizer")

    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.export-{os.getpid()}.tmp")
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:
        raise ExportError(f"could not write {out_dir}: {e}") from None
    try:
        tok = make_tokenizer(meta, config)
        if tok is not None:
            tok.save_pretrained(tmp)
            edit_json(os.path.join(tmp, "tokenizer_config.json"), tokenizer_class="PreTrainedTokenizerFast")
            tokenizer_note = f"{hf_tokenizer.tokenizer_kind(meta)} tokenizer from {source}"
        elif meta is not None:
            tokenizer_note = f"no tokenizer: unknown tokenizer {meta.get('tokenizer')!r} in {source}"
        else:
            tokenizer_note = f"no tokenizer: {source}"
        cfg = hf_config(config, hf_tokenizer.special_ids(tok))
        cfg.save_pretrained(tmp)
        if config.arch == "llama":
            edit_json(os.path.join(tmp, "config.json"), rope_theta=config.rope_theta)
        write_safetensors(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(os.path.join(tmp, "model.safetensors"), 0o666 & ~umask)  # readable like the other files
        diff = None
        if check:
            idx, ours = our_logits(model)
            # our model and the memory-mapped checkpoint go before transformers loads its copy
            del model, sd, weights, ckpt
            gc.collect()
            diff = check_logits(tmp, idx, ours)
        prepare_out_dir(out_dir, overwrite)  # again: a run may have started there meanwhile
        move_into_place(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, no permission: nothing of the export is left
            raise ExportError(f"could not write {out_dir}: {e}") from None
        raise
    return {"class": cfg.architectures[0], "tokenizer": tokenizer_note, "max_abs_logit_diff": diff,
            "params": params}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="best.pt (or the ckpt.pt of a run that was not sharded)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--data_dir", default=None, help="the dataset (meta.json) whose tokenizer to "
                        "export, if the checkpoint does not hold its meta and its data_dir is not found "
                        "from here")
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
    result = export(args.checkpoint, args.out_dir, args.data_dir, args.overwrite, not args.no_tokenizer,
                    not args.no_check)
    print(f"wrote {args.out_dir}: {result['class']}, {result['params']:,} parameters")
    if result["tokenizer"].startswith("no tokenizer"):
        print(f"note: {result['tokenizer']}; AutoTokenizer will not load this directory")
    else:
        print(result["tokenizer"])
    if result["max_abs_logit_diff"] is not None:
        print("checked: transformers loads it; max |logit difference| to our model "
              f"{result['max_abs_logit_diff']:.2e}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # the one place a problem the user can fix ends the process
        end_with(e)
