"""Data-parallel training (parallelism.py) on real components: train.py launched by torchrun on 2
CPU processes (gloo) with DDP and with FSDP2, against a single process that sees the same global
batch; float16 loss scaling; FSDP save and exact resume; activation checkpointing; the errors for
what does not combine.

Parity: one process with batch_size B and 4 micro-steps sees the same micro-batches as 2
processes with batch_size B and 2 micro-steps each (train.py draws the whole global batch per
step), so the runs differ only in the order in which float32 gradients are summed: about 1e-7
relative after 6 AdamW steps, well inside the 1e-6 (relative and absolute) the tests allow."""

import os
import re
import subprocess
import sys

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import parallelism  # noqa: E402
from test_train import read_log, train_losses  # noqa: E402
from test_scale import dry_run  # noqa: E402

# None, or why train.py refuses parallel='fsdp' on the CPU with this torch (2.6; tested below)
FSDP_REFUSED = parallelism.fsdp_unavailable("cpu")
needs_fsdp_on_cpu = pytest.mark.skipif(FSDP_REFUSED is not None, reason=FSDP_REFUSED or "")

# B 2 per process, global batch 8: 4 micro-steps on one process, 2 on each of two; evaluations and
# checkpoints at 0, 3 and 6, of 3 batches split over the processes (one rank repeats a batch). SimReg, NITP (parameters in the objective) and CWT (the input
# embedding used outside the model's forward) on.
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2", "--global_batch_size=8",
        "--eval_interval=3", "--eval_iters=3", "--warmup_iters=2", "--lr_decay_iters=20", "--max_iters=6",
        "--log_interval=1", "--num_threads=1", "--final_eval=False",
        "--simreg_weight=1.0", "--simreg_tau=0.5", "--nitp_weight=1.0"]  # tau 0.01 gives ~1e-11 at this size
GPT2 = ["--cwt_weight=0.5", "--grad_clip_mode=adagc", "--adagc_warmup=3"]  # AdaGC: both phases in 6 steps
# LLaMA blocks with a mixture of experts, untied; clipping low enough that clip_grad_norm_ acts
LLAMA = ["--arch=llama", "--tie_weights=False", "--n_expert=4", "--top_k=2", "--ffn_hidden=32", "--grad_clip=0.1"]
# faulthandler: a rank that aborts in C++ (SIGABRT) prints its Python stack into the failure
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")


def launch(out_dir, data_dir, *args, processes=1):
    """Start train.py (under torchrun with processes > 1); finish() waits for it. Independent
    runs go concurrently: most of a tiny run is Python and torch starting up."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] \
        if processes > 1 else [sys.executable]
    return subprocess.Popen([*launcher, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}",
                             f"--out_dir={out_dir}", *TINY, *args], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(*processes, check=True):
    results = []
    for process in processes:
        stdout, stderr = process.communicate()
        if check:
            assert process.returncode == 0, stderr[-3000:]
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results if len(results) > 1 else results[0]


def final_weights(out_dir):
    """{'model.<name>': tensor, 'objective.<name>': tensor} of the run's latest checkpoint (whole
    tensors from ckpt.pt, or read back from an FSDP run's shards)."""
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
    if "dcp" not in checkpoint:
        return {f"{part}.{name}": value for part in ("model", "objective") for name, value in checkpoint[part].items()}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    target = os.path.join(out_dir, "dcp_whole.pt")
    dcp_to_torch_save(os.path.join(out_dir, checkpoint["dcp"]), target)
    return torch.load(target, weights_only=True)["model"]


def assert_same_weights(a, b):
    """The latest checkpoints of runs a and b hold the same weights, model and objective, bit for bit."""
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and any(k.startswith("objective.nitp_head") for k in wa)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), (name, (wa[name] - wb[name]).abs().max())


def assert_same_run(a, b):
    losses_a, losses_b = train_losses(a), train_losses(b)
    assert sorted(losses_a) == sorted(losses_b) == list(range(6))
    for it in losses_a:
        assert losses_a[it] == pytest.approx(losses_b[it], rel=1e-6), it
    # step 0: the same weights everywhere, so the evaluation split over the ranks is one process's, exactly
    evaluation = [{k: v for k, v in read_log(run)[0].items() if k.startswith(("val", "twin"))} for run in (a, b)]
    assert evaluation[0] == evaluation[1] and "val_simreg" in evaluation[0]
    terms = [k for k in read_log(a)[-2] if k in ("ce", "simreg", "nitp", "cwt", "moe_aux")]
    for ra, rb in zip(read_log(a), read_log(b)):  # every logged term and every evaluation
        for key in terms + [f"val_{t}" for t in terms] + ["val", "val_high", "val_low"]:
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-12), key
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and any(k.startswith("objective.nitp_head") for k in wa)
    for name in wa:
        assert torch.allclose(wa[name], wb[name], rtol=0, atol=1e-6), (name, (wa[name] - wb[name]).abs().max())


