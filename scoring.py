"""Scoring a model on its dataset's val split: train.py's evaluation
(validation_losses) and the final metrics of Stop Jostling (Sec. 4.3,
Table 1) that evaluate.py and the end of a run write (evaluate_model,
write_run_metrics), from metrics.py's functions.

Design notes: docs/metrics.md
"""

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
from errors import UserError
from losses import linear_cross_entropy, simreg
from utils import PathError, save_json, widest_float, write_failure


def val_blocks(data_dir, block_size):
    """Non-overlapping (inputs, targets) blocks covering the val split:
    block i reads tokens [i*T, (i+1)*T) and predicts the next ones."""
    tokens = load_tokens(data_dir, "val", block_size)
    data = torch.from_numpy(tokens.astype(np.int64))
    n = (len(data) - 1) // block_size * block_size
    x = data[:n].view(-1, block_size)
    y = data[1:n + 1].view(-1, block_size)
    return x, y


def prediction_metrics(logits, targets):
    """PPL, PPL_best at t_best and the rank metrics of logits (N, V)
    held in memory (char runs)."""
    ppl_best, t_best = metrics.best_temperature_perplexity(logits, targets)
    return {"ppl": metrics.perplexity(logits, targets),
            "ppl_best": ppl_best, "t_best": t_best,
            **metrics.rank_metrics(logits, targets)}


# logits elements (64 MB in fp32) beyond which evaluation streams
STREAM_ABOVE = 2 ** 24
# a val target is "rare" if seen at most this often in the train split
RARE_MAX_COUNT = 10


def rare_targets(data_dir, targets):
    """Which val targets are rare (seen <= RARE_MAX_COUNT times in the
    training split): the long tail a tied embedding marginalizes."""
    train = load_tokens(data_dir, "train", 1)
    # per-shard files (prepare_c4.py): counted file by file
    files = getattr(train, "files", [train])
    size = int(targets.max()) + 1
    counts = sum(np.bincount(f, minlength=size) for f in files)
    return torch.from_numpy(counts)[targets] <= RARE_MAX_COUNT


def tail_sums(logits, targets, mask):
    """Sums over the positions in mask, for the rare-target metrics:
    tokens, top-1 hits, reciprocal ranks and NLL at temperature 1."""
    z = logits[mask].float()
    t = targets[mask]
    wide = widest_float(logits.device)
    rank = metrics.target_ranks(z, t).to(wide)
    z_y = z.gather(1, t.view(-1, 1)).squeeze(1).to(wide)
    nll = torch.logsumexp(z, dim=1).to(wide) - z_y
    tokens = torch.tensor(float(len(t)), dtype=wide, device=z.device)
    return torch.stack([tokens, (rank == 1).to(wide).sum(),
                        (1.0 / rank).sum(), nll.sum()])


def tail_nll_at(logits, targets, b):
    """The targets' summed NLL under softmax(b z): the rare targets at
    the overall best temperature 1/b."""
    z = logits.float() * b
    nll = torch.logsumexp(z, dim=1) - z.gather(1, targets.view(-1, 1)).squeeze(1)
    return float(nll.to(widest_float(z.device)).sum())


def tail_metrics(sums, n_total, nll_at_t_best):
    """tail_sums added up -> the rare-target metrics (None without a
    rare target), with their PPL at t_best from tail_nll_at's sum."""
    tokens, hits, reciprocal, nll = sums.tolist()
    if tokens == 0:
        return None
    return {"tokens": int(tokens), "fraction": tokens / n_total,
            "accuracy": hits / tokens, "mrr": reciprocal / tokens,
            "ppl": math.exp(nll / tokens),
            "ppl_at_t_best": math.exp(nll_at_t_best / tokens)}


