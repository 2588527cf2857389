"""tools/export_hf.py and tools/lm_eval_task.py: an exported model loaded by transformers computes
our model's logits (every architecture, random weights including norms and biases); the exported
tokenizers give our ids; what cannot be exported is refused with one message and leaves nothing
behind; lm-evaluation-harness on an exported model reports the accuracy and perplexity that a
plain loop over the items with our own model gives. transformers, safetensors and lm_eval are
optional dependencies: without them these tests are skipped."""

import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional: pip install transformers safetensors")
pytest.importorskip("safetensors", reason="safetensors is optional: pip install transformers safetensors")

import checkpoint  # noqa: E402
import prepare_shakespeare  # noqa: E402
from configurator import train_defaults  # noqa: E402
from data import read_meta  # noqa: E402
from model import GPT, GPTConfig, build_model  # noqa: E402
from tools import export_hf, lm_eval_task  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = {  # tiny models with every option the mapping has to get right
    "gpt2_bias_tied": dict(arch="gpt2", bias=True, tie_weights=True),
    "gpt2_nobias_untied": dict(arch="gpt2", bias=False, tie_weights=False),
    "llama_untied": dict(arch="llama", tie_weights=False, ffn_hidden=40, rope_theta=500.0),
    "llama_tied": dict(arch="llama", tie_weights=True, ffn_hidden=24),
    "llama_interleaved": dict(arch="llama", rope_layout="interleaved", tie_weights=False, ffn_hidden=24),
    "mixtral_top2": dict(arch="llama", n_expert=4, top_k=2, ffn_hidden=24, tie_weights=False),
    "mixtral_top1": dict(arch="llama", n_expert=3, top_k=1, ffn_hidden=16, tie_weights=True),
}


def write_checkpoint(path, config, meta=None, seed=0, before_layout=False, **train_config):
    """A checkpoint as train.py writes its best.pt (checkpoint.write of run_state plus the weights),
    with every parameter random -- norm weights and biases too, so a wrong or missing one shows.
    before_layout: written before the RoPE layout was recorded (no 'rope_layout' key)."""
    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model_config = {k: v for k, v in config.__dict__.items() if not (before_layout and k == "rope_layout")}
    state = {"model_config": model_config, "config": {**train_defaults(), "data_dir": "/nonexistent", **train_config},
             "iter_num": 0, "best_val_loss": 0.0, "last_eval": None, "model": model.state_dict(), "objective": {}}
    if meta is not None:
        state["meta"] = meta
    checkpoint.write(str(path), state)
    model.eval()
    return model


def char_config(meta, **kw):
    return GPTConfig(vocab_size=2 * meta["vocab_size"], block_size=16, n_layer=2, n_head=2, n_embd=16, **kw)


@pytest.fixture(scope="module")
def meta(data_dir):
    return read_meta(data_dir)


