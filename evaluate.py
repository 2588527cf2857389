"""
Evaluate a saved checkpoint with the metrics of Stop Jostling (Sec. 4.3, Table 1):

    python evaluate.py out/lowres_baseline/best.pt    # prints, and writes eval_best.json beside it
    python evaluate.py run/best.pt --data_dir=/data/shakespeare_char --out=scores.json

The validation split is cut into non-overlapping blocks of block_size tokens and scored twice,
as is (HR) and with every id shifted into the low-resource language (LR), with the full softmax
over both languages and no thresholding. Per language: PPL, PPL_best over temperatures (with
T_best), accuracy, Recall@5, MRR and the isotropy I(W) of that language's output-embedding rows
(ours, well defined, and the authors' way, which the paper's numbers used: metrics.isotropy_authors);
plus I(W) of all rows and the cross-language "translation" figures of the embedding, and the
geometry of the hidden states (condensation: mean pairwise cosine per depth, its rank correlation
with depth, the final states' mean cosine and their SimReg value).
train.py calls evaluate_checkpoint() on best.pt at the end of every run and writes metrics.json;
this script never replaces an existing file unless told to (--overwrite), and when it does replace
a run's metrics.json it keeps the FLOP counts of the run's training.
"""

import argparse
import json
import math
import os
import signal
import sys

import numpy as np
import torch

import checkpoint as checkpoints
import metrics
import parallelism
from data import DataError, load_tokens, read_windows, sample_windows
from losses import linear_cross_entropy, simreg
from model import GPT, GPTConfig
from errors import UserError, end_with
from utils import (PathError, check_writable, choose_device, keep_freed_memory, save_json, widest_float,
                   write_failure)


def load_model(path, device="cpu"):
    """The model of a checkpoint written by train.py (best.pt or ckpt.pt, an FSDP run's too);
    CheckpointError names the file when it is missing, a directory, damaged or not ours.
    The process holds one copy of the weights: the model is built on the meta device (no memory,
    no random init) and takes the checkpoint's tensors themselves (assign), which stay memory-mapped
    from the file on the CPU."""
    checkpoint = checkpoints.load_with_weights(path, "cpu", mmap=True)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_checkpoint(checkpoint["model_config"]))
    model.load_state_dict(checkpoint["model"], assign=True)
    model.tie_weights()  # assign gave the tied matrix two parameters
    return model.to(device).eval(), checkpoint


def val_blocks(data_dir, block_size):
    """Non-overlapping (inputs, targets) blocks covering the whole val split: block i reads
    tokens [i*T, (i+1)*T) and predicts [i*T+1, (i+1)*T+1)."""
    data = torch.from_numpy(load_tokens(data_dir, "val", block_size).astype(np.int64))
    n_blocks = (len(data) - 1) // block_size
    x = data[: n_blocks * block_size].view(n_blocks, block_size)
    y = data[1: n_blocks * block_size + 1].view(n_blocks, block_size)
    return x, y


def prediction_metrics(logits, targets):
    """PPL, PPL_best at t_best and the rank metrics of logits (N, V) held in memory (char runs)."""
    ppl_best, t_best = metrics.best_temperature_perplexity(logits, targets)
    return {"ppl": metrics.perplexity(logits, targets), "ppl_best": ppl_best, "t_best": t_best,
            **metrics.rank_metrics(logits, targets)}


STREAM_ABOVE = 2 ** 24  # logits elements (64 MB in fp32) beyond which evaluation streams (GPT-2 BPE)
RARE_MAX_COUNT = 10  # a val target is "rare" if it occurs at most this often in the train split


def rare_targets(data_dir, targets):
    """Which val targets are rare: seen at most RARE_MAX_COUNT times in the training split. With
    GPT-2 BPE on tiny Shakespeare that is 11 % of val positions (2 % never seen at all): the long
    tail that Stop Jostling says a tied embedding marginalizes, on a natural vocabulary."""
    train = load_tokens(data_dir, "train", 1)
    files = getattr(train, "files", [train])  # per-shard files (prepare_c4.py): counted file by file
    counts = torch.from_numpy(sum(np.bincount(f, minlength=int(targets.max()) + 1) for f in files))
    return counts[targets] <= RARE_MAX_COUNT