@pytest.mark.slow
def test_ddp_and_fsdp_match_one_process(tmp_path, data_dir):
    single, ddp, fsdp, kept = tmp_path / "single", tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "kept"
    # *0: the runs stopped at step 0 (ckpt.pt: the initial weights; FSDP's sharded initialisation), with
    # an odd vocabulary: the embedding's rows split 43 / 42 between the ranks
    single0, fsdp0 = tmp_path / "single0", tmp_path / "fsdp0"
    odd = ["--max_iters=0", "--vocab_size=85"]
    _, result, *_ = finish(launch(single, data_dir, *GPT2),
                           launch(ddp, data_dir, *GPT2, "--parallel=ddp", "--activation_checkpointing=True", processes=2),
                           *([] if FSDP_REFUSED else [launch(fsdp, data_dir, *GPT2, "--parallel=fsdp", processes=2),
                                                      launch(kept, data_dir, *GPT2, "--parallel=fsdp",
                                                             "--fsdp_keep_gathered=True", processes=2),
                                                      launch(single0, data_dir, *GPT2, *odd),
                                                      launch(fsdp0, data_dir, *GPT2, "--parallel=fsdp", *odd,
                                                             processes=2)]))
    assert "2 processes, ddp" in result.stdout and result.stdout.count("params:") == 1  # rank 0 prints
    assert_same_run(single, ddp)
    if FSDP_REFUSED:
        pytest.skip(f"DDP matched; the FSDP half: {FSDP_REFUSED}")
    assert_same_weights(single0, fsdp0)  # initialised shard by shard: the one-process model, bit for bit
    assert_same_run(single, fsdp)
    assert_same_run(single, kept)  # the weights kept gathered over each step (one all-gather): the same run
    # init_from under FSDP: each rank copies its rows of the tied wte / lm_head from the mapped file
    # (state-dict names: the checkpointing wrapper's prefix is not in them)
    start = tmp_path / "start"
    finish(launch(start, data_dir, *GPT2, "--parallel=fsdp", "--activation_checkpointing=True", "--max_iters=0",
                  f"--init_from={single / 'ckpt.pt'}", processes=2))
    source = final_weights(single)
    assert all(torch.equal(value, source[name]) for name, value in final_weights(start).items()
               if name.startswith("model."))
    # shards on disk: exactly those that ckpt.pt and ckpt_prev.pt name (older ones are removed)
    named = {torch.load(fsdp / name, weights_only=True)["dcp"] for name in ("ckpt.pt", "ckpt_prev.pt")}
    assert {os.path.join("ckpt_dcp", slot) for slot in os.listdir(fsdp / "ckpt_dcp")} == named and len(named) == 2
    # best.pt names its shards, written by every rank, one folder kept; evaluate.py reads it whole
    import checkpoint
    best = torch.load(fsdp / "best.pt", weights_only=True)
    assert "model" not in best and os.listdir(fsdp / "best_dcp") == [os.path.basename(best["dcp"])]
    model, _ = checkpoint.load_model(str(fsdp / "best.pt"))
    reference, _ = checkpoint.load_model(str(single / "best.pt"))
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name
    # the sharded ckpt.pt reads back whole in one process (evaluate.py, sample.py, the HF export,
    # init_from): the weights of torch's own converter (final_weights), without the optimizer state
    whole = checkpoint.load_with_weights(str(fsdp / "ckpt.pt"))
    reference = final_weights(fsdp)
    assert {f"{part}.{name}" for part in ("model", "objective") for name in whole[part]} == reference.keys()
    assert all(torch.equal(whole[part][name], reference[f"{part}.{name}"])
               for part in ("model", "objective") for name in whole[part])
    model, _ = checkpoint.load_model(str(fsdp / "ckpt.pt"))
    assert torch.equal(model.wte.weight, reference["model.wte.weight"])
    import importlib.util
    if importlib.util.find_spec("transformers"):  # the optional extra; export() compares HF's logits with ours
        from tools import export_hf
        export_hf.export(str(fsdp / "ckpt.pt"), str(tmp_path / "hf"))
        assert os.path.exists(tmp_path / "hf" / "model.safetensors")