@pytest.mark.parametrize("name", [*ARCHS, "llama_before_layout"])
def test_exported_logits_equal_ours(tmp_path, meta, name):
    """Random ids over the whole vocabulary (both languages), the whole block: max |Δlogit| <= 1e-5.
    llama_before_layout: a checkpoint that does not record its RoPE layout, trained interleaved."""
    from transformers import AutoModelForCausalLM

    before = name == "llama_before_layout"
    arch = ARCHS["llama_interleaved" if before else name]
    model = write_checkpoint(tmp_path / "best.pt", char_config(meta, **arch), meta, before_layout=before)
    result = export_hf.export(str(tmp_path / "best.pt"), str(tmp_path / "hf"), check=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    expected = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model.config.arch]
    assert type(hf).__name__ == result["class"] == ("MixtralForCausalLM" if model.config.n_expert > 1 else expected)
    idx = torch.randint(0, model.config.vocab_size, (3, model.config.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{name}: max |logit difference| {diff:.2e} (logits up to {ours.abs().max().item():.1f})")
    assert ours.abs().max() > 1 and diff <= 1e-5
    zero_biases = (11 * model.config.n_layer + 1) * model.config.n_embd if name == "gpt2_nobias_untied" else 0
    assert sum(p.numel() for p in hf.parameters()) == model.num_params() + zero_biases  # the same weights, no more


def test_char_tokenizer_gives_our_ids(tmp_path, meta, data_dir):
    """The whole val split decoded with itos, tokenized by AutoTokenizer: exactly val.bin; decode
    gives the text back; a character outside the vocabulary is an error, not a dropped character."""
    from transformers import AutoTokenizer

    write_checkpoint(tmp_path / "best.pt", char_config(meta, arch="gpt2"), meta)
    export_hf.export(str(tmp_path / "best.pt"), str(tmp_path / "hf"), check=False)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16).tolist()
    text = "".join(meta["itos"][i] for i in ids)
    assert tokenizer(text).input_ids == ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == meta["itos"].index("\n")
    with pytest.raises(Exception, match="UNK"):
        tokenizer("~")


def test_bpe_tokenizer_gives_tiktokens_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", os.environ.get(
        "TIKTOKEN_CACHE_DIR", os.path.join(os.path.dirname(REPO), "shared", "data", "tiktoken")))
    if not os.path.isdir(os.environ["TIKTOKEN_CACHE_DIR"]):
        pytest.skip("no tiktoken cache (set TIKTOKEN_CACHE_DIR): GPT-2 BPE ranks unavailable offline")
    from transformers import AutoTokenizer

    from data import BPE_VOCAB_SIZE, gpt2_encoding
    meta = {"tokenizer": "r50k_base", "vocab_size": BPE_VOCAB_SIZE, "tokenizer_vocab_size": 50257, "eot_token": 50256}
    config = GPTConfig(vocab_size=BPE_VOCAB_SIZE, block_size=16, n_layer=1, n_head=2, n_embd=8)
    write_checkpoint(tmp_path / "best.pt", config, meta)
    export_hf.export(str(tmp_path / "best.pt"), str(tmp_path / "hf"), check=False)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.  It's 1600's "
            "verse\t\ttabs, naïve café, 日本語 and 🙂\r\n   trailing   ")
    assert tokenizer(text).input_ids == gpt2_encoding().encode_ordinary(text)
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.eos_token_id == 50256