def tail_sums(logits, targets, mask):
    """Sums over the positions in mask (for the rare-target metrics, chunk by chunk): tokens,
    top-1 hits, reciprocal ranks (metrics.target_ranks) and NLL at temperature 1."""
    z, t, wide = logits[mask].float(), targets[mask], widest_float(logits.device)
    rank = metrics.target_ranks(z, t).to(wide)
    nll = torch.logsumexp(z, dim=1).to(wide) - z.gather(1, t.view(-1, 1)).squeeze(1).to(wide)
    return torch.stack([torch.tensor(float(len(t)), dtype=wide, device=z.device), (rank == 1).to(wide).sum(),
                        (1.0 / rank).sum(), nll.sum()])


def tail_nll_at(logits, targets, b):
    """Sum of the targets' NLL under softmax(b z) over these rows: the rare targets at the
    temperature 1/b that is best for all tokens (PPL_best's t_best), the rule a PPL_best claim uses."""
    z = logits.float() * b
    nll = torch.logsumexp(z, dim=1) - z.gather(1, targets.view(-1, 1)).squeeze(1)
    return float(nll.to(widest_float(z.device)).sum())


def tail_metrics(sums, n_total, nll_at_t_best=None):
    """tail_sums added up -> the rare-target metrics (None when there is no rare target);
    nll_at_t_best (tail_nll_at's sum at the overall t_best) adds their PPL there."""
    tokens, hits, reciprocal, nll = sums.tolist()
    if tokens == 0:
        return None
    return {"tokens": int(tokens), "fraction": tokens / n_total, "accuracy": hits / tokens,
            "mrr": reciprocal / tokens, "ppl": math.exp(nll / tokens),
            **({} if nll_at_t_best is None else {"ppl_at_t_best": math.exp(nll_at_t_best / tokens)})}


@torch.no_grad()
def streamed_prediction_metrics(lm_head, finals, targets, chunk=1024, rare=None):
    """prediction_metrics without ever holding all (N, V) logits (a 50304-token vocabulary): the
    logits are recomputed chunk by chunk from the final normed states (N, C). PPL, accuracy,
    Recall@5 and MRR are means over tokens, so chunk means weighted by chunk size give them
    exactly. PPL_best and t_best come from the same Newton's method on b = 1/T as in memory
    (metrics.best_inverse_temperature), each of its passes one pass of the LM head over the
    chunks. The first pass (T = 1) also gives PPL, the rank metrics and, for the positions where
    rare (N,) bool is True, the rare-target metrics ("rare", tail_metrics), so no pass is added
    for them. "head_passes": how many times the LM head went over all N states. lm_head must
    return a new tensor on each call: the passes overwrite it."""
    n = len(targets)
    rare = torch.zeros(n, dtype=torch.bool) if rare is None else rare
    chunks = [(finals[i:i + chunk], targets[i:i + chunk], rare[i:i + chunk]) for i in range(0, n, chunk)]
    # sums on the CPU, in its widest float
    rank_sums, rare_sums, log_ppl = {}, torch.zeros(4, dtype=widest_float("cpu")), None

    def means_at(b):
        nonlocal log_ppl
        first = log_ppl is None  # the first pass (T = 1): also what needs only the plain logits
        total = torch.zeros(3, dtype=widest_float("cpu"))
        for states, t, r in chunks:
            z = lm_head(states).float()
            if first:
                for key, value in metrics.rank_metrics(z, t).items():
                    rank_sums[key] = rank_sums.get(key, 0.0) + value * len(t)
                rare_sums.add_(tail_sums(z, t, r))
            total += metrics.temperature_nll_sums(z, t, b, overwrite=True)  # z is ours to overwrite
        means = (total / n).tolist()
        if first:
            log_ppl = means[0]
        return means

    log_ppl_best, b_best, passes = metrics.best_inverse_temperature(means_at, b=1.0)
    # the rare targets at t_best: the LM head once more, over their rows only
    rare_nll = sum(tail_nll_at(lm_head(states[r]), t[r], b_best) for states, t, r in chunks if r.any())
    return {"ppl": math.exp(log_ppl), "ppl_best": math.exp(log_ppl_best), "t_best": 1.0 / b_best,
            **{k: rank_sums[k] / n for k in ("accuracy", "recall_at_5", "mrr")},
            "head_passes": passes + int(rare.sum()) / n, "rare": tail_metrics(rare_sums, n, rare_nll)}