@pytest.mark.slow
def test_epoch_order_draws_the_same_windows_on_one_and_two_processes(tmp_path, small_data_dir):
    """data_order='epoch' on a split of 23 windows: 6 steps of 8 cross two epochs, each inside a step.
    2 processes (2 micro-steps each) train on the one process's windows (4 micro-steps); a 2-process
    run saved at step 3 (epoch 1, window 1) and resumed on one process goes on with the same windows."""
    import torch
    single, ddp, part = tmp_path / "single", tmp_path / "ddp", tmp_path / "part"
    epoch = "--data_order=epoch"
    finish(launch(single, small_data_dir, epoch), launch(ddp, small_data_dir, epoch, "--parallel=ddp", processes=2),
           launch(part, small_data_dir, epoch, "--parallel=ddp", "--max_iters=3", processes=2))
    assert_same_run(single, ddp)
    assert torch.load(part / "ckpt.pt", weights_only=True)["data_position"] == {"epoch": 1, "index": 1, "n_windows": 23}
    finish(launch(part, small_data_dir, epoch, "--init_from=resume"))  # the global batch kept: nothing to name
    assert_same_run(single, part)
    assert {str(torch.load(run / "ckpt.pt", weights_only=True)["data_position"]) for run in (single, ddp, part)} == \
        {str({"epoch": 2, "index": 2, "n_windows": 23})}


@pytest.mark.slow
@needs_fsdp_on_cpu
def test_fsdp_llama_moe_matches_one_process_and_resumes_exactly(tmp_path, data_dir):
    single, full, part = tmp_path / "single", tmp_path / "full", tmp_path / "part"
    single0, full0 = tmp_path / "single0", tmp_path / "full0"  # stopped at step 0: the initial weights
    fsdp = [*LLAMA, "--parallel=fsdp", "--activation_checkpointing=True"]
    # part saves at step 3 on 2 processes; resumed there, its later steps are the uninterrupted run's, bit for bit
    finish(launch(single, data_dir, *LLAMA), launch(full, data_dir, *fsdp, processes=2),
           launch(part, data_dir, *fsdp, "--max_iters=3", processes=2),
           launch(single0, data_dir, *LLAMA, "--max_iters=0", "--vocab_size=87"),
           launch(full0, data_dir, *fsdp, "--max_iters=0", "--vocab_size=87", processes=2))
    assert_same_weights(single0, full0)
    assert_same_run(single, full)
    assert "moe_aux" in read_log(full)[-2] and read_log(full)[-2]["moe_dropped"] == 0.0  # the default: room for all
    result = finish(launch(part, data_dir, *fsdp, "--init_from=resume", processes=2))
    assert "resumed from" in result.stdout
    assert train_losses(part) == train_losses(full)
    assert [r["val"] for r in read_log(part) if "val" in r] == [r["val"] for r in read_log(full) if "val" in r]
    # sharded state cannot be resumed without FSDP: said so, no traceback (a larger max_iters, as a complete
    # run's resume reads nothing)
    result = finish(launch(part, data_dir, *LLAMA, "--init_from=resume", "--max_iters=8"), check=False)
    assert result.returncode != 0 and "resume with --parallel=fsdp" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@needs_fsdp_on_cpu