def test_refused_exports_name_the_reason_and_leave_nothing(tmp_path, meta):
    out = tmp_path / "hf"
    write_checkpoint(tmp_path / "headless.pt", char_config(meta, arch="gpt2", tie_weights=False), meta,
                     ce_weight=0.0, cwt_weight=1.0)
    with pytest.raises(export_hf.ExportError, match="headless run .key 'ce_weight' is 0"):
        export_hf.export(str(tmp_path / "headless.pt"), str(out))
    torch.save({"model_config": char_config(meta).__dict__, "config": train_defaults(), "iter_num": 5,
                "dcp": "ckpt_dcp/a"}, tmp_path / "ckpt.pt")  # what an FSDP run's ckpt.pt holds
    with pytest.raises(export_hf.ExportError, match="cannot read the FSDP shards in .*ckpt_dcp/a"):
        export_hf.export(str(tmp_path / "ckpt.pt"), str(out))  # shards gone (a real one: test_distributed.py)
    with pytest.raises(export_hf.ExportError, match="no checkpoint at"):
        export_hf.export(str(tmp_path / "missing.pt"), str(out))
    # a failure after the temporary directory exists (a meta.json of another dataset) leaves no trace
    write_checkpoint(tmp_path / "best.pt", char_config(meta, arch="gpt2"), {**meta, "itos": meta["itos"] * 3})
    with pytest.raises(export_hf.ExportError, match="does not belong to this checkpoint"):
        export_hf.export(str(tmp_path / "best.pt"), str(out))
    assert sorted(os.listdir(tmp_path)) == ["best.json", "best.pt", "ckpt.pt", "headless.json", "headless.pt"]
    # a non-empty out_dir is kept unless --overwrite, and then replaced whole
    out.mkdir()
    (out / "keep.txt").write_text("x")
    write_checkpoint(tmp_path / "best.pt", char_config(meta, arch="gpt2"), meta)
    with pytest.raises(export_hf.ExportError, match="not empty; pass --overwrite"):
        export_hf.export(str(tmp_path / "best.pt"), str(out))
    export_hf.export(str(tmp_path / "best.pt"), str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(export_hf.ExportError, match="missing meta.json"):
        export_hf.export(str(tmp_path / "best.pt"), str(tmp_path / "hf2"), data_dir=str(tmp_path / "nowhere"))


def run_python(code, *args):
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_command_line_checks_and_notes_a_missing_tokenizer(tmp_path, meta, capsys):
    """The command line's main(): no meta in the checkpoint and no data_dir -> exported with a
    note; the load-back check runs and prints its difference; an error is an ExportError (a UserError:
    one line and exit 1 at the entry point)."""
    write_checkpoint(tmp_path / "best.pt", char_config(meta, arch="llama", n_expert=2, top_k=1, ffn_hidden=16))
    export_hf.main([str(tmp_path / "best.pt"), str(tmp_path / "hf")])
    printed = capsys.readouterr().out
    assert "MixtralForCausalLM" in printed and "note: no tokenizer: no meta.json at '/nonexistent'" in printed
    assert "checked: transformers loads it" in printed
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    with pytest.raises(export_hf.ExportError, match="is not empty; pass --overwrite") as error:
        export_hf.main([str(tmp_path / "best.pt"), str(tmp_path / "hf")])
    assert error.value.status == 1


@pytest.mark.slow
def test_without_transformers_the_repo_runs_and_the_tool_says_what_to_install(tmp_path):
    """transformers blocked from importing (sys.modules entry None): the core modules and both
    tools import, and the export stops with one line naming the pip command."""
    block = "import sys; sys.modules['transformers'] = None; sys.modules['safetensors'] = None; "
    result = run_python(block + "import model, losses, evaluate, checkpoint, tools.export_hf, tools.lm_eval_task; "
                        "import runpy; runpy.run_module('tools.export_hf', run_name='__main__')",
                        str(tmp_path / "x.pt"), str(tmp_path / "o"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: exporting to Hugging Face format needs transformers")
    assert "pip install transformers safetensors" in result.stderr and not os.path.exists(tmp_path / "o")


# lm-evaluation-harness --------------------------------------------------------------------------

def our_lastword_metrics(model, items, stoi):
    """The task's metrics by a plain loop with our model and our char ids: per item, the last
    block_size + 1 tokens of context + target (lm-eval's left cut), the summed log-probability of
    the target tokens, and whether each of them is the argmax."""
    lls, hits = [], []
    T = model.config.block_size
    with torch.no_grad():
        for item in items:
            ids = [stoi[ch] for ch in item["context"] + item["target"]][-(T + 1):]
            n = len(item["target"])
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0, -n:].double(), dim=-1)
            target = torch.tensor(ids[-n:])
            lls.append(logp[torch.arange(n), target].sum().item())
            hits.append(bool((logp.argmax(dim=-1) == target).all()))
    return {"acc": sum(hits) / len(hits), "perplexity": math.exp(-sum(lls) / len(lls))}


def test_lastword_items():
    """The target is the line's last word with its space and without the punctuation after it;
    the context is everything before it, cut at a line start when it would exceed context_chars."""
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\nAy.\n"
    assert lm_eval_task.make_items(text, context_chars=60) == [
        {"context": "ROMEO:\nBut soft, what light through yonder window", "target": " breaks"},
        {"context": "It is the east, and Juliet is the", "target": " sun"}]
    assert lm_eval_task.make_items(text, limit=1, context_chars=60, min_words=9) == [
        {"context": "It is the east, and Juliet is the", "target": " sun"}]


@pytest.fixture(scope="module")
def lastword_data(tmp_path_factory):
    """A text whose line-final words a tiny model can learn: 60 % of the lines are one of four
    fixed sentences (the last word follows from the first ones), the others end in a random name."""
    root = tmp_path_factory.mktemp("lastword")
    rng = random.Random(0)
    fixed = ["the king shall have his crown", "my lord is very good", "so quick a jest of wax", "away with the queen"]
    names = ["Titus", "Ho", "Zounds", "Exit", "mercy", "five", "BY", "lord"]
    lines = [rng.choice(fixed) if rng.random() < 0.6 else "cry mercy to " + rng.choice(names) for _ in range(800)]
    (root / "input.txt").write_text("".join(line + rng.choice(".,;!") + "\n" for line in lines))
    prepare_shakespeare.prepare(input_path=str(root / "input.txt"), out_dir=str(root / "chars"))
    return str(root / "chars")


@pytest.mark.slow
def test_lm_eval_on_an_exported_model_matches_our_loop(tmp_path, lastword_data):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install lm_eval")
    pytest.importorskip("accelerate", reason="lm_eval's hf model needs accelerate: pip install accelerate")
    from lm_eval.tasks import TaskManager

    # a model that has learnt something: 200 steps of train.py
    out = tmp_path / "run"
    args = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8", "--max_iters=200",
            "--lr_decay_iters=200", "--eval_interval=200", "--eval_iters=2", "--warmup_iters=10",
            "--learning_rate=1e-2", "--low_resource=False", "--final_eval=False", "--num_threads=1"]
    result = subprocess.run([sys.executable, "train.py", f"--data_dir={lastword_data}", f"--out_dir={out}", *args],
                            cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-2000:]
    export_hf.export(str(out / "best.pt"), str(tmp_path / "hf"))
    # contexts up to 40 characters: some are longer than the block, so lm-eval's left cut is exercised
    items = lm_eval_task.write_task(lastword_data, str(tmp_path / "tasks"), "tiny_lastword", limit=60,
                                    context_chars=40)
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", tasks=["tiny_lastword"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False), device="cpu",
        batch_size=8, log_samples=False, bootstrap_iters=0)["results"]["tiny_lastword"]
    ckpt = checkpoint.load(str(out / "best.pt"))
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    ours = our_lastword_metrics(model.eval(), items, {ch: i for i, ch in enumerate(ckpt["meta"]["itos"])})
    print(f"lm-eval: acc {results['acc,none']:.4f}, perplexity {results['perplexity,none']:.4f}; our loop: {ours}")
    assert 0 < ours["acc"] < 1
    assert results["acc,none"] == pytest.approx(ours["acc"], abs=1e-12)
    assert results["perplexity,none"] == pytest.approx(ours["perplexity"], rel=1e-5)
    with open(tmp_path / "tasks" / "tiny_lastword.jsonl") as f:
        assert [json.loads(line) for line in f] == items