@torch.no_grad()
def streamed_prediction_metrics(lm_head, finals, targets, chunk=1024,
                                rare=None):
    """prediction_metrics without holding all (N, V) logits: lm_head
    recomputes them by chunks from the final normed states (N, C) (a new
    tensor each call: the passes overwrite it), one pass a Newton step.
    "rare": the metrics of the positions where rare (N,) bool is True.
    "head_passes": passes over all N states."""
    n = len(targets)
    if rare is None:
        rare = torch.zeros(n, dtype=torch.bool)
    chunks = [(finals[i:i + chunk], targets[i:i + chunk], rare[i:i + chunk])
              for i in range(0, n, chunk)]
    wide = widest_float("cpu")  # the sums: on the CPU
    rank_sums = {}
    rare_sums = torch.zeros(4, dtype=wide)
    log_ppl = None

    def means_at(b):
        nonlocal log_ppl
        first = log_ppl is None  # T = 1: also what needs plain logits
        total = torch.zeros(3, dtype=wide)
        for states, t, r in chunks:
            z = lm_head(states).float()
            if first:
                for key, value in metrics.rank_metrics(z, t).items():
                    rank_sums[key] = rank_sums.get(key, 0.0) + value * len(t)
                rare_sums.add_(tail_sums(z, t, r))
            total += metrics.temperature_nll_sums(z, t, b, overwrite=True)
        means = (total / n).tolist()
        if first:
            log_ppl = means[0]
        return means

    log_ppl_best, b_best, passes = metrics.best_inverse_temperature(means_at)
    # the rare targets at t_best: the head once more, over their rows only
    rare_nll = sum(tail_nll_at(lm_head(states[r]), t[r], b_best)
                   for states, t, r in chunks if r.any())
    return {"ppl": math.exp(log_ppl), "ppl_best": math.exp(log_ppl_best),
            "t_best": 1.0 / b_best,
            **{k: rank_sums[k] / n for k in ("accuracy", "recall_at_5", "mrr")},
            "head_passes": passes + int(rare.sum()) / n,
            "rare": tail_metrics(rare_sums, n, rare_nll)}


@torch.no_grad()
def forward_val(model, x, y, device, batch_size=256, keep_logits=True):
    """One pass over the blocks x (N, T), labels y (N, T). Returns the
    float32 logits (N*T, V) on the CPU (keep_logits=False: the final
    normed states (N*T, C)) and the geometry (dispersion paper, Fig. 2):
    mu, the mean pairwise cosine mu(l) per depth l = 0 (embedding
    output), 1..L over all T^2 pairs of a sequence; spearman_rho and
    kendall_tau of mu(l) with l = 1..L (positive: states condense with
    depth); cosine_histograms (40 bins per depth); final_cosine and
    simreg_final (SimReg, tau = 0.01) of the final normed states."""
    L = model.config.n_layer
    mu = [0.0] * (L + 2)  # Python floats: no float64 tensor
    hists = [[0.0] * 40 for _ in range(L + 2)]
    simreg_sum = 0.0
    outputs = []
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size].to(device)
        yb = y[i:i + batch_size].to(device)
        logits, hidden = model(xb, return_hidden_states=True,
                               compute_logits=keep_logits)
        out = logits if keep_logits else hidden[-1]
        outputs.append(out.float().cpu())
        weight = len(xb) / len(x)
        for depth, z in enumerate(hidden[:L + 1] + [hidden[-1]]):
            m, h = metrics.pairwise_cosine_stats(z.float())
            mu[depth] += weight * m
            hists[depth] = [a + weight * b for a, b in zip(hists[depth], h)]
        simreg_sum += weight * simreg(hidden[-1].float(), yb).item()
    depths = list(range(1, L + 1))
    rho = metrics.spearman(mu[1:L + 1], depths)
    tau = metrics.kendall(mu[1:L + 1], depths)
    # undefined correlations (one block) are written as null
    return torch.cat(outputs).flatten(0, 1), {
        "mu": mu[:L + 1],
        "spearman_rho": None if math.isnan(rho) else rho,
        "kendall_tau": None if math.isnan(tau) else tau,
        "final_cosine": mu[L + 1],
        "simreg_final": simreg_sum,
        "cosine_histograms": hists[:L + 1]}