def test_fsdp_resume_falls_back_to_the_previous_slot_when_a_shard_is_truncated(tmp_path, data_dir):
    """One .distcp shard of the latest slot truncated (a disk that filled, a copy cut short), then
    --init_from=resume (issue 43, case 4): once both ranks printed DCP's tracebacks; now one line says
    which shard is damaged and the run resumes from ckpt_prev.pt, whose slot is intact, and finishes
    the uninterrupted run bit for bit. With that slot damaged too: one line naming both, no rank's
    traceback, no file changed."""
    import shutil
    from test_reliability import snapshot
    full, part, both = tmp_path / "full", tmp_path / "part", tmp_path / "both"
    fsdp = ["--parallel=fsdp"]
    finish(launch(full, data_dir, *fsdp, processes=2), launch(part, data_dir, *fsdp, "--max_iters=4", processes=2))
    latest, previous = (torch.load(part / name, weights_only=True) for name in ("ckpt.pt", "ckpt_prev.pt"))
    assert (latest["iter_num"], previous["iter_num"]) == (4, 3)
    shard = part / latest["dcp"] / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    shutil.copytree(part, both)
    result = finish(launch(part, data_dir, *fsdp, "--init_from=resume", processes=2))
    warning = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"the FSDP shard {shard} is truncated" in warning[0], result.stdout[-3000:]
    assert f"resuming from the previous checkpoint {part / 'ckpt_prev.pt'} (step 3) instead" in warning[0]
    assert "Traceback" not in result.stderr
    assert train_losses(part) == train_losses(full)
    assert [r["val"] for r in read_log(part) if "val" in r] == [r["val"] for r in read_log(full) if "val" in r]
    assert_same_weights(part, full)
    metadata = both / previous["dcp"] / ".metadata"
    metadata.write_bytes(b"")
    before = snapshot(str(both))
    result = finish(launch(both, data_dir, *fsdp, "--init_from=resume", processes=2), check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert f"{both / latest['dcp'] / '__1_0.distcp'} is truncated" in errors[0]
    assert str(both / previous["dcp"]) in errors[0]
    assert "[rank" not in result.stderr and "checkpoint.py" not in result.stderr, result.stderr[-3000:]
    assert snapshot(str(both)) == before
    import checkpoint  # evaluate.py, sample.py and the HF export read the shards whole: one line too
    with pytest.raises(checkpoint.CheckpointError, match="__1_0.distcp is truncated"):
        checkpoint.load_with_weights(str(both / "ckpt.pt"))


@pytest.mark.slow
@needs_fsdp_on_cpu
@pytest.mark.parametrize("experts", [2, 8])
def test_fsdp_moe_on_4_processes_matches_one_process_and_resumes_exactly(tmp_path, data_dir, experts):
    """4 ranks. 2 experts: cut on dim 0 the stacked experts (2, 32, 16) would leave ranks 2-3 empty and
    pad every all-gather to twice the weights; they, the router (2, 16), the embedding and the head
    (vocabulary 42, 16) are cut on a dimension 4 divides (parallelism.shard_dim: Shard(1)), so nothing
    is padded and no note is printed. 8 experts: dim 0 divides. The same run as one process, and saved
    (DCP) and resumed mid-run it is the uninterrupted run bit for bit."""
    moe = [*LLAMA, f"--n_expert={experts}"]
    fsdp = [*moe, "--parallel=fsdp"]
    single, full, part = tmp_path / "single", tmp_path / "full", tmp_path / "part"
    runs = finish(launch(single, data_dir, *moe), launch(full, data_dir, *fsdp, processes=4),
                  launch(part, data_dir, *fsdp, "--max_iters=3", processes=4))
    assert "fsdp pads" not in runs[1].stdout + runs[1].stderr
    assert_same_run(single, full)
    resumed = finish(launch(part, data_dir, *fsdp, "--init_from=resume", processes=4))
    assert "resumed from" in resumed.stdout
    assert train_losses(part) == train_losses(full)
    assert_same_weights(part, full)


@pytest.mark.slow
@needs_fsdp_on_cpu
@pytest.mark.parametrize("experts", [2, 8])
def test_fsdp_dropless_moe_on_4_processes_matches_one_process(tmp_path, data_dir, experts):
    """moe_routing='dropless' (moe.py: tokens sorted by expert, each expert over its own rows, the group
    sizes read on the host): 4 FSDP ranks, 2 experts (cut on dim 1) and 8 (dim 0), against one process,
    the same run to float32's order of summation; nothing dropped. And the one process against the
    static path at capacity N, the reference it equals up to float32 rounding."""
    moe = [*LLAMA, f"--n_expert={experts}"]
    single, full, capacity = tmp_path / "single", tmp_path / "full", tmp_path / "capacity"
    finish(launch(single, data_dir, *moe, "--moe_routing=dropless"),
           launch(full, data_dir, *moe, "--moe_routing=dropless", "--parallel=fsdp", processes=4),
           launch(capacity, data_dir, *moe))
    assert_same_run(single, full)
    assert {r["moe_dropped"] for r in read_log(full) if "moe_dropped" in r} == {0.0}
    dropless, static = train_losses(single), train_losses(capacity)
    assert dropless == pytest.approx(static, rel=1e-5)


@pytest.mark.parametrize("placements", [(Shard(0),), (Shard(1),), (Shard(2),), (Replicate(), Shard(1))], ids=str)
def test_local_rows_is_the_shard_fsdp_holds_on_any_dimension(placements):
    """parallelism.local_rows (sharded init, copy_shards from a whole checkpoint) cuts the dimension
    FSDP's placement names as torch.chunk does (FSDP's layout: uneven chunks, the last ranks' empty),
    over the mesh's sharded dimension; the ranks' parts put together are the tensor."""
    shards, full = 4, torch.arange(6 * 8 * 4).reshape(6, 8, 4)
    dim = placements[-1].dim
    for rank in range(shards):
        mesh = SimpleNamespace(size=lambda mesh_dim: (2, shards)[mesh_dim] if len(placements) == 2 else shards,
                               get_local_rank=lambda mesh_dim, rank=rank: rank)
        part = parallelism.local_rows(full, SimpleNamespace(placements=placements, device_mesh=mesh))
        expected = torch.chunk(full, shards, dim=dim)
        assert torch.equal(part, expected[rank] if rank < len(expected) else full.narrow(dim, 0, 0)), rank


@pytest.mark.slow
@needs_fsdp_on_cpu
def test_hybrid_sharding_on_2x2_processes_matches_one_process_and_resumes_exactly(tmp_path, data_dir):
    """fsdp_shard_size=2 on 4 processes: two groups of 2 ranks, each group holding the model sharded in
    two, replicated across the groups (HSDP). The same run as one process; initialised as it is."""
    single, hybrid, part = tmp_path / "single", tmp_path / "hybrid", tmp_path / "part"
    single0, hybrid0 = tmp_path / "single0", tmp_path / "hybrid0"
    # batch_size='auto': the 2 sequences of each process's share of the global batch 8 fit (one micro-step),
    # agreed by the 4 ranks
    sharded = ["--parallel=fsdp", "--fsdp_shard_size=2", "--batch_size=auto"]
    finish(launch(single, data_dir, *GPT2), launch(single0, data_dir, *GPT2, "--max_iters=0", "--vocab_size=85"))
    first = finish(launch(hybrid0, data_dir, *GPT2, *sharded, "--max_iters=0", "--vocab_size=85", processes=4))
    assert "4 processes, fsdp sharded in groups of 2" in first.stdout
    assert "batch_size='auto': 2 sequences per process and micro-step" in first.stdout
    assert_same_weights(single0, hybrid0)  # each group's shards are the one-process model's rows
    finish(launch(hybrid, data_dir, *GPT2, *sharded, processes=4))
    assert_same_run(single, hybrid)
    finish(launch(part, data_dir, *GPT2, *sharded, "--max_iters=3", processes=4))
    resumed = finish(launch(part, data_dir, *GPT2, *sharded, "--init_from=resume", processes=4))
    assert "resumed from" in resumed.stdout
    assert train_losses(part) == train_losses(hybrid)
    assert_same_weights(part, hybrid)


@pytest.mark.slow
@needs_fsdp_on_cpu
def test_fsdp_set_up_holds_shards_not_the_whole_model(tmp_path, data_dir):
    """Sharded initialisation: each of 2 FSDP processes sets up a 2.8 GB model (float32; 1.3B's width,
    12 blocks) without holding it whole. Its resident peak at the end of set-up (tests/setup_peak.py)
    is its shards (1.4 GB), one parameter's whole tensor (wte, 0.4 GB) and the interpreter's ~0.35 GB:
    2.2-2.3 GB measured, where materialising the whole model before sharding it peaked at 3.3-3.5 GB."""
    from model import GPT, GPTConfig
    shape = dict(vocab_size=50304, block_size=16, n_layer=12, n_head=16, n_embd=2048)
    with torch.device("meta"):
        size = sum(p.numel() * p.element_size() for p in GPT(GPTConfig(**shape)).parameters())
    assert size > 2.5e9
    # the run goes on to step 0's checkpoint, the source of the second part
    source = tmp_path / "source"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/setup_peak.py",
         "--then_train", "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={source}",
         "--parallel=fsdp", "--batch_size=2", "--check_memory=False", "--num_threads=1", "--max_iters=0",
         "--eval_iters=1", "--final_eval=False", *(f"--{key}={value}" for key, value in shape.items())],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = [int(peak) for peak in re.findall(r"setup peak rss rank \d+: (\d+) bytes", result.stdout)]
    assert len(peaks) == 2 and max(peaks) < size, (peaks, size, result.stdout[-2000:])
    # starting from that model's FSDP checkpoint (its shards): each rank reads its own rows, the
    # whole model is never in one process (issue 42); reading it back whole peaked above the model
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/setup_peak.py",
         "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'start'}",
         "--parallel=fsdp", "--batch_size=2", "--check_memory=False", "--num_threads=1",
         f"--init_from={source / 'ckpt.pt'}", *(f"--{key}={value}" for key, value in shape.items())],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = [int(peak) for peak in re.findall(r"setup peak rss rank \d+: (\d+) bytes", result.stdout)]
    assert len(peaks) == 2 and max(peaks) < size, (peaks, size, result.stdout[-2000:])