def test_written_safetensors_read_back_by_safetensors(tmp_path):
    """write_safetensors: views (a transpose, a row of a stacked tensor), tensors sharing storage (a tied
    matrix), every float width and ints come back from safetensors' own loader as they were."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    base = torch.randn(6, 5)
    weights = {"t": base.t(), "row": base[2], "tied_a": base, "tied_b": base,
               "half": torch.randn(3, 1).half(), "bf16": torch.randn(7).bfloat16(),
               "f64": torch.randn(2, 2, 2).double(), "ids": torch.arange(5)}
    path = str(tmp_path / "model.safetensors")
    export_hf.write_safetensors(weights, path, metadata={"format": "pt"})
    loaded = load_file(path)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert loaded.keys() == weights.keys()
    for name, t in weights.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


# memory -----------------------------------------------------------------------------------------

MEASURE_EXPORT = """
import gc, json, sys, torch
sys.path.insert(0, '.')
import transformers, safetensors.torch
from tools import export_hf
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

def peak():
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmHWM:'))

export_hf.export(sys.argv[3], sys.argv[4], tokenizer=False)  # a tiny model first: the modules the export
gc.collect()  # and its check import are loaded (about 120 MB, whatever the model's size)
before = peak()
result = export_hf.export(sys.argv[1], sys.argv[2], tokenizer=False)
print(json.dumps({"growth": peak() - before, "diff": result["max_abs_logit_diff"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_holds_about_one_copy_of_the_weights(tmp_path, arch):
    """The growth of the resident peak across export() of a few-hundred-MB model, in a fresh process
    that has imported transformers and exported a tiny model: the checkpoint is read memory-mapped into
    a model built on meta, the file written tensor by tensor, and our model released before
    transformers loads the export back for the check (which then holds the one copy)."""
    config = GPTConfig(vocab_size=8192, block_size=64, n_layer=4, n_head=8, n_embd=1024, arch=arch,
                       bias=False, tie_weights=arch == "gpt2")
    torch.manual_seed(0)
    model = GPT(config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied matrix once
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(config), "config": {},
                "iter_num": 0}, tmp_path / "best.pt")
    del model
    tiny = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, arch=arch,
                     tie_weights=arch == "gpt2")
    write_checkpoint(tmp_path / "tiny.pt", tiny)
    names = ("best.pt", "hf", "tiny.pt", "tiny")
    result = run_python(MEASURE_EXPORT, *(str(tmp_path / name) for name in names))
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"{arch}: {weight_bytes / 1e6:.0f} MB of weights, resident peak grew "
          f"{out['growth'] / weight_bytes:.2f}x, max |Δlogit| {out['diff']:.2e}")
    assert weight_bytes > 150e6 and out["diff"] is not None
    # one copy (the mapped file, then transformers' load of the export) and activations: 1.17x (llama)
    # and 1.10x (gpt2) measured here; reading the whole file, building the model for real, cloning the
    # weights and loading the export while ours lived held 4.07x and 4.36x
    assert out["growth"] < 1.5 * weight_bytes, (out["growth"], weight_bytes)
