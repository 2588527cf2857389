"""Loading a checkpoint for evaluation or sampling holds one copy of the weights: evaluate.load_model
builds the model on the meta device and takes the checkpoint's memory-mapped tensors themselves,
where building it for real and copying the weights in held two (issue 42). Measured as the growth
of the process's resident peak (VmHWM) across the load, in a fresh process."""

import dataclasses
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEASURE = """
import sys, torch
sys.path.insert(0, '.')
import evaluate

def peak():
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmHWM:'))

before = peak()
model, _ = evaluate.load_model(sys.argv[1])
with torch.no_grad():
    total = sum(float(p.sum(dtype=torch.float64)) for p in model.parameters())  # every page read
print(peak() - before, sum(p.numel() * p.element_size() for p in model.parameters()), total)
"""


def test_load_model_holds_one_copy_of_the_weights(tmp_path):
    config = GPTConfig(vocab_size=8192, block_size=64, n_layer=4, n_head=8, n_embd=1024, bias=False)
    torch.manual_seed(0)
    model = GPT(config)
    path = tmp_path / "best.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(config), "config": {},
                "iter_num": 0}, path)
    expected = sum(float(p.detach().sum(dtype=torch.float64)) for p in model.parameters())
    del model
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    growth, weight_bytes, total = int(out[0]), int(out[1]), float(out[2])
    assert total == expected  # the checkpoint's weights, tied matrix shared
    assert weight_bytes > 150e6
    # one copy and a fixed cost (building the model on meta, the reads in flight): 1.39 copies measured
    # here; a model built for real, then given the loaded weights, held 2.31
    assert growth < 1.6 * weight_bytes, (growth, weight_bytes)
