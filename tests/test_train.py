"""train.py end to end on a tiny model and a small text the test writes: outputs, metrics,
determinism, exact resume, the Stop Jostling options, evaluate.py on a saved checkpoint."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4",
        "--eval_interval=10", "--eval_iters=2", "--warmup_iters=2", "--lr_decay_iters=20",
        "--max_iters=20", "--log_interval=1", "--num_threads=1"]


def train(out_dir, data_dir, *args, check=True):
    result = subprocess.run([sys.executable, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}",
                             f"--out_dir={out_dir}", *TINY, *args],
                            cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir):
    return {r["iter"]: r["loss"] for r in read_log(out_dir) if "loss" in r}


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory, data_dir):
    out = str(tmp_path_factory.mktemp("runs") / "baseline")
    result = train(out, data_dir)
    return out, result


def test_run_writes_log_checkpoints_and_metrics(baseline_run):
    out, result = baseline_run
    assert "params:" in result.stdout and re.search(r"^metric +high +low$", result.stdout, re.M)  # both languages scored
    assert sorted(f for f in os.listdir(out)) == ["best.json", "best.pt", "ckpt.json", "ckpt.pt", "ckpt_prev.json",
                                                  "ckpt_prev.pt", "log.jsonl", "metrics.json", "run.lock"]
    log = read_log(out)
    assert sorted(train_losses(out)) == list(range(20))
    evals = [r for r in log if "val" in r]
    assert [r["iter"] for r in evals] == [0, 10, 20]
    assert all({"val", "val_high", "val_low"} <= set(r) for r in evals)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 5 for r in log if "loss" in r)
    assert train_losses(out)[19] < train_losses(out)[0]  # it learns something
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    for lang in ("high", "low"):
        assert set(metrics[lang]) == {"ppl", "ppl_best", "t_best", "accuracy", "recall_at_5", "mrr", "isotropy", "isotropy_authors"}
        assert metrics[lang]["ppl_best"] <= metrics[lang]["ppl"]
        assert 0 <= metrics[lang]["accuracy"] <= metrics[lang]["recall_at_5"] <= 1
    assert 0 < metrics["isotropy_all"] <= 1
    for lang in ("high", "low"):
        g = metrics["geometry"][lang]
        assert len(g["mu"]) == 2 and len(g["cosine_histograms"]) == 2  # embedding output + 1 block
        assert all(-1 <= m <= 1 for m in g["mu"]) and -1 <= g["final_cosine"] <= 1
        assert g["simreg_final"] >= 0 and sum(g["cosine_histograms"][0]) == pytest.approx(1)
    assert {"twin_top3_fraction", "cases_12", "cases_letters", "cases_letters_total"} <= set(metrics["translations"])
    with open(os.path.join(out, "best.json")) as f:
        best = json.load(f)
    assert metrics["checkpoint"]["iter"] == best["iter_num"]
    assert best["best_val_loss"] == min(r["val"] for r in evals)


def test_evaluations_log_the_twin_alignment(baseline_run):
    """Every evaluation of a two-language run logs twin_cos and twin_top3 of the embedding it
    evaluated: at best.pt's step, the values of its wte by a loop over the formula."""
    import numpy as np
    import torch
    out, _ = baseline_run
    evals = {r["iter"]: r for r in read_log(out) if "val" in r}
    assert all({"twin_cos", "twin_top3"} <= set(r) for r in evals.values())
    best = torch.load(os.path.join(out, "best.pt"), map_location="cpu", weights_only=False)
    shift = best["meta"]["vocab_size"]
    wte = best["model"]["wte.weight"].double().numpy()
    unit = wte / np.linalg.norm(wte, axis=1, keepdims=True)
    twin_cos = sum(unit[i] @ unit[i + shift] for i in range(shift)) / shift
    hits = 0
    for i in range(2 * shift):
        others = sorted((j for j in range(2 * shift) if j != i), key=lambda j: -(unit[i] @ unit[j]))
        hits += (i + shift) % (2 * shift) in others[:3]
    record = evals[best["iter_num"]]
    assert record["twin_cos"] == pytest.approx(twin_cos, abs=1e-6)
    assert record["twin_top3"] == pytest.approx(hits / (2 * shift))