@torch.no_grad()
def forward_val(model, x, y, device, batch_size=256, keep_logits=True):
    """One pass over the blocks x (N, T) with next-token labels y (N, T). Returns the float32
    logits (N*T, V) on the CPU -- or, with keep_logits=False, the final normed states (N*T, C)
    they are computed from -- and the hidden-state geometry:
      mu            mean pairwise cosine mu(l) per depth l = 0 (embedding output), 1..L (blocks),
                    all T^2 pairs of a sequence, averaged over sequences (dispersion paper, Fig. 2)
      spearman_rho, kendall_tau   rank correlation of mu(l) with l over the blocks l = 1..L
                    (positive: states condense with depth)
      cosine_histograms           per depth, the fraction of pair cosines in 40 bins over [-1, 1]
      final_cosine  mean pairwise cosine of the final normed states (what the LM head sees)
      simreg_final  SimReg (tau = 0.01) of the final normed states: ~1e-2 on a CE-only model per
                    the SimReg paper, far lower when trained with it"""
    L = model.config.n_layer
    mu, hists = [0.0] * (L + 2), [[0.0] * 40 for _ in range(L + 2)]  # Python floats: no float64 tensor
    simreg_sum, all_logits = 0.0, []
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        logits, hidden = model(xb, return_hidden_states=True, compute_logits=keep_logits)
        all_logits.append(logits.float().cpu() if keep_logits else hidden[-1].float().cpu())
        weight = len(xb) / len(x)
        for depth, z in enumerate(hidden[:L + 1] + [hidden[-1]]):
            m, h = metrics.pairwise_cosine_stats(z.float())
            mu[depth] += weight * m
            hists[depth] = [a + weight * b for a, b in zip(hists[depth], h)]
        simreg_sum += weight * simreg(hidden[-1].float(), yb).item()
    depths = list(range(1, L + 1))
    logits = torch.cat(all_logits).flatten(0, 1)
    rho, tau = metrics.spearman(mu[1:L + 1], depths), metrics.kendall(mu[1:L + 1], depths)
    return logits, {"mu": mu[:L + 1],  # undefined correlations (one block) are written as null
            "spearman_rho": None if math.isnan(rho) else rho, "kendall_tau": None if math.isnan(tau) else tau,
            "final_cosine": mu[L + 1],
            "simreg_final": simreg_sum, "cosine_histograms": hists[:L + 1]}


