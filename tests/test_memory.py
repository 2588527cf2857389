"""memory.py's extrapolations hold: activations grow linearly with depth and with sequence length
(flash-style attention stores nothing of size T^2), checked against direct measurements."""

import os

import pytest

from tools import memory  # noqa: E402
from model import GPTConfig  # noqa: E402


@pytest.mark.parametrize("config", [
    GPTConfig(vocab_size=500, block_size=256, n_layer=3, n_head=4, n_embd=64, arch="llama", tie_weights=False),
    GPTConfig(vocab_size=500, block_size=256, n_layer=3, n_head=4, n_embd=64),
], ids=["llama", "gpt2"])
def test_activation_estimate_matches_a_direct_measurement(config):
    e = memory.estimate(config, batch_size=2, seq_len=256, gpus=1, measure_len=64)
    direct = memory.saved_activation_bytes(config, 3, 2, 256) / memory.GiB
    assert e["act"] == pytest.approx(direct, rel=0.02)
    assert e["act_ckpt"] < e["act"]


def test_read_config_follows_includes():
    config, batch_size = memory.read_config(os.path.join(os.path.dirname(os.path.dirname(memory.__file__)), "config", "simreg_7b.py"))
    assert (config.arch, config.n_layer, config.n_embd, config.ffn_hidden, config.vocab_size) == ("llama", 32, 4096, 11008, 50304)
    assert batch_size == 1