@pytest.mark.slow
def test_data_seed_orders_the_data_apart_from_the_initialisation(baseline_run, tmp_path, data_dir):
    """data_seed left unset is the run's seed, bit for bit; another data_seed keeps the
    initialisation (the same step-0 evaluation) and changes the batches; another seed with the
    same data_seed changes the initialisation."""
    out, _ = baseline_run
    same = str(tmp_path / "same")
    train(same, data_dir, "--data_seed=1337")  # config/lowres_baseline.py: seed 1337
    assert train_losses(same) == train_losses(out)
    assert [r for r in read_log(same) if "val" in r] == [r for r in read_log(out) if "val" in r]
    other_data = str(tmp_path / "other_data")
    train(other_data, data_dir, "--data_seed=7", "--max_iters=2", "--final_eval=False")
    assert read_log(other_data)[0] == read_log(out)[0]  # the step-0 evaluation: the same initial weights
    assert train_losses(other_data)[0] != train_losses(out)[0]
    other_init = str(tmp_path / "other_init")
    train(other_init, data_dir, "--seed=7", "--data_seed=1337", "--max_iters=2", "--final_eval=False")
    assert read_log(other_init)[0]["val"] != read_log(out)[0]["val"]


@pytest.mark.slow
def test_init_embeddings_from_seed_swaps_the_embeddings_and_keeps_the_rest(baseline_run, tmp_path, data_dir):
    """init_embeddings_from_seed (issue 40's swap): the step-0 weights are seed 7's run's token and
    position embeddings (and the LM head tied to them) and the run's own seed's everything else,
    each compared with the step-0 weights of a plain run of that seed; set to the run's own seed,
    the run is the plain run, bit for bit."""
    import torch
    out, _ = baseline_run
    same = str(tmp_path / "same")
    train(same, data_dir, "--init_embeddings_from_seed=1337")  # config/lowres_baseline.py: seed 1337
    assert train_losses(same) == train_losses(out)
    assert [r for r in read_log(same) if "val" in r] == [r for r in read_log(out) if "val" in r]
    step0 = {}
    for name, args in {"own": ["--seed=1337"], "donor": ["--seed=7"],
                       "swapped": ["--seed=1337", "--init_embeddings_from_seed=7"]}.items():
        train(str(tmp_path / name), data_dir, *args, "--max_iters=0", "--final_eval=False")
        step0[name] = torch.load(os.path.join(tmp_path, name, "best.pt"), map_location="cpu", weights_only=False)["model"]
        assert torch.load(os.path.join(tmp_path, name, "best.pt"), map_location="cpu", weights_only=False)["iter_num"] == 0
    embeddings = {"wte.weight", "wpe.weight", "lm_head.weight"}  # lm_head is tied to wte
    assert embeddings < set(step0["swapped"]) and len(step0["swapped"]) > len(embeddings)
    for name, tensor in step0["swapped"].items():
        source = step0["donor" if name in embeddings else "own"]
        assert torch.equal(tensor, source[name]), name
        assert not torch.equal(step0["own"][name], step0["donor"][name]) or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))


def test_train_defaults_are_what_a_run_uses(baseline_run):
    """configurator.train_defaults() reads train.py's defaults from its source; a real run's
    checkpoint records the config it ran with: every key not set by the test's command line (or
    config/lowres_baseline.py, which only names the run) must be the same."""
    from configurator import train_defaults
    out, _ = baseline_run
    with open(os.path.join(out, "ckpt.json")) as f:
        used = json.load(f)["config"]
    defaults = train_defaults()
    set_here = {arg[2:].split("=")[0] for arg in TINY} | {"data_dir", "out_dir"}
    assert set(defaults) == set(used)
    assert {k: v for k, v in defaults.items() if k not in set_here} == {k: v for k, v in used.items() if k not in set_here}