@torch.no_grad()
def evaluate_model(model, data_dir, low_resource, itos, device="cpu"):
    """The metrics of Stop Jostling (Sec. 4.3) on the whole val split, plus "flops": the matmul
    FLOPs this evaluation executed (forward passes, and the LM head's extra passes when
    streamed), for the comparison grids' efficiency figure (tools/report.py)."""
    x, y = val_blocks(data_dir, model.config.block_size)
    W = model.output_embedding().detach().float().cpu()
    forward_flops = x.numel() * model.flops_per_token(backward=False)
    if not low_resource:  # one language; a natural vocabulary: the rare targets get their own metrics
        rare = rare_targets(data_dir, y.reshape(-1))
        if x.numel() * model.config.vocab_size <= STREAM_ABOVE:
            logits, geometry = forward_val(model, x, y, device)
            scores = prediction_metrics(logits, y.reshape(-1))
            rare_nll = (tail_nll_at(logits[rare], y.reshape(-1)[rare], 1 / scores["t_best"]) if rare.any()
                        else 0.0)
            scores["rare"] = tail_metrics(tail_sums(logits, y.reshape(-1), rare), rare.numel(), rare_nll)
            flops = forward_flops
        else:  # too many logits to hold at once (GPT-2 BPE): keep the final states instead
            finals, geometry = forward_val(model, x, y, device, batch_size=32, keep_logits=False)
            scores = streamed_prediction_metrics(lambda h: model.lm_head(h.to(device)).cpu(), finals,
                                                 y.reshape(-1), rare=rare)
            head_flops = 2 * model.config.n_embd * model.config.vocab_size * x.numel()
            flops = forward_flops - head_flops + scores.pop("head_passes") * head_flops
        rare_scores = scores.pop("rare")
        return {"val": {**scores, "isotropy": metrics.isotropy(W)}, "geometry": {"val": geometry},
                "flops": flops, **({"rare": rare_scores} if rare_scores else {})}
    shift = len(itos)
    result = {"geometry": {}, "flops": 2 * forward_flops}  # scored twice: HR and LR
    for lang, offset in (("high", 0), ("low", shift)):
        logits, result["geometry"][lang] = forward_val(model, x + offset, y + offset, device)
        rows = W[offset:offset + shift]
        result[lang] = {**prediction_metrics(logits, (y + offset).reshape(-1)),
                        "isotropy": metrics.isotropy(rows),
                        "isotropy_authors": metrics.isotropy_authors(rows)}
    result["isotropy_all"] = metrics.isotropy(W)
    E = model.input_embedding().detach().float().cpu()
    result["translations"] = metrics.translation_metrics(E, itos, shift)
    return result