@torch.no_grad()
def evaluate_model(model, data_dir, low_resource, itos, device="cpu"):
    """The metrics of Stop Jostling (Sec. 4.3) on the whole val split,
    plus "flops": the matmul FLOPs this evaluation executed."""
    x, y = val_blocks(data_dir, model.config.block_size)
    targets = y.reshape(-1)
    W = model.lm_head.weight.detach().float().cpu()
    forward_flops = x.numel() * model.flops_per_token(backward=False)
    if low_resource:  # two languages: each scored on the whole split
        shift = len(itos)
        result = {"geometry": {}, "flops": 2 * forward_flops}
        for lang, offset in (("high", 0), ("low", shift)):
            logits, result["geometry"][lang] = forward_val(
                model, x + offset, y + offset, device)
            rows = W[offset:offset + shift]
            result[lang] = {
                **prediction_metrics(logits, targets + offset),
                "isotropy": metrics.isotropy(rows),
                "isotropy_authors": metrics.isotropy_authors(rows)}
        result["isotropy_all"] = metrics.isotropy(W)
        E = model.wte.weight.detach().float().cpu()
        result["translations"] = metrics.translation_metrics(E, itos, shift)
        return result
    # one language, a natural vocabulary: rare targets get own metrics
    rare = rare_targets(data_dir, targets)
    if x.numel() * model.config.vocab_size <= STREAM_ABOVE:
        logits, geometry = forward_val(model, x, y, device)
        scores = prediction_metrics(logits, targets)
        rare_nll = tail_nll_at(logits[rare], targets[rare],
                               1 / scores["t_best"])
        sums = tail_sums(logits, targets, rare)
        scores["rare"] = tail_metrics(sums, rare.numel(), rare_nll)
        flops = forward_flops
    else:  # too many logits to hold (GPT-2 BPE): keep the final states
        finals, geometry = forward_val(model, x, y, device, batch_size=32,
                                       keep_logits=False)
        scores = streamed_prediction_metrics(
            lambda h: model.lm_head(h.to(device)).cpu(), finals, targets,
            rare=rare)
        head_flops = 2 * model.config.n_embd * model.config.vocab_size
        head_flops *= x.numel()
        flops = (forward_flops - head_flops
                 + scores.pop("head_passes") * head_flops)
    rare_scores = scores.pop("rare")
    scores["isotropy"] = metrics.isotropy(W)
    result = {"val": scores, "geometry": {"val": geometry}, "flops": flops}
    if rare_scores:
        result["rare"] = rare_scores
    return result


