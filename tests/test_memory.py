"""The activation figures of plan.py (and tools/memory.py's table) hold: activations grow linearly
with depth and with sequence length (flash-style attention stores nothing of size T^2), checked
against direct measurements."""

import os

import pytest

import plan  # noqa: E402
from model import GPTConfig  # noqa: E402
from tools import memory  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("config", [
    GPTConfig(vocab_size=500, block_size=256, n_layer=3, n_head=4, n_embd=64, arch="llama", tie_weights=False),
    GPTConfig(vocab_size=500, block_size=256, n_layer=3, n_head=4, n_embd=64),
], ids=["llama", "gpt2"])
def test_activation_estimate_matches_a_direct_measurement(config):
    e = plan.activation_gib(config, batch_size=2, seq_len=256, measure_len=64)
    direct = plan.saved_activation_bytes(config, 3, 2, 256) / plan.GiB
    assert e["act"] == pytest.approx(direct, rel=0.02)
    assert e["act_ckpt"] < e["act"]


def test_read_config_follows_includes():
    config = memory.read_config(os.path.join(REPO, "config", "simreg_7b.py"))
    assert (config["arch"], config["n_layer"], config["n_embd"], config["ffn_hidden"], config["vocab_size"]) == \
        ("llama", 32, 4096, 11008, 50304)
    assert config["batch_size"] == 1


def test_table_uses_each_configs_own_parallelism():
    """The 350M config trains with DDP: its states are whole on every GPU (~6 GiB), not sharded."""
    lines = memory.table_lines([os.path.join(REPO, "config", n) for n in ("baseline_350m.py", "baseline_1b3.py")], 8)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines if line.startswith("| baseline")}
    params_350m = float(rows["baseline_350m.py"][1].rstrip("B")) * 1e9
    assert rows["baseline_350m.py"][2] == "ddp" and rows["baseline_1b3.py"][2] == "fsdp"
    assert float(rows["baseline_350m.py"][4]) == pytest.approx(20 * params_350m / plan.GiB, rel=0.02)
