"""The activation figures of plan.py (and tools/memory_table.py's table) hold: the tensor counter is
exact, and a step's peak grows linearly with depth, checked against direct measurements."""

import os

import pytest

import torch

import memory  # noqa: E402
import plan  # noqa: E402
from configurator import train_defaults  # noqa: E402
from model import GPTConfig  # noqa: E402
from tools import memory_table  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_peak_tensor_bytes_counts_live_storages_once():
    """The counter behind the plan's activations, against bytes written out by hand: a view is
    its storage's, a freed tensor stops counting, the peak stays."""
    with memory.PeakTensorBytes() as counter:
        a = torch.empty(1000)                  # 4000 bytes
        b = a.view(10, 100)[2:]                # a view: nothing new
        c = torch.empty(500, dtype=torch.float64)  # 4000 more: live 8000
        del a, b
        d = torch.empty(250)                   # a's storage freed: live 4000 + 1000
        assert counter.live == 5000
        del c, d
    assert counter.peak == 8000 and counter.live == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_activations_extrapolated_in_depth_match_a_direct_measurement(arch):
    """activation_gib measures 1 and 2 blocks and extrapolates; a 4-block step measured directly
    gives the same peak or up to 6 % less, for the plain objective and for SimReg + dispersion."""
    for extra in ({}, {"simreg_weight": 1.0, "dispersion_weight": 0.1}):
        config = {**train_defaults(), "arch": arch, "tie_weights": arch == "gpt2", "n_layer": 4, "n_head": 4,
                  "n_embd": 64, "block_size": 128, **extra}
        model_config = GPTConfig.from_config(config, 500)
        estimate = memory.activation_gib(config, model_config, batch_size=2, seq_len=128)
        direct = memory.step_peak_bytes(config, model_config, 4, 2, 128) / memory.GiB
        assert direct <= estimate["act"] <= 1.06 * direct  # the extra: the 1-block step's own transients
        assert estimate["act_ckpt"] < estimate["act"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_step_measured_on_meta_holds_what_it_holds_on_the_cpu(arch):
    """The plan measures on the meta device (nothing allocated) with the CPU flash attention's meta
    kernel: byte for byte the peak of the same step run for real on the CPU."""
    config = {**train_defaults(), "arch": arch, "tie_weights": arch == "gpt2", "n_layer": 2, "n_head": 4,
              "n_embd": 64, "block_size": 256, "simreg_weight": 1.0}
    model_config = GPTConfig.from_config(config, 300)
    for n_layer in (1, 2):
        assert memory.step_peak_bytes(config, model_config, n_layer, 2, 256, "meta") == \
            memory.step_peak_bytes(config, model_config, n_layer, 2, 256, "cpu")


def test_read_config_follows_includes():
    config = memory_table.read_config(os.path.join(REPO, "config", "simreg_7b.py"))
    assert (config["arch"], config["n_layer"], config["n_embd"], config["ffn_hidden"], config["vocab_size"]) == \
        ("llama", 32, 4096, 11008, 50304)
    assert config["batch_size"] == "auto"


def test_table_uses_each_configs_own_parallelism():
    """The 350M config trains with DDP: its states are whole on every GPU (~6 GiB), not sharded."""
    lines = memory_table.table_lines([os.path.join(REPO, "config", n) for n in ("baseline_350m.py", "baseline_1b3.py")], 8,
                               measure=False)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines if line.startswith("| baseline")}
    params_350m = float(rows["baseline_350m.py"][1].rstrip("B")) * 1e9
    assert rows["baseline_350m.py"][2] == "ddp" and rows["baseline_1b3.py"][2] == "fsdp"
    assert float(rows["baseline_350m.py"][4]) == pytest.approx(20 * params_350m / memory.GiB, rel=0.02)


