"""plan.py (train.py --dry_run): every figure of a run's plan against its closed form, computed
here from the config's numbers alone: parameters of a GPT-2 / LLaMA / Mixtral stack, tokens and
micro-steps of a step, FLOPs (6 per matmul weight and token + 12 L C T), bytes of the states
under DDP and FSDP, passes over the data, hours at a given MFU, and the bytes DDP and FSDP send
per step, against the closed form and against the collectives of a real 2-process step."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import parallelism  # noqa: E402
import memory  # noqa: E402
import comms  # noqa: E402
import plan  # noqa: E402
import speed  # noqa: E402
import utils  # noqa: E402
from tools import bench_systems  # noqa: E402
from configurator import ConfigError, parse_config, train_defaults  # noqa: E402
from model import GPTConfig  # noqa: E402
from utils import GPU_PEAK_BF16_FLOPS  # noqa: E402

GiB = 2 ** 30


def config_of(*args):
    """train.py's config from these files and overrides (the paper configs: batch_size=1 where a test counts
    micro-steps; their batch_size='auto' has its own test)."""
    return parse_config([os.path.join(REPO, a) if a.endswith(".py") else a for a in args], train_defaults())


def gpt2_params(V, T, L, C, bias=False):
    """Tied GPT-2: token + position tables; per block 2 layer norms, qkv, attention projection and
    the 4C MLP; the final layer norm. With bias, every linear and layer norm has one."""
    b = 1 if bias else 0
    block = 2 * (1 + b) * C + (3 * C * C + 3 * C * b) + (C * C + C * b) + (4 * C * C + 4 * C * b) + (4 * C * C + C * b)
    return V * C + T * C + L * block + (1 + b) * C


def llama_params(V, L, C, H, experts=1):
    """Untied LLaMA without biases: embedding and head, per block 2 RMSNorms, wqkv + wo, SwiGLU
    (gate, up, down) per expert and a router when there are experts; the final RMSNorm."""
    mlp = 3 * C * H * experts + (C * experts if experts > 1 else 0)
    return 2 * V * C + L * (2 * C + 4 * C * C + mlp) + C


def test_lowres_plan_counts_the_low_resource_vocabulary(data_dir):
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    config = config_of("config/lowres_baseline.py", f"--data_dir={data_dir}")
    p = plan.make_plan(config, measure=False)
    V = 2 * meta["vocab_size"]  # the low-resource language doubles the table
    assert p["params"] == gpt2_params(V, 64, 4, 128)
    assert p["tokens_per_step"] == 12 * 64 and p["micro_steps"] == 1 and p["tokens_per_run"] == 8000 * 12 * 64
    matmul = p["params"] - 64 * 128  # the position table is a lookup; the tied head is a matmul
    per_token = 6 * matmul + 12 * 4 * 128 * 64
    assert p["flops_per_step"] == per_token * 12 * 64
    evaluations = 8000 // 250 + 1
    eval_flops = evaluations * 20 * 2 * 12 * 64 * (per_token // 3)
    assert p["flops_per_run"] == p["flops_per_step"] * 8000 + eval_flops
    assert p["data"]["passes"] == pytest.approx(8000 * 12 * 64 / meta["n_train"])


def test_the_real_lowres_run_has_the_planned_size():
    """The issue's figure: a real run of the character experiment has 812,416 parameters."""
    config = config_of("config/lowres_baseline.py", "--vocab_size=130")
    assert plan.make_plan(config, measure=False)["params"] == gpt2_params(130, 64, 4, 128) == 812_416


def toy_flops_per_step():
    """A lowres CE training step's FLOPs: 6 per matmul weight and token (the position table is a
    lookup, the tied head a matmul) + 12 L C T of attention, for 12 sequences of 64."""
    return (6 * (gpt2_params(130, 64, 4, 128) - 64 * 128) + 12 * 4 * 128 * 64) * 12 * 64


def test_a_time_prints_in_the_unit_that_shows_it():
    assert utils.duration(0.0855) == "0.086 s" and utils.duration(42) == "42 s"
    assert utils.duration(90) == "1.5 min" and utils.duration(59.5 * 60) == "59.5 min"
    assert utils.duration(2 * 3600) == "2.0 h" and utils.duration(84_136.3 * 3600) == "84,136.3 h"


def test_a_cpu_plan_times_the_run_at_the_speed_measured_here(monkeypatch):
    """A CPU plan's time is its FLOPs at the speed measured on this machine (peak x the toy step's
    MFU: here given, as measured_speed would return them); its memory is the process's, in MiB
    for the toy (in GiB it would read 0.0)."""
    monkeypatch.setattr(plan, "measured_speed", lambda device, dtype: (200e9, 0.5))
    p = plan.make_plan(config_of("config/lowres_ce.py", "--vocab_size=130"), device="cpu")
    evaluations = 8000 // 250 + 1  # 20 batches in each of 2 languages, forward only (a third)
    flops = toy_flops_per_step() * 8000 + evaluations * 20 * 2 * toy_flops_per_step() // 3
    assert p["flops_per_run"] == flops
    seconds = flops / (200e9 * 0.5)
    assert p["hours"] * 3600 == pytest.approx(seconds) and 60 < seconds < 3600
    text = plan.format_plan(p)
    assert (f"FLOPs/run (evaluations included) = {seconds / 60:.1f} min on 1 x cpu at 100 GFLOP/s each, "
            "the toy's CE step measured here now (MFU 50% of a float32 matmul's 200 GFLOP/s") in text
    assert "memory of the process (MiB; its tensors, activations in float32):" in text
    ddp = p["memory"]["ddp"]
    assert f"  ddp: {ddp['plain'] * 1024:.1f} <- this config, with activation checkpointing " in text
    assert ddp["plain"] * GiB > 16 * 812_416  # weights, gradients and AdamW's two moments, in fp32
    memory_lines = text.split("memory of the process")[1].splitlines()[1:3]
    assert not any(" 0.0" in line for line in memory_lines) and " h " not in text