@pytest.mark.slow
def test_same_seed_same_run_other_seed_other_run(tmp_path, data_dir, baseline_run):
    out, _ = baseline_run
    train(tmp_path / "again", data_dir)
    assert train_losses(tmp_path / "again") == train_losses(out)
    train(tmp_path / "seed2", data_dir, "--seed=2")
    assert train_losses(tmp_path / "seed2") != train_losses(out)


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, data_dir, baseline_run):
    out, _ = baseline_run
    part = tmp_path / "part"
    train(part, data_dir, "--max_iters=10", "--final_eval=False")
    result = train(part, data_dir, "--init_from=resume")
    assert "resumed from" in result.stdout
    assert train_losses(part) == train_losses(out)  # bitwise equal losses at every step after resuming
    assert [r["iter"] for r in read_log(part) if "val" in r] == [0, 10, 20]


@pytest.mark.slow
def test_epoch_order_resumes_exactly_in_the_middle_of_an_epoch(tmp_path, small_data_dir):
    """data_order='epoch' on a split of 23 windows: 20 steps of 4 windows are 3 epochs and 11 windows.
    A run stopped at step 7 (epoch 1, window 5) and resumed trains on the same windows as the
    uninterrupted run, bit for bit; a resume that changes the order is refused unless it names it."""
    import torch
    full, part, drawn = tmp_path / "full", tmp_path / "part", tmp_path / "random"
    train(full, small_data_dir, "--data_order=epoch", "--final_eval=False")
    train(part, small_data_dir, "--data_order=epoch", "--max_iters=7", "--final_eval=False")
    assert torch.load(part / "ckpt.pt", weights_only=True)["data_position"] == {"epoch": 1, "index": 5, "n_windows": 23}
    refused = train(part, small_data_dir, "--init_from=resume", check=False)  # the default: data_order='random'
    assert refused.returncode == 1 and "data_order: 'epoch' there, 'random' here" in refused.stderr
    assert "--resume_changes=data_order" in refused.stderr and "Traceback" not in refused.stderr
    train(part, small_data_dir, "--data_order=epoch", "--init_from=resume", "--final_eval=False")
    assert train_losses(part) == train_losses(full)
    final = [torch.load(run / "ckpt.pt", weights_only=True) for run in (full, part)]
    assert final[0]["data_position"] == final[1]["data_position"] == {"epoch": 3, "index": 11, "n_windows": 23}
    assert all(torch.equal(value, final[1]["model"][name]) for name, value in final[0]["model"].items())
    train(drawn, small_data_dir, "--max_iters=1", "--final_eval=False")  # random windows: another first batch
    assert train_losses(drawn)[0] != train_losses(full)[0]
    assert torch.load(drawn / "ckpt.pt", weights_only=True)["data_position"] is None
    # switched on purpose (named): the epoch order starts at its beginning
    train(drawn, small_data_dir, "--init_from=resume", "--data_order=epoch", "--resume_changes=data_order",
          "--max_iters=2", "--final_eval=False")
    assert torch.load(drawn / "ckpt.pt", weights_only=True)["data_position"] == {"epoch": 0, "index": 4, "n_windows": 23}


@pytest.mark.slow
def test_float16_run_logs_its_loss_scale_and_resumes_exactly(tmp_path, data_dir):
    """dtype=float16 (what dtype=auto picks on a GPU without bf16) on the CPU: the loss scale is
    logged at every step and is part of the checkpoint, so a resumed run goes on exactly; the
    embedding-gradient report counts only the steps taken (a skipped step's gradient holds inf)."""
    full, part = tmp_path / "full", tmp_path / "part"
    fp16 = ["--dtype=float16", "--final_eval=False", "--simreg_weight=1.0", "--simreg_tau=0.5", "--nitp_weight=1.0",
            "--log_marginalization=True", "--low_resource_prob=0.5"]
    result = train(full, data_dir, *fp16)
    assert "device cpu float16" in result.stdout
    scales = [r["loss_scale"] for r in read_log(full) if "loss" in r]
    assert len(scales) == 20 and scales[9] < 2.0 ** 16  # overflows skipped steps before the resume point
    skipped = sum(after < before for before, after in zip([2.0 ** 16] + scales, scales))
    with open(full / "marginalization.json") as f:
        report = json.load(f)
    assert report["steps"] == 20 - skipped
    assert all(r[k] >= 0 for r in report["tokens_rarest_first"] for k in ("ratio_of_average", "average_of_ratio"))
    train(part, data_dir, *fp16, "--max_iters=10")
    import torch
    saved = torch.load(part / "ckpt.pt", weights_only=True)["grad_scaler"]
    assert saved["scale"] == scales[9]
    train(part, data_dir, *fp16, "--init_from=resume")
    assert train_losses(part) == train_losses(full)
    assert [r["loss_scale"] for r in read_log(part) if "loss" in r] == scales
    with open(part / "marginalization.json") as f:
        assert json.load(f) == report