@torch.no_grad()
def validation_losses(model, objective, val_data, batch_size, block_size, eval_iters, shift,
                      low_resource_prob, device, autocast, rank=0, world_size=1, stop_pending=None):
    """train.py's evaluation during training. Cross-entropy (never thresholded) on the same
    eval_iters validation batches every time (a fixed generator), in both languages. 'val' is the
    loss on the mixed batches, each window in the low-resource language with probability
    low_resource_prob, as in training; it is assembled from the per-window HR and LR losses, so it
    costs no extra forward pass. The other active loss terms are evaluated on the same mixed batches
    ('val_<term>'), their states picked per window from the HR and LR passes (windows do not attend
    to each other). A run without CE (headless) keeps the checkpoint with the best weighted sum of
    its terms instead. The RNG is forked so that evaluation never changes the training run's random
    stream.
    Under torchrun (rank, world_size) the batches are split over the ranks, batch i to rank
    i % world_size, and one sum over the ranks puts every batch's losses together: each value
    comes from one rank, the others add zeros, so the figures are exactly those of one process
    evaluating every batch (collective: every rank runs the same number of forward passes, a
    rank whose share is short repeats the last batch and discards it).
    shift > 0: the low-resource language's id offset (0: one language). Returns {"val", "val_high",
    "val_low" (two languages), "val_<term>" (each other active term; "val_ce" when headless),
    "twin_cos", "twin_top3" (two languages, char vocabulary: metrics.twin_alignment)}, or None when
    stop_pending() (a stop signal: utils.StopRequest) became true on any rank before its last batch: the
    evaluation is abandoned between batches, with nothing of it returned."""
    low_resource, on_cuda = shift > 0, str(device).startswith("cuda")
    model.eval()
    generator = torch.Generator().manual_seed(0)
    languages = (("high", 0), ("low", shift)) if low_resource else (("high", 0),)
    chunk = objective.config.ce_chunk_size  # > 0: no whole logits (losses.linear_cross_entropy)
    aux = [name for name, weight in objective.weights.items() if weight and name != "ce"]
    B = batch_size
    # every batch's draw on every rank (cheap: window starts and language picks), the same everywhere
    draws = [(sample_windows(len(val_data), block_size, B, generator),
              torch.rand(B, generator=generator) < low_resource_prob) for _ in range(eval_iters)]
    # row i: batch i's window losses in each language and its other terms, from the rank that evaluated it
    results = torch.zeros(eval_iters, 2 * B + len(aux), device=device)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if on_cuda else []):
        for i in range(rank, math.ceil(eval_iters / world_size) * world_size, world_size):
            if stop_pending is not None and parallelism.max_over_processes(bool(stop_pending())):
                model.train()
                return None
            windows, is_low = draws[min(i, eval_iters - 1)]
            x, y = read_windows(val_data, *windows, block_size, shift, device)
            row = torch.zeros(2 * B + len(aux), device=device)
            passes = {}
            for k, (lang, offset) in enumerate(languages):
                with autocast:
                    passes[lang] = model(x + offset, return_hidden_states=bool(aux) or chunk > 0,
                                         compute_logits=not chunk)
                    if chunk:  # the head and the loss a chunk of positions at a time, as in training
                        row[k * B:(k + 1) * B] = linear_cross_entropy(
                            passes[lang][1][-1], model.output_embedding(), y + offset, chunk_size=chunk,
                            reduction="none").view(B, -1).mean(1)
                        continue
                logits = passes[lang][0] if aux else passes[lang]
                # a window at a time: beside the logits only one window's log-softmax is held, not the
                # batch's (at a 50304-token vocabulary the batch's would make evaluation the run's peak)
                row[k * B:(k + 1) * B] = torch.stack([
                    torch.nn.functional.cross_entropy(window.float(), targets, reduction="none").mean()
                    for window, targets in zip(logits, y + offset)])
            if aux:
                logits, hidden = passes["high"]
                if low_resource:
                    pick = is_low.to(device).view(-1, 1, 1)
                    logits = None if chunk else torch.where(pick, passes["low"][0], logits)
                    hidden = [torch.where(pick, low_h, high_h)
                              for low_h, high_h in zip(passes["low"][1], hidden)]
                with autocast:
                    _, terms = objective(logits, hidden, y + shift * is_low.to(device).unsqueeze(1),
                                         model.embeddings())
                row[2 * B:] = torch.stack([terms[name].float() for name in aux])
            if i < eval_iters:
                results[i] = row
    model.train()
    results = parallelism.sum_over_processes(results).cpu()
    high, low = results[:, :B].reshape(-1), results[:, B:2 * B].reshape(-1)
    out = {"val_high": high.mean().item()}
    if low_resource:
        out["val_low"] = low.mean().item()
        out["val"] = torch.where(torch.cat([is_low for _, is_low in draws]), low, high).mean().item()
    else:
        out["val"] = out["val_high"]
    term_sums = dict.fromkeys(aux, 0.0)
    for batch_terms in results[:, 2 * B:].tolist():  # summed in batch order, as one process adds them
        for name, value in zip(aux, batch_terms):
            term_sums[name] += value / eval_iters
    out.update({f"val_{name}": value for name, value in term_sums.items()})
    if low_resource and 2 * shift <= 4096:  # the LR rows' alignment with their HR twins (a char vocabulary's
        embedding = model.input_embedding()  # 2V x 2V cosines are cheap; a BPE table's are not)
        full = embedding.full_tensor() if hasattr(embedding, "full_tensor") else embedding
        out.update(metrics.twin_alignment(full, shift))
    if not objective.trains_head:
        out["val_ce"] = out["val"]
        out["val"] = sum(objective.weights[name] * value for name, value in term_sums.items())
    return out


def with_run_flops(result, run_flops):
    """The evaluation's result with the FLOPs its run executed (train, eval) beside its own final
    evaluation, and their total: what metrics.json records."""
    flops = {**{k: v for k, v in run_flops.items() if k not in ("final_eval", "total")},
             "final_eval": result["flops"]["final_eval"]}
    return {**result, "flops": {**flops, "total": sum(flops.values())}}


