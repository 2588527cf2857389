"""The GPU speed paths, tested on the CPU: torch.compile of every block (parallelism.compile_blocks,
train.py's `compile` key) computes what the eager blocks compute, and the losses' full-fp32 region
(model.full_fp32) switches TF32 off for its matmuls and restores the step's setting after."""

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

import losses
import parallelism
from model import GPT, GPTConfig, LlamaBlock, rope_angles


def test_compiled_blocks_match_eager():
    """With the aot_eager backend (forward and backward traced into graphs, run by eager kernels):
    the mechanics in seconds; inductor's generated kernels take minutes of C++ compilation here,
    and are exercised by `--compile=True` runs (docs/performance.md)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16, arch="llama", tie_weights=False)
    eager, compiled = GPT(config), GPT(config)
    compiled.load_state_dict(eager.state_dict())
    parallelism.compile_blocks(compiled, backend="aot_eager")
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints are unchanged
    x = torch.randint(0, 50, (3, 16))
    for model in (eager, compiled):
        loss = losses.cross_entropy(model(x), x)
        loss.backward()
        model.loss = loss.detach()
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_mixture_of_experts_block_compiles_as_one_graph():
    """fullgraph=True: no graph break (the routing has static shapes and no host sync), at a
    capacity that drops slots, so the dropping is traced too; aot_eager as above."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16, arch="llama", ffn_hidden=32,
                       n_expert=4, top_k=2, capacity_factor=0.75)
    eager = LlamaBlock(config)
    for p in eager.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, backend="aot_eager")
    cos, sin = rope_angles(16, 8, config.rope_theta, "cpu")
    x = torch.randn(3, 16, 16)
    for block in (eager, compiled):
        out = block(x, cos, sin)
        (out.square().mean() + block.mlp.aux_loss).backward()
        block.out = out.detach()
    assert eager.mlp.dropped_fraction.item() > 0
    torch.testing.assert_close(compiled.mlp.dropped_fraction, eager.mlp.dropped_fraction)
    torch.testing.assert_close(compiled.out, eager.out, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_mixture_of_experts_blocks_under_activation_checkpointing_match_eager():
    """train.py's order, compile then activation checkpointing around the compiled blocks, takes a MoE
    block whole (fullgraph=True). The other order cannot: the block's routing statistics (aux_loss,
    dropped_fraction) are attributes set in forward, a side effect torch.compile refuses inside a
    checkpoint, so the blocks would have run uncompiled."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, arch="llama", ffn_hidden=64,
                       n_expert=4, tie_weights=False)
    eager, compiled = GPT(config), GPT(config)
    compiled.load_state_dict(eager.state_dict())
    parallelism.compile_blocks(compiled, backend="aot_eager", fullgraph=True)
    parallelism.apply_activation_checkpointing(compiled)
    x = torch.randint(0, 64, (2, 16))
    for model in (eager, compiled):
        (losses.cross_entropy(model(x), x) + 0.02 * model.aux_loss).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    other_order = GPT(config)
    parallelism.apply_activation_checkpointing(other_order)
    parallelism.compile_blocks(other_order, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="(?i)side ?effect"):  # torch 2.6: "SideEffects"
        other_order(x)


class MatmulPrecision(TorchFunctionMode):
    """Records torch's float32 matmul precision at every matmul-like call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul, torch.bmm, torch.einsum, torch.Tensor.__matmul__,
                    torch.nn.functional.linear):
            self.seen.append(torch.get_float32_matmul_precision())
        return func(*args, **(kwargs or {}))


def test_losses_keep_full_fp32_when_the_step_uses_tf32():
    h = torch.randn(2, 8, 16)
    labels = torch.randint(0, 5, (2, 8))
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what train.py sets on CUDA
    try:
        with MatmulPrecision() as mode:
            losses.simreg(h, labels, tau=0.01)
            losses.cwt(h, labels, torch.randn(5, 16))
        assert mode.seen and set(mode.seen) == {"highest"}
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(saved)


@pytest.mark.parametrize("margin", [None, 0.6])
def test_the_chunked_heads_loss_and_gradient_compile_as_one_graph(margin):
    """losses._head_chunk is what torch.compile fuses on a GPU (linear_cross_entropy): it is
    captured whole (fullgraph, no graph break) and gives eager's token losses and gradient."""
    import losses
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(7, 13, generator=g), torch.randint(0, 13, (7,), generator=g)
    targets[2] = -1
    compiled = torch.compile(losses._head_chunk, backend="aot_eager", fullgraph=True, dynamic=False)
    for got, expected in zip(compiled(logits, targets, -1, margin), losses._head_chunk(logits, targets, -1, margin)):
        torch.testing.assert_close(got, expected)