@pytest.mark.slow
def test_resume_without_checkpoint_and_missing_data_fail_clearly(tmp_path, data_dir):
    result = train(tmp_path / "none", data_dir, "--init_from=resume", check=False)
    assert result.returncode != 0 and "no checkpoint at" in result.stderr
    result = train(tmp_path / "x", str(tmp_path / "nodata"), check=False)
    assert result.returncode != 0 and "missing meta.json" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_run_that_cannot_fit_is_refused_before_it_allocates(tmp_path, data_dir):
    """A 64 x 8192 model (50B parameters: 0.8 TB of states) on any machine that runs this suite:
    one line from the plan, exit 1, nothing written, and the process never near the model's size."""
    out = tmp_path / "huge"
    with open(tmp_path / "stderr", "w") as err:
        process = subprocess.Popen([sys.executable, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}",
                                    f"--out_dir={out}", *TINY, "--n_layer=64", "--n_embd=8192", "--n_head=64"],
                                   cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
        _, status, usage = os.wait4(process.pid, 0)  # this child's own peak, not every earlier test's
    stderr = (tmp_path / "stderr").read_text()
    assert os.waitstatus_to_exitcode(status) == 1 and "Traceback" not in stderr
    assert stderr.startswith("error: this run needs ") and stderr.count("\n") == 1
    assert "--check_memory=False" in stderr and "--parallel=fsdp" in stderr
    assert not out.exists()
    assert usage.ru_maxrss < 2 * 2 ** 20  # KiB (Linux): under 2 GiB


@pytest.mark.slow
def test_threshold_se_and_marginalization(tmp_path, data_dir):
    out = tmp_path / "se"
    train(out, data_dir, "--margin=0.6", "--separate_embeddings=True", "--log_marginalization=True",
          "--low_resource_prob=0.5")  # so LR tokens do appear as inputs and targets in 20 steps
    with open(out / "marginalization.json") as f:
        report = json.load(f)
    assert report["steps"] == 20
    rows = report["tokens_rarest_first"]
    counts = [r["train_count"] for r in rows]
    assert counts == sorted(counts) and all(r["id"] >= len(rows) for r in rows)  # LR rows, rarest first
    values = [r[k] for r in rows for k in ("ratio_of_average", "average_of_ratio")]
    assert all(v >= 0 for v in values) and max(values) > 0  # nan would fail both