def flops_of_run(checkpoint_path, out):
    """The FLOPs a run executed (its ckpt.pt's flops_done) when `out` is the metrics.json of the run
    that checkpoint_path belongs to (the command a cut-short final evaluation prints), else None."""
    run_dir = os.path.dirname(os.path.abspath(checkpoint_path))
    ckpt = os.path.join(run_dir, "ckpt.pt")
    if os.path.abspath(out) != os.path.join(run_dir, "metrics.json") or not os.path.isfile(ckpt):
        return None
    try:
        return checkpoints.load(ckpt, need=(), mmap=True).get("flops_done")
    except checkpoints.CheckpointError:
        return None


def evaluate_checkpoint(path, device="cpu", data_dir=None):
    """data_dir: where the checkpoint's dataset is, if not where the run found it."""
    model, checkpoint = load_model(path, device)
    config = checkpoint["config"]
    data_dir = checkpoints.data_dir_of(checkpoint, path, data_dir)
    result = evaluate_model(model, data_dir, config["low_resource"], checkpoint["meta"].get("itos"), device)
    result["checkpoint"] = {"path": path, "iter": checkpoint["iter_num"],
                            "val_loss": checkpoint["best_val_loss"]}
    result["flops"] = {"final_eval": result["flops"], "total": result["flops"]}  # train.py adds its own
    return result


def write_run_metrics(out_dir, run_flops, device, stopped_by=None):
    """The end of a finished train.py run: score its best.pt, add the FLOPs the whole run executed
    (all processes, evaluations included: tools/runner.py sums them over a grid), write
    out_dir/metrics.json and print the table. Ctrl-C here, or a stop signal in the run's last step or
    after it (stopped_by: its name), leaves training complete: say in one line how to write metrics.json
    later (the same figures, the run's FLOPs from ckpt.pt: flops_of_run), exit 128 + the signal."""
    best_path, metrics_path = os.path.join(out_dir, "best.pt"), os.path.join(out_dir, "metrics.json")
    later = (f"training is complete ({os.path.join(out_dir, 'ckpt.pt')}, {best_path}): "
             f"python evaluate.py {best_path} --out={metrics_path} writes metrics.json")
    if stopped_by is not None:
        print(f"{stopped_by} at the end of training: no final evaluation; {later}", file=sys.stderr)
        sys.exit(128 + signal.Signals[stopped_by])
    try:
        result = evaluate_checkpoint(best_path, device=device)
    except KeyboardInterrupt:
        print(f"interrupted during the final evaluation; {later}", file=sys.stderr)
        sys.exit(130)
    except (checkpoints.CheckpointError, DataError) as e:  # best.pt damaged since written, its data moved
        ckpt = os.path.join(out_dir, "ckpt.pt")
        raise UserError(f"the final evaluation: {e}; training is complete ({ckpt}): python evaluate.py "
                        f"{ckpt} --out={metrics_path} scores its latest weights instead") from None
    result = with_run_flops(result, run_flops)
    try:
        save_json(result, metrics_path)
    except OSError as e:  # a full disk at the very end: training is complete all the same
        raise PathError(f"{write_failure(metrics_path, e)}; training is complete: python evaluate.py "
                        f"{best_path} --out={metrics_path} writes it later") from None
    print(format_metrics(result))


def marginalization_report(parts, train_data, shift, itos):
    """Stop Jostling's gradient ratios for the low-resource rows, rarest first.
    parts (S, 3, V): per training step, the norms of each embedding row's gradient from its use
    as input, as target and as non-target (metrics.embedding_gradient_part_vectors)."""
    V = parts.size(-1)
    ratios = metrics.marginalization_ratios(parts[:, 0], parts[:, 1], parts[:, 2])
    counts = torch.bincount(train_data, minlength=shift)  # LR windows reuse the same text
    rows = []
    for i in sorted(range(shift), key=lambda i: (counts[i].item(), i)):
        r = shift + i if V == 2 * shift else i
        rows.append({"char": itos[i], "id": r, "train_count": counts[i].item(),
                     "ratio_of_average": ratios["ratio_of_average"][r].item(),
                     "average_of_ratio": ratios["average_of_ratio"][r].item()})
    roa = torch.tensor([row["ratio_of_average"] for row in rows])
    aor = torch.tensor([row["average_of_ratio"] for row in rows])
    return {"steps": parts.size(0),
            "mean_ratio_of_average": roa.nanmean().item(), "mean_average_of_ratio": aor.nanmean().item(),
            "n_ratio_of_average_below_1": int((roa < 1).sum()),
            "n_average_of_ratio_below_1": int((aor < 1).sum()),
            "tokens_rarest_first": rows}