def test_a_one_process_config_counts_as_ddp_on_several_gpus():
    """c4_tiny sets parallel='none' (one process); the table's 8-GPU row counts it as DDP, as its
    docstring says, where a plan of 'none' on 8 processes is refused."""
    lines = memory_table.table_lines([os.path.join(REPO, "config", "c4_tiny.py")], 8, measure=False)
    row = [line.split(" | ") for line in lines if line.startswith("| c4_tiny.py")]
    assert len(row) == 1 and row[0][2] == "ddp"


def test_a_plan_for_a_gpu_counts_the_gpus_cross_entropy():
    """losses.cross_entropy is F.cross_entropy on logits upcast to float32, on every device, so the
    meta device where the plan measures holds what a GPU holds: on (8 x 2048, 50304) bf16 logits
    its forward and backward hold 9.21 GiB above the logits, what one H100 measured (results/gpu.md,
    section 5): the upcast copy, log-softmax and the gradient, 4 bytes per logit each. A plan for a
    GPU (plan.py, train.py on cuda) measures its step in the compute dtype (memory.compute_dtype)."""
    import losses
    logits = torch.empty(8, 2048, 50304, device="meta", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    with memory.PeakTensorBytes() as counter:
        losses.cross_entropy(logits, targets).backward()
    assert round(counter.peak / memory.GiB, 2) == 9.21
    assert counter.peak == pytest.approx(3 * 4 * logits.numel(), rel=1e-4)
    config = {**train_defaults(), "arch": "llama", "tie_weights": False, "n_layer": 2, "n_head": 4, "n_embd": 64,
              "block_size": 128, "vocab_size": 4096, "dtype": "bfloat16", "batch_size": 4}
    model_config = GPTConfig.from_config(config, 4096)
    parts = {device: memory.activation_gib({**config, "device": device}, model_config, 4, 128)
             for device in ("cpu", "cuda")}
    act = {device: parts[device]["act"] for device in parts}
    # the CUDA step is measured in bf16: its logits 2 bytes each fewer than the CPU's fp32 ones, and
    # a block's activations between half and two thirds of the CPU's (the norms' float32 copies stay)
    assert (act["cpu"] - act["cuda"]) * memory.GiB > 2 * 4 * 128 * 4096
    assert 0.5 < parts["cuda"]["block"] / parts["cpu"]["block"] < 0.67
    p = plan.make_plan({**config, "device": "cpu", "max_iters": 10, "global_batch_size": 4}, 1)
    assert p["memory_parts"]["act"] == act["cuda"]


LAYER_KEYS = ([{"simreg_weight": 1.0, "simreg_layer": layer} for layer in range(-1, 5)]
              + [{"nitp_weight": 1.0, "nitp_layer": k, "nitp_prenorm": prenorm}
                 for k in range(0, 5) for prenorm in (False, True)]
              + [{"dispersion_weight": 0.1, "dispersion_layers": which} for which in ("all", "last")])


@pytest.mark.parametrize("keys", LAYER_KEYS, ids=lambda keys: ",".join(f"{k}={v}" for k, v in keys.items()))
def test_every_layer_key_passes_the_memory_check_and_trains_a_step(keys):
    """Each key that picks a hidden state by its block, at every valid value of a 4-block toy: the
    memory check (which measures the objective on the model cut to 1 and 2 blocks) and one training
    step of the whole model (issue 57: simreg_layer=3 ended before step 0)."""
    from model import build_model
    from objective import Objective, Trained
    config = {**train_defaults(), **keys, "vocab_size": 130, "batch_size": 4}
    assert config["n_layer"] == 4
    assert memory.device_memory_problem(config, 1, 130, "cpu") is None
    model = build_model(GPTConfig.from_config(config, 130))
    objective = Objective.from_config(config)
    x = torch.randint(0, 130, (2, config["block_size"]))
    loss, terms, _, _ = Trained(model, objective)(x, x)
    loss.backward()
    assert torch.isfinite(loss) and len(terms) == 2
    assert memory.objective_on_blocks(config, 2).n_layer == 2