@torch.no_grad()
def validation_losses(model, objective, val_data, batch_size, block_size,
                      eval_iters, shift, low_resource_prob, device,
                      autocast, rank=0, world_size=1, stop_pending=None):
    """train.py's evaluation: cross-entropy, never thresholded, and
    the other active terms on the same eval_iters validation batches
    every time, in both languages. shift > 0: the LR language's id
    offset (0: one language). Returns
    {"val" (windows mixed as in training), "val_high", "val_low" (two
    languages), "val_<term>" (each other active term; "val_ce" when
    headless), "twin_cos", "twin_top3" (two languages, char
    vocabulary)}, or None when stop_pending() (a stop signal) became
    true on any rank before its last batch."""
    low_resource = shift > 0
    model.eval()
    generator = torch.Generator().manual_seed(0)
    languages = (("high", 0), ("low", shift)) if low_resource else (("high", 0),)
    # > 0: no whole logits (losses.linear_cross_entropy)
    chunk = objective.config.ce_chunk_size
    aux = [name for name, weight in objective.weights.items()
           if weight and name != "ce"]
    B = batch_size
    width = 2 * B + len(aux)
    # every batch's draw (window starts, language picks) on every rank
    draws = [(sample_windows(len(val_data), block_size, B, generator),
              torch.rand(B, generator=generator) < low_resource_prob)
             for _ in range(eval_iters)]
    # row i: batch i's window losses per language and its other terms,
    # from the rank that evaluated it
    results = torch.zeros(eval_iters, width, device=device)
    devices = []
    if str(device).startswith("cuda"):
        devices = [torch.cuda.current_device()]
    rounds = math.ceil(eval_iters / world_size) * world_size
    with torch.random.fork_rng(devices=devices):
        for i in range(rank, rounds, world_size):
            if stop_pending is not None and parallelism.max_over_processes(
                    bool(stop_pending())):
                model.train()
                return None
            windows, is_low = draws[min(i, eval_iters - 1)]
            x, y = read_windows(val_data, *windows, block_size, shift, device)
            row = torch.zeros(width, device=device)
            passes = {}
            for k, (lang, offset) in enumerate(languages):
                with autocast:
                    passes[lang] = model(
                        x + offset, compute_logits=not chunk,
                        return_hidden_states=bool(aux) or chunk > 0)
                    if chunk:  # the head and the loss by chunks, as in training
                        row[k * B:(k + 1) * B] = linear_cross_entropy(
                            passes[lang][1][-1], model.lm_head.weight,
                            y + offset, chunk_size=chunk,
                            reduction="none").view(B, -1).mean(1)
                        continue
                logits = passes[lang][0] if aux else passes[lang]
                # a window at a time: a BPE batch's log-softmax would
                # be the run's peak
                row[k * B:(k + 1) * B] = torch.stack([
                    torch.nn.functional.cross_entropy(
                        window.float(), targets, reduction="none").mean()
                    for window, targets in zip(logits, y + offset)])
            if aux:
                logits, hidden = passes["high"]
                if low_resource:
                    pick = is_low.to(device).view(-1, 1, 1)
                    logits = None if chunk else torch.where(
                        pick, passes["low"][0], logits)
                    hidden = [torch.where(pick, low_h, high_h)
                              for low_h, high_h in zip(passes["low"][1], hidden)]
                mixed_y = y + shift * is_low.to(device).unsqueeze(1)
                with autocast:
                    _, terms = objective(logits, hidden, mixed_y,
                                         model.embeddings())
                row[2 * B:] = torch.stack([terms[name].float() for name in aux])
            if i < eval_iters:
                results[i] = row
    model.train()
    results = parallelism.sum_over_processes(results).cpu()
    high = results[:, :B].reshape(-1)
    low = results[:, B:2 * B].reshape(-1)
    out = {"val_high": high.mean().item()}
    if low_resource:
        out["val_low"] = low.mean().item()
        is_low = torch.cat([is_low for _, is_low in draws])
        out["val"] = torch.where(is_low, low, high).mean().item()
    else:
        out["val"] = out["val_high"]
    term_sums = dict.fromkeys(aux, 0.0)
    # summed in batch order, as one process adds them
    for batch_terms in results[:, 2 * B:].tolist():
        for name, value in zip(aux, batch_terms):
            term_sums[name] += value / eval_iters
    out.update({f"val_{name}": value for name, value in term_sums.items()})
    # a char vocabulary's 2V x 2V cosines are cheap; a BPE table's not
    if low_resource and 2 * shift <= 4096:
        embedding = model.wte.weight
        if hasattr(embedding, "full_tensor"):
            embedding = embedding.full_tensor()
        out.update(metrics.twin_alignment(embedding, shift))
    if not objective.trains_head:
        out["val_ce"] = out["val"]
        out["val"] = sum(objective.weights[name] * value
                         for name, value in term_sums.items())
    return out


def with_run_flops(result, run_flops):
    """The result with the FLOPs its run executed (train, eval) beside
    its own final evaluation, and their total: what metrics.json has."""
    flops = {k: v for k, v in run_flops.items()
             if k not in ("final_eval", "total")}
    flops["final_eval"] = result["flops"]["final_eval"]
    return {**result, "flops": {**flops, "total": sum(flops.values())}}


def evaluate_checkpoint(path, device="cpu", data_dir=None):
    """The final metrics of the checkpoint at path; data_dir: its
    dataset, if it moved."""
    model, checkpoint = checkpoints.load_model(path, device)
    data_dir = checkpoints.data_dir_of(checkpoint, path, data_dir)
    low_resource = checkpoint["config"]["low_resource"]
    result = evaluate_model(model, data_dir, low_resource,
                            checkpoint["meta"].get("itos"), device)
    result["checkpoint"] = {"path": path, "iter": checkpoint["iter_num"],
                            "val_loss": checkpoint["best_val_loss"]}
    # train.py adds its own
    result["flops"] = {"final_eval": result["flops"],
                       "total": result["flops"]}
    return result