def test_a_gpu_plan_is_made_from_the_datasheet_and_reads_as_before(monkeypatch):
    """Nothing measured for a GPU plan (made anywhere); its time in hours at the stated MFU and
    its memory per GPU in GiB, as the plan always printed them, where they are long and large."""
    def no_measurement(device, dtype):
        raise AssertionError("a GPU plan measured this machine")
    monkeypatch.setattr(plan, "measured_speed", no_measurement)
    config = config_of("config/baseline_7b.py")
    p = plan.make_plan(config, 64, gpu="H100", measure=False)
    hours = p["flops_per_run"] / (0.4 * GPU_PEAK_BF16_FLOPS["H100"] * 64) / 3600
    text = plan.format_plan(p)
    assert (f"compute: {p['flops_per_step']:.3e} FLOPs/step, {p['flops_per_run']:.3e} FLOPs/run "
            f"(evaluations included) = {hours:,.1f} h on 64 x H100 at MFU 40%\n") in text
    assert "\nmemory per GPU (GiB; activations in the compute dtype):\n" in text
    assert "batch_size='auto': the most that fits 90% of one H100's 79.6 GiB)" in text
    # the toy on a GPU: its run in seconds, its memory in MiB
    toy = plan.make_plan(config_of("config/lowres_ce.py", "--vocab_size=130"))
    seconds = toy["flops_per_run"] / (0.4 * GPU_PEAK_BF16_FLOPS["H100"])
    text = plan.format_plan(toy)
    assert f"= {seconds:.2g} s on 1 x H100 at MFU 40%" in text and "memory per GPU (MiB;" in text


@pytest.mark.slow  # it times the toy's step for real
def test_measured_speed_is_the_toy_ce_steps_rate_against_the_matmul_peak(monkeypatch):
    """The MFU measured here is the toy's CE step (tools.bench --section efficiency's lowres setting)
    against the peak train.py's MFU divides by; measured for real, both are positive."""
    monkeypatch.setattr(speed, "peak_flops", lambda device, dtype: 100e9)
    monkeypatch.setattr(speed, "step_time", lambda *args: 0.05)
    mfu = toy_flops_per_step() / 0.05 / 100e9
    assert speed.measured_speed("cpu", "float32") == (100e9, pytest.approx(mfu))
    monkeypatch.undo()
    peak, mfu = speed.measured_speed("cpu", "float32")
    assert peak > 1e9 and mfu > 0