@pytest.mark.slow
@needs_fsdp_on_cpu
def test_an_fsdp_run_starts_from_another_fsdp_runs_shards(tmp_path, data_dir):
    """init_from an FSDP run's checkpoint under FSDP: DCP reads each rank's rows of the shards into the
    sharded model (checkpoint_shards.load_shards_into); the weights are the source's, bit for bit, tied and
    with head_from_embedding (the LM head's shards copies of wte's)."""
    source, start, headed = tmp_path / "source", tmp_path / "start", tmp_path / "headed"
    fsdp = [*GPT2, "--parallel=fsdp"]
    finish(launch(source, data_dir, *fsdp, "--max_iters=2", processes=2))
    finish(launch(start, data_dir, *fsdp, "--max_iters=0", f"--init_from={source / 'ckpt.pt'}", processes=2),
           launch(headed, data_dir, *fsdp, "--max_iters=0", "--tie_weights=False", "--head_from_embedding=True",
                  f"--init_from={source / 'ckpt.pt'}", processes=2))
    whole = {name: value for name, value in final_weights(source).items() if name.startswith("model.")}
    assert {name: value for name, value in final_weights(start).items() if name in whole}.keys() == whole.keys()
    assert all(torch.equal(value, whole[name]) for name, value in final_weights(start).items() if name in whole)
    untied = final_weights(headed)
    assert torch.equal(untied["model.lm_head.weight"], whole["model.wte.weight"])
    assert all(torch.equal(untied[name], value) for name, value in whole.items() if name != "model.lm_head.weight")