def write_run_metrics(out_dir, run_flops, device, stopped_by=None):
    """The end of a train.py run: score its best.pt, add the FLOPs the
    whole run executed, write out_dir/metrics.json and print the table.
    Ctrl-C here, or a stop signal (stopped_by: its name) in the run's
    last step or after it, leaves training complete: say in one line
    how to write metrics.json later and exit 128 + the signal."""
    best_path = os.path.join(out_dir, "best.pt")
    ckpt = os.path.join(out_dir, "ckpt.pt")
    metrics_path = os.path.join(out_dir, "metrics.json")
    later = (f"training is complete ({ckpt}, {best_path}): "
             f"python evaluate.py {best_path} --out={metrics_path} "
             f"writes metrics.json")
    if stopped_by is not None:
        print(f"{stopped_by} at the end of training: no final evaluation; "
              f"{later}", file=sys.stderr)
        sys.exit(128 + signal.Signals[stopped_by])
    try:
        result = evaluate_checkpoint(best_path, device=device)
    except KeyboardInterrupt:
        print(f"interrupted during the final evaluation; {later}",
              file=sys.stderr)
        sys.exit(130)
    except (checkpoints.CheckpointError, DataError) as e:
        # best.pt damaged since written, or its data moved
        raise UserError(
            f"the final evaluation: {e}; training is complete ({ckpt}): "
            f"python evaluate.py {ckpt} --out={metrics_path} scores its "
            f"latest weights instead") from None
    result = with_run_flops(result, run_flops)
    try:
        save_json(result, metrics_path)
    except OSError as e:  # a full disk at the very end
        raise PathError(
            f"{write_failure(metrics_path, e)}; {later}") from None
    print(format_metrics(result))


def marginalization_report(parts, train_data, shift, itos):
    """Stop Jostling's gradient ratios of the LR rows, rarest first.
    parts (S, 3, V): per training step, the norms of each embedding
    row's gradient parts (metrics.EmbeddingGradientRecorder)."""
    V = parts.size(-1)
    ratios = metrics.marginalization_ratios(*parts.unbind(1))
    # LR windows reuse the same text
    counts = torch.bincount(train_data, minlength=shift)
    rows = []
    for i in sorted(range(shift), key=lambda i: (counts[i].item(), i)):
        r = shift + i if V == 2 * shift else i
        rows.append({"char": itos[i], "id": r,
                     "train_count": counts[i].item(),
                     **{k: v[r].item() for k, v in ratios.items()}})
    # per ratio: its mean over the rows, and the rows below 1
    cols = {k: torch.tensor([row[k] for row in rows]) for k in ratios}
    return {"steps": parts.size(0),
            **{f"mean_{k}": v.nanmean().item() for k, v in cols.items()},
            **{f"n_{k}_below_1": int((v < 1).sum()) for k, v in cols.items()},
            "tokens_rarest_first": rows}


def _or_na(value, spec):
    return "n/a" if value is None else format(value, spec)


def format_metrics(result):
    langs = [k for k in ("high", "low", "val") if k in result]
    keys = [k for k in ("ppl", "ppl_best", "t_best", "accuracy",
                        "recall_at_5", "mrr", "isotropy",
                        "isotropy_authors") if k in result[langs[0]]]
    lines = ["metric       " + "".join(f"{lang:>10}" for lang in langs)]
    for key in keys:
        lines.append(f"{key:<13}" + "".join(
            f"{result[lang][key]:>10.4f}" for lang in langs))
    if result.get("rare"):
        r = result["rare"]
        lines.append(
            f"rare targets (seen <= {RARE_MAX_COUNT}x in train, "
            f"{r['fraction']:.1%} of val): ppl {r['ppl']:.2f} | "
            f"accuracy {r['accuracy']:.4f} | mrr {r['mrr']:.4f}")
    for lang, g in result.get("geometry", {}).items():
        mu = " ".join(f"{m:.3f}" for m in g["mu"])
        lines.append(
            f"geometry {lang}: mu(l) {mu}"
            f" | spearman {_or_na(g['spearman_rho'], '.2f')}"
            f" kendall {_or_na(g['kendall_tau'], '.2f')}"
            f" | final cos {g['final_cosine']:.3f}"
            f" | simreg {g['simreg_final']:.2e}")
    if "translations" in result:
        t = result["translations"]
        lines.append(
            f"isotropy_all {result['isotropy_all']:.4f} | twin in top-3: "
            f"{t['twin_top3_fraction']:.3f} | 12 cases: {t['cases_12']} "
            f"| letters: {t['cases_letters']}/{t['cases_letters_total']}")
    return "\n".join(lines)