def format_metrics(result):
    langs = [k for k in ("high", "low", "val") if k in result]
    keys = [k for k in ("ppl", "ppl_best", "t_best", "accuracy", "recall_at_5", "mrr", "isotropy",
                        "isotropy_authors") if k in result[langs[0]]]
    lines = ["metric       " + "".join(f"{lang:>10}" for lang in langs)]
    for key in keys:
        lines.append(f"{key:<13}" + "".join(f"{result[lang][key]:>10.4f}" for lang in langs))
    if result.get("rare"):
        r = result["rare"]
        lines.append(f"rare targets (seen <= {RARE_MAX_COUNT}x in train, {r['fraction']:.1%} of val): "
                     f"ppl {r['ppl']:.2f} | accuracy {r['accuracy']:.4f} | mrr {r['mrr']:.4f}")
    for lang, g in result.get("geometry", {}).items():
        lines.append(f"geometry {lang}: mu(l) " + " ".join(f"{m:.3f}" for m in g["mu"]) +
                     " | spearman " + ("n/a" if g["spearman_rho"] is None else f"{g['spearman_rho']:.2f}") +
                     " kendall " + ("n/a" if g["kendall_tau"] is None else f"{g['kendall_tau']:.2f}") +
                     f" | final cos {g['final_cosine']:.3f} | simreg {g['simreg_final']:.2e}")
    if "translations" in result:
        t = result["translations"]
        lines.append(f"isotropy_all {result['isotropy_all']:.4f} | twin in top-3: "
                     f"{t['twin_top3_fraction']:.3f} | 12 cases: {t['cases_12']} "
                     f"| letters: {t['cases_letters']}/{t['cases_letters_total']}")
    return "\n".join(lines)


def main(argv=None):
    """Score a checkpoint and write its metrics; a problem the user can fix is a UserError."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="path to a checkpoint written by train.py (best.pt or ckpt.pt)")
    parser.add_argument("--out", default=None,
                        help="where to write the metrics (default: eval_<name>.json beside it)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--data_dir", default=None, help="the dataset, if not where the run found it")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    keep_freed_memory()
    stem = os.path.splitext(os.path.basename(args.checkpoint.rstrip("/")))[0]
    out = args.out or os.path.join(os.path.dirname(args.checkpoint.rstrip("/")), f"eval_{stem}.json")
    if os.path.exists(out) and not args.overwrite:
        raise UserError(f"{out} exists; pass --overwrite to replace it or --out to write elsewhere")
    # (no checkpoint: say that, not where its output goes)
    if args.out or os.path.exists(args.checkpoint):
        check_writable(out, "--out" if args.out else "the output")  # now, not after the evaluation
    try:
        result = evaluate_checkpoint(args.checkpoint, choose_device(args.device), args.data_dir)
    except ValueError as e:  # a --device this machine does not have, a checkpoint of another kind
        raise UserError(str(e)) from None
    previous = {}
    if os.path.exists(out):
        try:
            with open(out) as f:
                previous = json.load(f)
        except ValueError:
            pass
    # a run's metrics.json: keep its FLOPs; its first metrics.json: from ckpt.pt
    if isinstance(previous, dict) and "train" in previous.get("flops", {}):
        result = with_run_flops(result, previous["flops"])
    elif (run_flops := flops_of_run(args.checkpoint, out)) is not None:
        result = with_run_flops(result, run_flops)
    try:
        save_json(result, out)
        failure = None
    except OSError as e:  # the disk filled during the evaluation: the figures still reach the screen
        failure = write_failure(out, e)
    print(format_metrics(result))
    print(json.dumps(result["checkpoint"]))
    if failure:
        raise PathError(failure)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # the one place a problem the user can fix ends the process
        end_with(e)