@pytest.mark.slow
@needs_fsdp_on_cpu
def test_float16_loss_scaling_under_ddp_and_fsdp(tmp_path, data_dir):
    """dtype=float16 (GPUs without bf16) on 2 processes: the loss scale starts at 2^16 and
    halves at each overflow in these 6 steps. DDP all-reduces whole gradients, FSDP2 reduce-scatters
    shards (its inf check is all-reduced over the ranks): both skip the same steps, reach the same
    scale, and agree on every loss. They are not compared with one process: there each of 4
    micro-steps backpropagates loss / 4, here each of 2 loss / 2, so fp16 overflows at other steps."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    args = [*GPT2, "--dtype=float16"]
    finish(launch(ddp, data_dir, *args, "--parallel=ddp", processes=2),
           launch(fsdp, data_dir, *args, "--parallel=fsdp", processes=2))
    scales = [[r["loss_scale"] for r in read_log(run) if "loss" in r] for run in (ddp, fsdp)]
    assert scales[0] == scales[1] and scales[0][-1] < 2.0 ** 16  # steps were skipped, on both alike
    losses = [train_losses(run) for run in (ddp, fsdp)]
    assert losses[0].keys() == losses[1].keys() == set(range(6))
    assert all(losses[0][i] == pytest.approx(losses[1][i], rel=1e-4) for i in range(6))
    vals = [[r["val"] for r in read_log(run) if "val" in r] for run in (ddp, fsdp)]
    assert vals[0] == pytest.approx(vals[1], rel=1e-4)
    # fp16 rounding differs between the two gradient paths; Adam magnifies it only where a
    # gradient is near zero, so nearly all weights agree to 1e-4
    wa, wb = final_weights(ddp), final_weights(fsdp)
    differences = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    assert differences.quantile(0.99) < 1e-4, differences.quantile(0.99)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, data_dir):
    """A scheduler's SIGUSR1 reaching one worker only: the ranks agree on it after the very step (a
    host all-reduce of the flag every step; no step is logged in this run), ckpt.pt holds that step,
    and resuming under torchrun ends with the uninterrupted run's weights bit for bit."""
    import signal
    import time
    long = ["--parallel=ddp", "--max_iters=300", "--lr_decay_iters=300", "--eval_interval=150",
            "--log_interval=1000"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    reference, process = launch(whole, data_dir, *long, processes=2), launch(stopped, data_dir, *long, processes=2)
    log = stopped / "log.jsonl"
    t0 = time.time()
    while not (log.exists() and '"iter": 150' in log.read_text()) and process.poll() is None \
            and time.time() - t0 < 300:
        time.sleep(0.01)
    workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGUSR1)
    result = finish(process, check=False)
    finish(reference)
    assert result.returncode != 0  # the workers exit 128 + signal; torchrun reports them as failed
    step = torch.load(stopped / "ckpt.pt", weights_only=True)["iter_num"]
    assert 150 < step < 300  # a step past the evaluation at 150, none of them logged
    # rank 0 names the signal whichever rank got it, and exits 128 + its number like the rank that got
    # it (torchrun reports the first to exit; once a rank not signalled exited 143, SIGTERM's)
    assert f"stopped by SIGUSR1 at step {step}; the full state is in" in result.stdout
    assert "--init_from=resume" in result.stdout
    assert "failed (exitcode: 138)" in result.stderr and "exitcode: 143" not in result.stderr, result.stderr[-3000:]
    finish(launch(stopped, data_dir, *long, "--init_from=resume", processes=2))
    assert_same_weights(whole, stopped)