@pytest.mark.parametrize("processes", [8, 64])
def test_7b_plan_on_many_gpus(processes, tmp_path):
    config = config_of("config/baseline_7b.py", "--batch_size=1", f"--data_dir={tmp_path / 'c4'}")  # nothing prepared there
    p = plan.make_plan(config, processes, gpu="A100", mfu=0.5, measure=False)
    V, L, C, H, T = 50304, 32, 4096, 11008, 2048
    N = llama_params(V, L, C, H)
    assert p["params"] == p["active_params"] == N
    assert p["micro_steps"] == 2048 // processes and p["tokens_per_step"] == 2048 * T
    per_token = 6 * (N - V * C) + 12 * L * C * T  # the input embedding is a lookup
    assert p["flops_per_step"] == per_token * 2048 * T
    assert p["hours"] == pytest.approx(p["flops_per_run"] / (0.5 * GPU_PEAK_BF16_FLOPS["A100"] * processes) / 3600)
    block = 2 * C + 4 * C * C + 3 * C * H
    root = N - L * block
    share, micro_steps = (processes - 1) / processes, 2048 // processes
    link = 2400 if processes <= 8 else 200  # A100: NVLink 3 within a node, InfiniBand HDR between nodes
    compute = p["flops_per_step"] / (0.5 * GPU_PEAK_BF16_FLOPS["A100"] * processes)
    assert p["compute_seconds"] == pytest.approx(compute)
    assert config["fsdp_keep_gathered"]  # the recipe keeps the weights gathered over each step
    for keep in (True, False):
        p = plan.make_plan({**config, "fsdp_keep_gathered": keep}, processes, gpu="A100", mfu=0.5, measure=False)
        parts = p["memory_parts"]
        assert parts["ddp"] * GiB == pytest.approx(20 * N)
        gathered = N * 2 if keep else max(block, root) * 2  # bf16: the whole model, or the largest unit
        assert parts["fsdp"] * GiB == pytest.approx(16 * N / processes + gathered + max(block, root) * 4 + 4 * N)
        # FSDP, bf16 all-gathers, ring convention: each of 32 micro-steps gathers every block twice and
        # the root once, (N-1)/N of each (kept gathered: every unit once per step); one fp32 reduce-scatter
        gathers = 1 if keep else micro_steps
        c = p["communication"]
        assert c["all_gather"] == pytest.approx(gathers * share * 2 * ((1 if keep else 2) * L * block + root))
        assert c["reduce_scatter"] == pytest.approx(share * 4 * N) and c["all_reduce"] == 0
        assert p["link_gbps"] == link and c["seconds"] == pytest.approx(c["total"] * 8 / (link * 1e9))
        exposed = share * (root + block) * (gathers * 2 + 4) * 8 / (link * 1e9)  # root and first block
        assert p["step_seconds"] == pytest.approx(exposed + max(compute, c["seconds"] - exposed))
    # 52B tokens: about 350 C4 shards of ~150M tokens, and nothing prepared yet
    assert p["data"]["shards_needed"] == -(-12500 * 2048 * T // int(plan.C4_TOKENS_PER_SHARD))
    assert "prepare_c4.py --shards 350" in plan.format_plan(p)


def test_hybrid_sharding_plan_shards_within_a_node_and_all_reduces_between_nodes(tmp_path):
    """7B on 64 A100s, fsdp_shard_size=8: the states sharded over a node's 8 GPUs; the all-gathers and
    the reduce-scatter within the node at 7/8 of their buffers over NVLink; each GPU's 1/8 of the fp32
    gradients all-reduced with its 7 twins in the other nodes, 2 x 7/8 of it, over InfiniBand."""
    config = config_of("config/baseline_7b.py", "--batch_size=1", f"--data_dir={tmp_path / 'c4'}", "--fsdp_shard_size=8",
                       "--fsdp_keep_gathered=False")
    p = plan.make_plan(config, 64, gpu="A100", mfu=0.5, measure=False)
    V, L, C, H = 50304, 32, 4096, 11008
    N = llama_params(V, L, C, H)
    block = 2 * C + 4 * C * C + 3 * C * H
    root, micro_steps = N - L * block, 2048 // 64
    assert p["memory_parts"]["fsdp"] * GiB == pytest.approx(16 * N / 8 + 2 * max(block, root) + 4 * max(block, root)
                                                            + 4 * N)
    c = p["communication"]
    assert c["all_gather"] == pytest.approx(micro_steps * 7 / 8 * 2 * (2 * L * block + root))
    assert c["reduce_scatter"] == pytest.approx(7 / 8 * 4 * N)
    assert c["all_reduce"] == pytest.approx(2 * 7 / 8 * 4 * N / 8)
    nvlink, infiniband = 2400e9 / 8, 200e9 / 8  # bytes/s
    assert c["seconds"] == pytest.approx((c["all_gather"] + c["reduce_scatter"]) / nvlink + c["all_reduce"] / infiniband)
    line = next(line for line in plan.format_plan(p).splitlines() if line.startswith("communication:"))
    assert "fsdp sharded in groups of 8" in line and "within a group at 2,400 Gb/s" in line and "200 Gb/s" in line
    # all-gathering within the node is cheaper than over the network, for 8x the states per GPU
    flat = plan.make_plan({**config, "fsdp_shard_size": 0}, 64, gpu="A100", mfu=0.5, measure=False)
    assert c["seconds"] < flat["communication"]["seconds"]
    assert p["memory_parts"]["fsdp"] > flat["memory_parts"]["fsdp"]


def test_batch_size_auto_takes_the_largest_split_of_the_global_batch_that_fits_the_gpu(tmp_path):
    """The paper configs' batch_size='auto' on N H100s: the largest divisor of each GPU's share of the
    global batch whose plan fits 90 % of the H100's memory (the next larger divisor's does not)."""
    config = config_of("config/baseline_7b.py", f"--data_dir={tmp_path / 'c4'}")
    assert config["batch_size"] == "auto"
    vocab, room = plan.run_vocab(config), memory.AUTO_BATCH_MEMORY * memory.GPU_MEMORY_GIB["H100"]
    p = plan.make_plan(config, 64, measure=False)
    batch = p["micro_batch"]
    assert 32 % batch == 0 and p["micro_steps"] == 32 // batch and p["tokens_per_step"] == 2048 * 2048
    on_gpu = {**config, "device": "cuda"}  # the plan's step, measured in the GPU's compute dtype
    assert memory.process_gib({**on_gpu, "batch_size": batch}, 64, vocab)[0] <= room
    assert batch > 1 and "batch_size='auto'" in plan.format_plan(p)
    assert plan.make_plan(config, 64, gpu="H200", measure=False)["micro_batch"] >= batch  # more memory, no smaller
    # on 8 GPUs the states take most of an 80 GiB card: fewer sequences fit, and the next larger
    # divisor of the 256 sequences each GPU takes does not
    fewer = plan.make_plan(config, 8, measure=False)["micro_batch"]
    assert fewer < batch and memory.process_gib({**on_gpu, "batch_size": fewer}, 8, vocab)[0] <= room
    assert memory.process_gib({**on_gpu, "batch_size": 2 * fewer}, 8, vocab)[0] > room
    # on 2 GPUs not even one sequence does: the plan is made at 1, and says so
    p = plan.make_plan(config, 2, measure=False)
    assert p["micro_batch"] == 1 and "batch_size='auto': not even 1 fits 90% of one H100" in plan.format_plan(p)
    assert memory.process_gib({**on_gpu, "batch_size": 1}, 2, vocab)[0] > room
    with pytest.raises(ConfigError, match="batch_size='auto' needs a global_batch_size"):
        plan.make_plan({**config, "global_batch_size": 0}, 64, measure=False)


@pytest.mark.slow
def test_train_resolves_batch_size_auto_from_the_device_and_records_the_number(tmp_path, data_dir):
    """On the CPU a tiny model's whole share of the global batch fits: one micro-step of 24; the
    checkpoint's config holds the number the run trained with, not 'auto'."""
    out = subprocess.run([sys.executable, "train.py", "config/lowres_baseline.py", f"--data_dir={data_dir}",
                          f"--out_dir={tmp_path / 'run'}", "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16",
                          "--batch_size=auto", "--global_batch_size=24", "--max_iters=1", "--eval_interval=1",
                          "--eval_iters=1", "--final_eval=False", "--num_threads=1"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "batch_size='auto': 24 sequences per process and micro-step on cpu" in out.stdout
    saved = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["config"]
    assert saved["batch_size"] == 24 and saved["gradient_accumulation_steps"] == 1
    refused = subprocess.run([sys.executable, "train.py", "config/lowres_baseline.py", "--batch_size=auto",
                              "--dry_run=True"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.startswith("error: batch_size='auto' needs a global_batch_size")


def test_mixtral_plan_counts_active_parameters():
    config = config_of("config/baseline_moe_8x1b.py", "--batch_size=1")
    p = plan.make_plan(config, 8, measure=False)
    V, L, C, H, E, k = 50304, config["n_layer"], config["n_embd"], config["ffn_hidden"], config["n_expert"], config["top_k"]
    assert p["params"] == llama_params(V, L, C, H, experts=E)
    assert p["active_params"] == p["params"] - L * (E - k) * 3 * C * H


def test_dropless_plan_counts_the_routed_experts_only():
    """The 8x1B configs route dropless (moe.py): their FLOPs per step, and so train.py's MFU
    (plan.training_flops_per_token), count top_k = 2 experts a token, not the 8 the static path's capacity N
    computes. By hand: 6 per matmul weight a token meets (blocks with 2 of the 8 experts, router, head;
    no input embedding) plus 12 L C T for attention; SimReg's similarities are not counted."""
    config = config_of("config/simreg_moe_8x1b.py", "--batch_size=1")
    assert config["moe_routing"] == "dropless"
    V, L, C, H, E, k, T = (50304, config["n_layer"], config["n_embd"], config["ffn_hidden"], config["n_expert"],
                           config["top_k"], config["block_size"])
    routed = 6 * (llama_params(V, L, C, H, experts=E) - L * (E - k) * 3 * C * H - V * C) + 12 * L * C * T
    p = plan.make_plan(config, 64, measure=False)
    assert p["flops_per_step"] == routed * p["tokens_per_step"]
    assert config_of("config/baseline_moe_8x1b.py")["moe_routing"] == "dropless"  # the pair computes alike
    baseline = plan.make_plan(config_of("config/baseline_moe_8x1b.py", "--batch_size=1", "--moe_routing=capacity"),
                              64, measure=False)
    assert baseline["flops_per_step"] - p["flops_per_step"] == 6 * L * (E - k) * 3 * C * H * p["tokens_per_step"]


def test_plan_warns_when_the_data_is_read_more_than_once(tmp_path, data_dir):
    config = config_of("config/lowres_baseline.py", f"--data_dir={data_dir}")
    text = plan.format_plan(plan.make_plan(config, measure=False))
    assert "warning: the run passes over its data" in text
    short = plan.make_plan({**config, "max_iters": 1}, measure=False)
    assert short["data"]["passes"] < 1 and "warning" not in plan.format_plan(short)


def test_plan_counts_epochs_or_the_share_of_the_data_never_seen(data_dir):
    """data_order='epoch' (the C4 configs): the run's windows over the split's windows, as data.EpochWindows
    counts them when it draws them; 'random' (the toys): the expected share of the training split in
    no window, against a simulation of the run's draws (sample_windows)."""
    import numpy as np
    import torch
    from data import EpochWindows, sample_windows
    n = json.load(open(os.path.join(data_dir, "meta.json")))["n_train"]
    c4 = config_of("config/c4_tiny.py", f"--data_dir={data_dir}", "--block_size=16", "--max_iters=300")
    d = plan.make_plan(c4, measure=False)["data"]
    windows = EpochWindows(n, 16, seed=0)
    windows.next(300 * 8)
    assert d["epochs"] == pytest.approx(windows.epoch + windows.index / windows.n_windows) and 2 < d["epochs"] < 3
    assert f"{d['tokens']:,} tokens trained = {d['epochs']:.2f} epochs of the training split" in plan.format_plan(
        plan.make_plan(c4, measure=False))
    toy = config_of("config/lowres_baseline.py", f"--data_dir={data_dir}", "--block_size=16", "--batch_size=8",
                    "--max_iters=150")  # 1200 windows of 17 tokens: about one pass
    d = plan.make_plan(toy, measure=False)["data"]
    unseen = []
    for seed in range(20):
        starts, _ = sample_windows(n, 16, 150 * 8, torch.Generator().manual_seed(seed))
        covered = np.zeros(n, dtype=bool)
        for s in starts.tolist():
            covered[s:s + 17] = True
        unseen.append(1 - covered.mean())
    assert d["unseen"] == pytest.approx(np.mean(unseen), abs=0.01) and 0.3 < d["unseen"] < 0.45
    assert f"leave about {d['unseen']:.1%} of it never seen" in plan.format_plan(plan.make_plan(toy, measure=False))


def test_the_c4_configs_read_every_window_once_per_epoch_and_the_toys_at_random():
    for name in sorted(os.listdir(os.path.join(REPO, "config"))):
        if name.endswith(".py"):
            config = config_of(f"config/{name}")
            c4 = os.path.basename(config["data_dir"]).startswith("c4")
            assert config["data_order"] == ("epoch" if c4 else "random"), name


def test_plan_memory_activations_are_measured():
    config = config_of("config/c4_tiny.py")
    p = plan.make_plan(config, 1)
    parts = p["memory_parts"]
    assert 0 < parts["act_ckpt"] < parts["act"]
    assert p["memory"]["ddp"]["plain"] == pytest.approx(16 * p["params"] / GiB + parts["act"])


def test_plan_refuses_what_the_run_would_refuse():
    config = config_of("config/baseline_7b.py", "--batch_size=1")
    with pytest.raises(ConfigError, match="global_batch_size"):
        plan.make_plan(config, 3, measure=False)
    with pytest.raises(ConfigError, match="unknown gpu"):
        plan.make_plan(config, 8, gpu="Z80", measure=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lowres_cwt_ft.py", "lowres_margin_0.6_se.py", "baseline_350m.py"])
def test_train_dry_run_prints_the_plan(name):
    """--dry_run needs no data, weights or checkpoint to start from (the CWT fine-tune names one)."""
    result = subprocess.run([sys.executable, "train.py", f"config/{name}", "--dry_run=True", "--vocab_size=130"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("params: ") and "FLOPs/step" in result.stdout and "fsdp:" in result.stdout
    assert "communication: none (one process)" in result.stdout
    # planned for the device the run would use (device='auto'): a GPU as an H100, else this CPU
    assert ("on 1 x H100 at MFU 40%" if torch.cuda.is_available() else "on 1 x cpu at ") in result.stdout


@pytest.mark.slow
def test_train_dry_run_on_the_cpu_plans_for_the_cpu():
    """--device=cpu: this CPU's measured speed and the process's memory; a device the machine lacks
    is refused in one line that names plan.py for a plan made elsewhere."""
    result = subprocess.run([sys.executable, "train.py", "config/lowres_ce.py", "--dry_run=True",
                             "--vocab_size=130", "--device=cpu"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "on 1 x cpu at " in result.stdout and "the toy's CE step measured here now" in result.stdout
    assert "memory of the process (MiB; " in result.stdout
    # the time in a unit that shows it (how long depends on how busy this machine is now)
    assert re.search(r"= [1-9][0-9,.]* (s|min|h) on 1 x cpu", result.stdout) and "0.0" not in result.stdout
    if not torch.cuda.is_available():
        result = subprocess.run([sys.executable, "train.py", "config/lowres_ce.py", "--dry_run=True",
                                 "--vocab_size=130", "--device=cuda"], cwd=REPO, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 2 and "python plan.py <config> --gpu H100" in result.stderr


def test_memory_problem_passes_what_fits_and_names_what_would():
    """train.py's check: None when the plan's figure fits; otherwise one line whose every
    suggestion the plan itself says fits, and the run as configured does not."""
    config = {**config_of("config/c4_tiny.py"), "dtype": "float32"}
    need, states = memory.process_gib(config, 1, 50304)
    ckpt = memory.process_gib({**config, "activation_checkpointing": True}, 1, 50304)[0]
    assert states < ckpt < need
    assert memory.memory_problem(config, 1, 50304, need * 1.01, "cpu") is None
    between = (ckpt + need) / 2  # enough with activation checkpointing only
    message = memory.memory_problem(config, 1, 50304, between, "cpu (test)")
    assert message.startswith(f"this run needs {need:.1f} GiB per process") and "cpu (test) has" in message
    assert "--activation_checkpointing=True" in message and "--check_memory=False" in message
    assert "\n" not in message
    # on the CPU the heap's allowance: a fraction of the step's transient tensors on top
    assert memory.process_gib(config, 1, 50304, heap=0.5)[0] == pytest.approx(need + 0.5 * (need - states))
    assert memory.memory_problem(config, 1, 50304, need * 1.01, "cpu", heap=0.5).startswith(
        f"this run needs {need + 0.5 * (need - states):.1f} GiB")


def smallest_fsdp(message):
    return int(message.split(" processes (torchrun)")[0].split(" on ")[-1])


def test_memory_problem_of_a_7b_model_suggests_the_smallest_fsdp_that_fits():
    """A 7B model in 24 GiB: its activations counted on the meta device (nothing allocated), and
    the FSDP suggestion is the smallest power of two whose plan fits."""
    config = {**config_of("config/baseline_7b.py", "--batch_size=1", "--global_batch_size=0"), "dtype": "float32"}
    message = memory.memory_problem(config, 1, 50304, 24.0, "cpu")
    need = memory.process_gib(config, 1, 50304)[0]
    assert message.startswith(f"this run needs {need:.1f} GiB per process (weights, gradients, AdamW states and "
                              "activations")
    # the recipe keeps the weights gathered over each step: 27.6 GB in fp32 on every process, whatever
    # the number of processes, so the suggestion also turns that off
    assert "--parallel=fsdp --fsdp_keep_gathered=False on " in message
    n, fsdp = smallest_fsdp(message), {**config, "parallel": "fsdp", "fsdp_keep_gathered": False}
    assert memory.process_gib(fsdp, n, 50304)[0] <= 24.0 < memory.process_gib(fsdp, n // 2, 50304)[0]


def test_memory_problem_of_experts_counts_their_activations_measured_on_meta():
    """A mixture of experts runs on meta like the rest (static shapes): nothing is allocated, and
    the activations, capacity buffers included, are counted with the states."""
    config = {**config_of("config/baseline_moe_8x1b.py", "--batch_size=1", "--global_batch_size=0",
                          "--moe_routing=capacity"), "dtype": "float32"}
    message = memory.memory_problem(config, 1, 50304, 24.0, "cpu")
    need = memory.process_gib(config, 1, 50304)[0]
    assert need > memory.process_gib(config, 1, 50304, measure=False)[1]  # the activations are in
    assert message.startswith(f"this run needs {need:.1f} GiB per process (weights, gradients, AdamW states and "
                              "activations")
    assert config["activation_checkpointing"]  # the config has it: the line names what else would fit
    assert "--parallel=fsdp --fsdp_keep_gathered=False on " in message
    n = smallest_fsdp(message)
    fsdp = {**config, "parallel": "fsdp", "activation_checkpointing": True, "fsdp_keep_gathered": False}
    assert memory.process_gib(fsdp, n, 50304)[0] <= 24.0 < memory.process_gib(fsdp, n // 2, 50304)[0]
    # the capacity's buffers are counted: a capacity of 1.25 x the routed slots needs less than every token
    fewer = {**config, "capacity_factor": 1.25}
    # and dropless routing holds the k N routed rows only (on meta at balanced_sizes), less again
    dropless = {**config, "moe_routing": "dropless"}
    blocks = [memory.activation_gib(c, GPTConfig.from_config(c, 50304), 16, 2048)["block"]
              for c in (dropless, fewer, config)]
    assert blocks == sorted(blocks) and len(set(blocks)) == 3


def test_ddp_communication_is_one_all_reduce_per_step():
    """DDP on 8 processes: 2 (N-1)/N x 4 bytes per parameter of the model and the objective (NITP's
    head), whatever the micro-steps; nothing on one process."""
    config = config_of("config/baseline_350m.py", "--batch_size=1", "--parallel=ddp", "--nitp_weight=1.0")
    by_micro_steps = [plan.make_plan({**config, "global_batch_size": 8 * k}, 8, measure=False) for k in (1, 4)]
    C, H = 1024, 2371
    params = llama_params(50304, 24, C, H) + 3 * C * 4 * C  # NITP's SwiGLU head: gate, up, down
    for p in by_micro_steps:
        assert p["communication"]["all_reduce"] == p["communication"]["total"] == pytest.approx(2 * 7 / 8 * 4 * params)
    alone = plan.make_plan({**config, "parallel": "none", "global_batch_size": 8}, 1, measure=False)
    assert alone["communication"]["total"] == 0 and alone["step_seconds"] == alone["compute_seconds"]


def test_every_gpu_has_a_link_and_link_gbps_overrides_it():
    assert comms.LINK_GBPS.keys() == GPU_PEAK_BF16_FLOPS.keys()
    config = config_of("config/baseline_7b.py", "--batch_size=1")
    p = plan.make_plan(config, 64, measure=False, link_gbps=800)
    assert p["link_gbps"] == 800 and p["communication"]["seconds"] == pytest.approx(p["communication"]["total"] * 8 / 800e9)
    with pytest.raises(ConfigError, match="link_gbps"):
        plan.make_plan(config, 64, measure=False, link_gbps=0)


@pytest.mark.parametrize("args,message", [
    (["--processes", "0"], "error: processes must be a positive integer, got 0"),
    (["--processes", "-1"], "error: processes must be a positive integer, got -1"),
    (["--mfu", "0"], "error: mfu must be in (0, 1] (a fraction of the GPU's peak), got 0.0"),
    (["--mfu", "1.5"], "error: mfu must be in (0, 1] (a fraction of the GPU's peak), got 1.5")])
def test_plan_cli_refuses_counts_and_fractions_out_of_range(args, message, capsys):
    """Once a ZeroDivisionError traceback (0) or a negative time printed with exit 0 (-1): one line,
    the usage error's status."""
    with pytest.raises(SystemExit) as ended:
        plan.main([os.path.join(REPO, "config/baseline_350m.py"), *args])
    assert ended.value.code == 2 and capsys.readouterr().err == message + "\n"


@pytest.mark.parametrize("key,message", [
    ("--n_head=-4", "key 'n_head' must be a positive integer, got -4"),
    ("--n_layer=0", "key 'n_layer' must be a positive integer, got 0"),
    ("--learning_rate=-1", "key 'learning_rate' must be a finite number > 0, got -1.0"),
    ("--simreg_tau=0", "key 'simreg_tau' must be a finite number > 0, got 0.0")])
def test_plan_cli_applies_train_pys_rules(key, message, capsys):
    """Once a traceback (n_head), another key blamed (n_layer: nitp_layer) or a plan (a negative
    learning rate): the plan refuses what train.py refuses, in train.py's words."""
    with pytest.raises(SystemExit) as ended:
        plan.main([os.path.join(REPO, "config/baseline_350m.py"), key])
    assert ended.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_plan_cli_takes_link_gbps(capsys):
    plan.main([os.path.join(REPO, "config/baseline_350m.py"), "--processes", "16", "--link_gbps", "800"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("communication:"))
    assert "(ddp: all-reduce " in line and " at 800 Gb/s (--link_gbps) against " in line
    with pytest.raises(SystemExit) as ended:
        plan.main([os.path.join(REPO, "config/baseline_350m.py"), "--processes", "16", "--link_gbps", "-1"])
    assert ended.value.code == 2 and capsys.readouterr().err == "error: link_gbps must be > 0, got -1.0\n"


def test_plan_warns_in_one_line_when_communication_exceeds_compute():
    """The 7B config on 64 H100s at one sequence per micro-step, its weights gathered anew in each of
    32 micro-steps (fsdp_keep_gathered=False): longer than the step computes; the warning names the
    most micro-steps that would not, and that plan indeed has its communication within its compute,
    and keeping the weights gathered with its time and memory. At 8x the link: no warning. The
    recipe as shipped (kept gathered): no warning."""
    assert "exceeds compute" not in plan.format_plan(plan.make_plan(config_of("config/baseline_7b.py", "--batch_size=1"), 64,
                                                                    measure=False))
    config = config_of("config/baseline_7b.py", "--batch_size=1", "--fsdp_keep_gathered=False")
    text = plan.format_plan(plan.make_plan(config, 64, measure=False))
    warnings = [line for line in text.splitlines() if "exceeds compute" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: communication")
    batch = int(warnings[0].split("--batch_size=")[1].split()[0])
    fixed = plan.make_plan({**config, "batch_size": batch}, 64, measure=False)
    assert fixed["communication"]["seconds"] <= fixed["compute_seconds"]
    finer = plan.make_plan({**config, "batch_size": batch // 2}, 64, measure=False)
    assert finer["communication"]["seconds"] > finer["compute_seconds"]
    assert "exceeds compute" not in plan.format_plan(plan.make_plan(config, 64, measure=False, link_gbps=3200))
    kept = plan.make_plan({**config, "fsdp_keep_gathered": True}, 64, measure=False)
    assert f"--fsdp_keep_gathered=True: {kept['communication']['seconds']:.2f} s" in warnings[0]
    assert f"{kept['memory']['fsdp']['checkpointed']:.1f} GiB per GPU" in warnings[0]
    # the mixture of experts gathers all 8 experts: at capacity 1.25 (2.5 experts' worth of compute per token)
    # not even one micro-step is enough on 64 processes, and the warning names the most processes whose one
    # micro-step computes longer than it communicates. The recipe routes dropless (2 experts' compute): on 64
    # processes it warns too, and sharding within nodes of 8 (the config's comment) hides it.
    recipe = config_of("config/baseline_moe_8x1b.py", "--batch_size=8")  # 'auto''s choice on an H100
    assert "exceeds compute" in plan.format_plan(plan.make_plan(recipe, 64, measure=False))
    hybrid = plan.make_plan({**recipe, "fsdp_shard_size": 8}, 64, measure=False)
    assert "exceeds compute" not in plan.format_plan(hybrid)
    config = config_of("config/baseline_moe_8x1b.py", "--batch_size=1", "--moe_routing=capacity",
                       "--capacity_factor=1.25")
    warning = plan.format_plan(plan.make_plan(config, 64, measure=False)).split("warning: ")[1].split("\n")[0]
    n = int(warning.split(" processes, one micro-step")[0].split("on ")[-1])
    assert f"--batch_size={512 // n} each" in warning
    for processes, hidden in ((n, True), (next(m for m in range(n + 1, 65) if 512 % m == 0), False)):
        p = plan.make_plan({**config, "batch_size": 512 // processes}, processes, measure=False)
        assert p["micro_steps"] == 1 and (p["communication"]["seconds"] <= p["compute_seconds"]) == hidden


@pytest.mark.slow
def test_plan_communication_is_what_a_real_step_moves():
    """The plan's bytes per optimizer step and process against the buffer of every collective of
    one real step on 2 gloo processes (tools/bench_systems.py's comm_child counts them with a dispatch mode):
    DDP with 2 and 4 micro-steps, FSDP with 4 (fp32, activation checkpointing), with 2 (bf16
    all-gathers) and with 4 kept gathered (one all-gather per unit per step), the 350M width at 2
    blocks; within 10 % for each kind of collective."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "tools.bench", "--comm_child"], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["run"] for r in records] == list(bench_systems.COMM_RUNS)
    for record in records:
        if "skipped" in record:
            assert record["skipped"] == parallelism.fsdp_unavailable("cpu")
            continue
        config = config_of(*bench_systems.COMM_MODEL, *bench_systems.COMM_RUNS[record["run"]])
        planned = plan.make_plan(config, 2, measure=False)["communication"]
        assert record["other"] == {}, record["other"]
        for kind, sent in record["sent"].items():
            assert sent == pytest.approx(planned[kind], rel=0.1, abs=0.01 * planned["total"]), (record["run"], kind)
    if parallelism.fsdp_unavailable("cpu"):
        pytest.skip(f"DDP matched; the FSDP runs: {parallelism.fsdp_unavailable('cpu')}")


def test_moe_shards_on_a_dimension_the_ranks_divide_and_the_plan_counts_the_padding_left():
    """A MoE's stacked experts (E, hidden, C) with fewer experts than ranks: FSDP2's dim 0 would put
    them on E ranks and pad every all-gather to ranks/E times the weights; parallelism.shard_dim cuts
    them on the hidden dimension. The 8x1B on 64 ranks: each holds (8, 88, 2048) of each expert
    weight and nothing is padded, so the plan's bytes and memory are the weights'. Where no dimension
    divides, the plan counts the padding and says so."""
    assert parallelism.shard_dim((8, 5632, 2048), 64) == 1
    assert parallelism.shard_dim((50304, 2048), 64) == 0  # the router's (8, 2048): dim 1, as the experts'
    assert parallelism.shard_dim((8, 2048), 64) == 1
    assert parallelism.padded_numel((2, 30, 18), 4) == 4 * 30 * 18  # nothing divides 4: 2 experts padded to 4
    assert parallelism.padded_numel((10, 3), 4) == 12 * 3  # torch.chunk's rows: 3, 3, 3, 1, padded to 3 each
    config = {**config_of("config/simreg_moe_8x1b.py"), "batch_size": 8}
    p = plan.make_plan(config, 64, measure=False)
    model, objective = memory.meta_model(config, plan.run_vocab(config))
    n = model.num_params()
    assert p["padding"] is None and sum(memory.fsdp_units(model, 64)[0]) + memory.fsdp_units(model, 64)[1] == n
    assert p["communication"]["all_gather"] == pytest.approx(63 / 64 * 2 * n)  # bf16, kept gathered: once a step
    assert p["communication"]["reduce_scatter"] == pytest.approx(63 / 64 * 4 * n)
    padded = {**config, "vocab_size": 50305, "n_embd": 2050, "ffn_hidden": 5634, "n_head": 25}  # nothing divides 64
    q = plan.make_plan(padded, 64, measure=False)
    assert "fsdp pads" in plan.format_plan(q) and q["padding"] in plan.format_plan(q)
    model = memory.meta_model(padded, 50305)[0]
    assert q["communication"]["all_gather"] > 63 / 64 * 2 * model.num_params() * 7  # 8 experts padded to 64


@pytest.mark.slow
def test_moe_communication_is_what_a_counted_all_gather_moves_on_4_processes():
    """One FSDP step of each of tests/moe_comm.py's models on 4 gloo processes, every collective's
    buffer counted: the plan's all-gather and reduce-scatter bytes are the counted ones (within 1e-9),
    with 2 experts cut on the hidden dimension (each rank (2, 8, 16), none empty), 8 on dim 0, the
    8x1B's expert shard on 64 ranks ((·, 88, 2048) per expert), and where no dimension divides 4, the
    padded experts the plan counts (and the run's note)."""
    if parallelism.fsdp_unavailable("cpu"):
        pytest.skip(parallelism.fsdp_unavailable("cpu"))
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from moe_comm import MOE_MODELS
    from model import GPTConfig, build_model
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                             "tests/moe_comm.py"], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["model"]: r for r in (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))}
    assert list(records) == list(MOE_MODELS)
    shards = {"2 experts": ([2, 8, 16], "S(1)"), "8 experts": ([2, 32, 16], "S(0)"),
              "2 experts, nothing divides": ([1, 30, 18], "S(0)"), "the 8x1B's expert shard": ([2, 88, 2048], "S(1)")}
    for name, record in records.items():
        assert (record["expert_local_shape"], record["expert_placement"]) == shards[name], name
        assert record["other"] == {} and record["sent"]["all_reduce"] == 0
        with torch.device("meta"):
            model = build_model(GPTConfig(**MOE_MODELS[name]))
        planned = comms.communication_bytes(model, torch.nn.Module(), "fsdp", 4, 1, 4)
        for kind in ("all_gather", "reduce_scatter"):
            assert record["sent"][kind] == pytest.approx(planned[kind], rel=1e-9), (name, kind)
        unpadded = 3 / 4 * 4 * model.num_params()
        assert (planned["reduce_scatter"] > unpadded * 1.2) == (name == "2 experts, nothing divides"), name
    assert result.stdout.count("note: fsdp pads") == 1 and "mlp.gate [2, 30, 18]" in result.stdout


def test_a_dtype_slower_than_float32_on_the_cpu_is_said_with_both_speeds(monkeypatch):
    """float16 on a CPU without float16 units once trained many times slower with no word."""
    monkeypatch.setattr(speed, "measure_matmul_flops", lambda device, dtype: 50e9)  # float32's, "measured"
    assert speed.slow_dtype_notice("cpu", "float16", 1e9) == (
        "note: float16 matmuls run at 1 GFLOP/s on this CPU and float32's at 50: --dtype=float32 would "
        "train about 50x faster")
    assert speed.slow_dtype_notice("cpu", "bfloat16", 200e9) is None  # faster than float32 here
    assert speed.slow_dtype_notice("cpu", "float32", 1e9) is None
    assert speed.slow_dtype_notice("cuda:0", "float16", 1e9) is None