@pytest.mark.slow
def test_evaluate_cli_reproduces_metrics(tmp_path, baseline_run):
    out, _ = baseline_run
    target = tmp_path / "m.json"
    result = subprocess.run([sys.executable, "evaluate.py", os.path.join(out, "best.pt"), f"--out={target}"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    with open(target) as f, open(os.path.join(out, "metrics.json")) as g:
        alone, in_training = json.load(f), json.load(g)
    # the evaluation's own FLOPs are the same; training's are only known to train.py
    assert alone.pop("flops") == {"final_eval": in_training["flops"]["final_eval"], "total": in_training["flops"]["final_eval"]}
    in_training.pop("flops")
    assert_close(alone, in_training)  # equal up to the last bits that a different thread count may change in a matmul


@pytest.mark.slow
def test_flops_executed_match_a_count_of_the_matmuls(baseline_run, data_dir, tmp_path):
    """metrics.json's FLOPs against an independent count: 2 FLOPs per parameter per token forward
    (every matmul weight, the tied LM head included, and the norms' gains, as nanoGPT's 6N counts
    them; not the position table, a lookup), 4 L C T for attention scores, backward = 2x forward; 3 evaluations of eval_iters batches in both languages; the final evaluation scores
    the whole val split in both languages. The NITP head adds 6 per weight per training token."""
    import torch
    import checkpoint
    import scoring
    out, _ = baseline_run
    model, _ = checkpoint.load_model(os.path.join(out, "best.pt"))
    linear = sum(p.numel() for name, p in model.named_parameters() if name != "wpe.weight")
    L, C, T, B = 1, 16, 16, 4
    forward = 2 * linear + 4 * L * C * T
    x, _ = scoring.val_blocks(data_dir, T)
    with open(os.path.join(out, "metrics.json")) as f:
        flops = json.load(f)["flops"]
    assert flops["train"] == 20 * B * T * 3 * forward
    assert flops["eval"] == 3 * 2 * 2 * B * T * forward
    assert flops["final_eval"] == 2 * x.numel() * forward
    assert flops["total"] == flops["train"] + flops["eval"] + flops["final_eval"]
    nitp = tmp_path / "nitp"
    train(nitp, data_dir, "--nitp_weight=1.0", "--final_eval=False", "--max_iters=2")
    checkpoint = torch.load(nitp / "ckpt.pt", weights_only=True)
    head = sum(v.numel() for k, v in checkpoint["objective"].items() if v.dim() == 2)
    assert head == 3 * C * 4 * C and checkpoint["flops_done"]["train"] == 2 * B * T * (3 * forward + 6 * head)
    # headless CWT: no LM head, but each token's logits against the batch's B x T target embeddings
    cwt = tmp_path / "cwt"
    train(cwt, data_dir, "--ce_weight=0.0", "--cwt_weight=1.0", "--final_eval=False", "--max_iters=2")
    checkpoint = torch.load(cwt / "ckpt.pt", weights_only=True)
    V = model.config.vocab_size
    assert checkpoint["flops_done"]["train"] == 2 * B * T * (3 * (forward - 2 * V * C) + 6 * B * T * C)


def assert_close(a, b, path=""):
    """Nested dicts/lists equal, floats within 1e-9 relative."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_close(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_close(u, v, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


@pytest.mark.slow
def test_sample_generates_from_the_prompt(baseline_run):
    out, _ = baseline_run
    args = [sys.executable, "sample.py", os.path.join(out, "best.pt"), "--start=And the", "--max_new_tokens=30"]
    result = subprocess.run(args + ["--lang=low"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("And the") and "generated characters are LR" in result.stdout
    again = subprocess.run(args + ["--lang=low"], cwd=REPO, capture_output=True, text=True)
    assert again.stdout == result.stdout  # seeded
    bad = subprocess.run(args[:3] + ["--start=#"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "not in the vocabulary" in bad.stderr


ALL_LOSSES = ["--simreg_weight=3.5", "--simreg_chunk_size=8", "--dispersion_weight=0.1", "--dispersion_positions=8",
              "--nitp_weight=1.0", "--cwt_weight=0.5", "--margin=1.0"]


@pytest.mark.slow
def test_every_loss_together_logs_each_term_and_resumes_exactly(tmp_path, data_dir):
    full, part = tmp_path / "full", tmp_path / "part"
    train(full, data_dir, *ALL_LOSSES, "--final_eval=False")
    records = read_log(full)
    step = [r for r in records if "loss" in r][-1]
    terms = ("ce", "simreg", "dispersion", "nitp", "cwt")
    assert all(name in step for name in terms)
    weights = {"ce": 1.0, "simreg": 3.5, "dispersion": 0.1, "nitp": 1.0, "cwt": 0.5}
    assert step["loss"] == pytest.approx(sum(weights[n] * step[n] for n in terms), rel=1e-5)
    evals = [r for r in records if "val" in r]
    assert all(f"val_{name}" in evals[-1] for name in terms if name != "ce")
    # the NITP head and the random dispersion positions are part of the exact-resume state
    train(part, data_dir, *ALL_LOSSES, "--final_eval=False", "--max_iters=10")
    train(part, data_dir, *ALL_LOSSES, "--final_eval=False", "--init_from=resume")
    assert train_losses(part) == train_losses(full)


@pytest.mark.slow
def test_layer_keys_beyond_the_memory_checks_cut_model_train(tmp_path, data_dir):
    """simreg_layer, nitp_layer and nitp_prenorm on blocks the memory check's 1- and 2-block models
    do not have: train.py's whole setup, memory check included, then its steps (issue 57)."""
    train(tmp_path / "layers", data_dir, "--n_layer=4", "--simreg_weight=1.0", "--simreg_layer=3",
          "--nitp_weight=1.0", "--nitp_layer=4", "--nitp_prenorm=True", "--max_iters=2", "--final_eval=False")
    assert [r["iter"] for r in read_log(tmp_path / "layers") if "loss" in r] == [0, 1]


@pytest.mark.slow
def test_headless_cwt_run(tmp_path, data_dir):
    out = tmp_path / "cwt"
    train(out, data_dir, "--ce_weight=0.0", "--cwt_weight=1.0")
    step = [r for r in read_log(out) if "loss" in r][-1]
    assert "ce" not in step and step["loss"] == step["cwt"]
    last_eval = [r for r in read_log(out) if "val" in r][-1]
    assert last_eval["val"] == last_eval["val_cwt"] and "val_ce" in last_eval  # selected on its own objective
    assert os.path.exists(out / "metrics.json")

    # second stage: a new untied head, a copy of the input embedding, fine-tuned with CE only
    ft = tmp_path / "cwt_ft"
    result = train(ft, data_dir, f"--init_from={out / 'best.pt'}", "--head_from_embedding=True",
                   "--tie_weights=False", "--lr_schedule=constant", "--learning_rate=1e-4", "--weight_decay=0.0")
    assert "LM head := copy of wte" in result.stdout
    best_headless = min((r for r in read_log(out) if "val" in r), key=lambda r: r["val"])
    first_ft = [r for r in read_log(ft) if "val" in r][0]
    # at step 0 the untied head equals the tied one, so the val CE is exactly the headless model's
    assert first_ft["iter"] == 0 and first_ft["val"] == best_headless["val_ce"]
    assert {r["lr"] for r in read_log(ft) if "loss" in r and r["iter"] >= 2} == {1e-4}  # warm-up 2, then constant
    assert "ce" in [r for r in read_log(ft) if "loss" in r][-1]
    sample = subprocess.run([sys.executable, "sample.py", str(ft / "best.pt"), "--start=And", "--max_new_tokens=20"],
                            cwd=REPO, capture_output=True, text=True)
    assert sample.returncode == 0 and sample.stdout.startswith("And")
    # a checkpoint of another shape is refused with the key named
    bad = train(tmp_path / "bad", data_dir, f"--init_from={out / 'best.pt'}", "--n_embd=32", check=False)
    assert bad.returncode != 0 and "model key 'n_embd'" in bad.stderr


@pytest.mark.slow
def test_bad_objective_settings_fail_clearly(tmp_path, data_dir):
    result = train(tmp_path / "x", data_dir, "--dispersion_weight=0.1", "--dispersion_variant=spread", check=False)
    assert result.returncode == 2 and "key 'dispersion_variant' must be one of angular" in result.stderr
    result = train(tmp_path / "y", data_dir, "--ce_weight=0.0", check=False)
    assert result.returncode != 0 and "every loss weight is 0" in result.stderr


@pytest.mark.slow
def test_divergence_stops_the_run_and_keeps_the_good_checkpoint(tmp_path, data_dir):
    """learning_rate 1e6: the loss turns non-finite within a few steps. The run must stop there
    (status 1, one message naming the step, the terms and the last good checkpoint), never write
    a checkpoint with non-finite weights, and write no metrics.json."""
    import torch
    out = tmp_path / "diverged"
    result = train(str(out), data_dir, "--learning_rate=1e6", "--max_iters=200", "--lr_decay_iters=200", check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: training diverged at step ") and "non-finite" in message
    terms = message.split("non-finite ")[1].split(" (")[0].split(", ")  # the terms it names
    assert terms and set(terms) <= {"loss", "ce", "val", "val_high", "val_low", "weights"}, terms
    assert f"{out / 'ckpt.pt'} (step 0)" in message
    assert "--init_from=resume --resume_changes=learning_rate --learning_rate=..." in message
    assert not (out / "metrics.json").exists()
    step = int(message.split("at step ")[1].split(":")[0])
    assert 0 < step < 200
    for name in ("ckpt.pt", "best.pt"):
        checkpoint = torch.load(out / name, weights_only=True)
        assert checkpoint["iter_num"] == 0
        assert all(torch.isfinite(v).all() for v in checkpoint["model"].values())
    # the command the message suggests goes on (a resume refused without --resume_changes, issue 43's case 8)
    result = train(str(out), data_dir, "--learning_rate=1e-3", "--max_iters=4", "--lr_decay_iters=200",
                   "--init_from=resume", "--resume_changes=learning_rate", check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_divergence_before_the_first_checkpoint_names_none(tmp_path):
    """A run that diverges before it wrote any checkpoint (at its step-0 evaluation): the message says
    that nothing was saved and how to start again, not a 'ckpt.pt (step None)' that does not exist."""
    import torch

    import run
    from objective import Objective
    from model import GPT, GPTConfig
    from errors import UserError
    modules = torch.nn.ModuleDict({"model": GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4)),
                                   "objective": Objective(1, 4)})
    files = run.RunFiles(str(tmp_path), modules, [], "none", True, "cpu", 1e-3)
    with pytest.raises(UserError) as stop:
        files.stop_if_diverged({"val": float("nan")}, "validation", 0)
    message = str(stop.value)
    assert stop.value.status == 1 and len(message.splitlines()) == 1
    assert "training diverged at step 0: non-finite val (validation)" in message
    assert "No checkpoint was written before it" in message and "--overwrite=True" in message
    assert "None" not in message and "ckpt" not in message


@pytest.mark.slow
def test_a_fresh_run_never_replaces_an_existing_one(tmp_path, data_dir):
    """Forgetting --init_from=resume must not lose a run: the fresh run refuses, one line says how
    to go on, and no file of the old run changes; --overwrite=True starts over on purpose."""
    out = tmp_path / "run"
    train(str(out), data_dir, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4")
    names = sorted(n for n in os.listdir(out) if n != "run.lock")  # the run's files (run.lock names its holder)
    before = {name: (out / name).read_bytes() for name in names}
    result = train(str(out), data_dir, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", check=False)
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: {out} already holds a run (") and "--init_from=resume" in message
    assert "--overwrite=True" in message
    assert sorted(os.listdir(out)) == names + ["run.lock"]
    assert {name: (out / name).read_bytes() for name in names} == before
    (out / ".ckpt.pt.k3j2x.tmp").write_bytes(b"half a checkpoint")  # what a killed write leaves
    train(str(out), data_dir, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--overwrite=True", "--seed=7")
    assert not any(name.endswith(".tmp") for name in os.listdir(out))
    assert read_log(str(out))[0]["iter"] == 0 and max(r["iter"] for r in read_log(str(out))) == 4  # one run's log
    assert (out / "metrics.json").read_bytes() != before["metrics.json"]


@pytest.mark.slow
def test_resume_drops_a_torn_last_log_line(tmp_path, data_dir):
    """A kill in the middle of a log write leaves half a line: resume still works, from ckpt.pt."""
    out = tmp_path / "torn"
    train(str(out), data_dir, "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4")
    with open(out / "log.jsonl", "a") as f:
        f.write('{"iter": 4, "loss": 1.2')
    result = train(str(out), data_dir, "--max_iters=6", "--eval_interval=2", "--lr_decay_iters=4", "--init_from=resume")
    assert "torn line" in result.stdout
    assert [r["iter"] for r in read_log(str(out)) if "val" in r] == [0, 2, 4, 6]