@pytest.mark.slow
def test_a_signal_to_one_rank_ends_an_evaluation_on_every_rank_between_batches(tmp_path, data_dir):
    """SIGUSR1 to rank 1 alone while the evaluation at step 3 runs (1,000 batches over 2 ranks): the
    ranks agree between two batches (issue 43, case 12), abandon it together, save step 3 without it
    and exit; resuming evaluates step 3 again and finishes the uninterrupted run bit for bit."""
    import signal
    import time
    args = ["--parallel=ddp", "--eval_iters=1000"]  # seconds: the signal comes 0.5 s into it
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    reference, process = launch(whole, data_dir, *args, processes=2), launch(stopped, data_dir, *args, processes=2)
    log = stopped / "log.jsonl"
    t0 = time.time()  # 4 lines: the evaluation at 0, steps 0-2: the evaluation at step 3 is running
    while not (log.exists() and sum(1 for _ in open(log)) >= 4) and process.poll() is None and time.time() - t0 < 300:
        time.sleep(0.01)
    time.sleep(0.5)
    workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    rank1 = next(pid for pid in workers if b"RANK=1" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"))
    os.kill(int(rank1), signal.SIGUSR1)  # not rank 0, which would announce it
    result = finish(process, check=False)
    finish(reference)
    assert result.returncode != 0 and "[rank" not in result.stderr, result.stderr[-3000:]
    assert torch.load(stopped / "ckpt.pt", weights_only=True)["iter_num"] == 3
    assert [r["iter"] for r in read_log(stopped) if "val" in r] == [0]
    assert "stopped by SIGUSR1 at step 3" in result.stdout
    finish(launch(stopped, data_dir, *args, "--init_from=resume", processes=2))
    assert train_losses(stopped) == train_losses(whole)
    assert [r["val"] for r in read_log(stopped) if "val" in r] == [r["val"] for r in read_log(whole) if "val" in r]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(arch):
    import parallelism
    from model import GPTConfig, build_model
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=16, arch=arch,
                       n_expert=4 if arch == "llama" else 1, ffn_hidden=32)
    plain = build_model(config)
    checkpointed = build_model(config)
    checkpointed.load_state_dict(plain.state_dict())
    parallelism.apply_activation_checkpointing(checkpointed)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()  # checkpoints keep their keys
    x = torch.randint(0, 40, (3, 8))
    losses = []
    for model in (plain, checkpointed):
        logits, hidden = model(x, return_hidden_states=True)
        loss = logits.logsumexp(-1).mean() + hidden[1].square().mean()  # a hidden state too, as the losses use
        loss.backward()
        losses.append(loss)
    assert losses[0].item() == losses[1].item()
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


@needs_fsdp_on_cpu
def test_fsdp_gives_unused_parameters_zero_gradients():
    """Parameters that get no gradient (a headless model's untied LM head; the stacked experts
    always get one, zeros where no token went): under FSDP each gets the unwrapped model's gradient, or zeros where that has none,
    with torch's set_reduce_scatter_unused_params (torch >= 2.13) and with the zero terms that an
    older torch needs (parallelism.zero_gradients_for_unused). One process, in this one."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from model import GPTConfig, build_model
    from objective import Trained
    config = GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=16, arch="llama", tie_weights=False,
                       n_expert=4, top_k=1, ffn_hidden=32)
    x = torch.randint(0, 40, (1, 3), generator=torch.Generator().manual_seed(0))

    def loss_of(model):  # headless: the last hidden state, and the router's balancing loss
        _, hidden = model(x, return_hidden_states=True, compute_logits=False)
        return hidden[-1].square().mean() + model.aux_loss
    torch.manual_seed(0)
    reference = build_model(config)
    reference_loss = loss_of(reference)
    reference_loss.backward()
    unused = [name for name, p in reference.named_parameters() if p.grad is None]  # 3 tokens, 1 expert each
    assert unused == ["lm_head.weight"], unused
    for block in reference.h:  # experts no token went to: a gradient of zeros, in their slice
        assert (block.mlp.gate.grad.flatten(1).abs().sum(dim=1) == 0).any()
    ways = ["zero terms"] + (["torch's"] if hasattr(FSDPModule, "set_reduce_scatter_unused_params") else [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for way in ways:
            model = build_model(config)
            model.load_state_dict(reference.state_dict())
            parallelism.parallelize(Trained(model, torch.nn.Module()), "fsdp", "cpu",
                                    unused_parameters=way == "torch's")
            if way == "zero terms":
                parallelism.zero_gradients_for_unused(model)
            loss = loss_of(model)
            loss.backward()
            assert loss.item() == reference_loss.item(), way
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                expected = q.grad if q.grad is not None else torch.zeros_like(q)
                assert p.grad is not None and torch.equal(p.grad.full_tensor(), expected), (way, name)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # on a torch without FSDP2 on the CPU it asks a train.py process
def test_what_does_not_combine_fails_clearly():
    if FSDP_REFUSED:  # before anything is read or written, in one line
        out = subprocess.run([sys.executable, "train.py", "config/lowres_baseline.py", "--parallel=fsdp", "--device=cpu"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stderr == f"error: {FSDP_REFUSED}\n" and "torch >= 2.7" in out.stderr
    out = dry_run("config/lowres_baseline.py", "--parallel=fsdp", "--separate_embeddings=True")
    # the dry run plans for this CPU: a torch without FSDP2 there says so first
    why = "torch >= 2.7" if FSDP_REFUSED else "separate_embeddings"
    assert out.returncode == 2 and why in out.stderr and "fsdp" in out.stderr
    out = dry_run("config/lowres_baseline.py", "--parallel=ddp", "--log_marginalization=True")
    assert out.returncode == 2 and "log_marginalization needs parallel='none'" in out.stderr
    out = dry_run("config/lowres_baseline.py", "--parallel=tp")
    assert out.returncode == 2 and "'parallel'" in out.stderr
    out = dry_run("config/lowres_baseline.py", "--grad_clip_mode=agc")
    assert out.returncode == 2 and "'grad_clip_mode'" in out.stderr
    os.environ["WORLD_SIZE"] = "2"  # as torchrun would set it
    try:
        out = dry_run("config/lowres_baseline.py")
        assert out.returncode == 2 and "parallel' is 'none'" in out.stderr
        out = dry_run("config/baseline_350m.py", "--batch_size=3")  # 512 / (3 x 2)
        assert out.returncode == 2 and "processes (2)" in out.stderr
        for bad in (["--parallel=fsdp", "--fsdp_shard_size=3"], ["--parallel=ddp", "--fsdp_shard_size=2"]):
            out = dry_run("config/lowres_baseline.py", *bad)  # groups that do not divide 2 processes; not FSDP
            why = "torch >= 2.7" if FSDP_REFUSED and "--parallel=fsdp" in bad else "key 'fsdp_shard_size'"
            assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr
    finally:
        del os.environ["WORLD_SIZE"]


def test_paper_configs_name_their_parallelism():
    from configurator import read_config_file
    values = {}
    for size in ("350m", "1b3", "3b", "7b", "moe_8x1b"):
        scope = read_config_file(os.path.join(REPO, "config", f"simreg_{size}.py"))
        values[size] = (scope["parallel"], scope["grad_clip_mode"], scope.get("activation_checkpointing", False))
    assert values["350m"] == ("ddp", "adagc", False)
    assert all(values[s][:2] == ("fsdp", "adagc") for s in ("1b3", "3b", "7b", "moe_8x1b"))
    assert values["7b"][2] is True
