"""model.py, LLaMA and Mixtral blocks: each piece against its formula written out by hand, the
paper sizes against a closed-form count, and a forward/backward of every architecture."""

import math

import pytest
import torch
from torch.nn import functional as F

from model import GPT, GPTConfig, MixtureOfExperts, RMSNorm, apply_rope, build_model, rope_angles  # noqa: E402
import moe as moe_module  # noqa: E402

LLAMA = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16, arch="llama", tie_weights=False,
                  ffn_hidden=24)
MOE = GPTConfig(**{**LLAMA.__dict__, "n_expert": 4, "top_k": 2})


def test_rmsnorm_matches_formula():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    norm = RMSNorm(8).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    expected = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_rotates_pairs_by_position_times_frequency(layout):
    """Pair i is (i, i + D/2) in the half layout, (2i, 2i+1) in the interleaved one."""
    T, D, theta = 6, 8, 10000.0
    x = torch.randn(1, 1, T, D, dtype=torch.float64)
    cos, sin = rope_angles(T, D, theta, "cpu")
    out = apply_rope(x, cos.double(), sin.double(), layout)
    for t in range(T):
        for i in range(D // 2):
            angle = t * theta ** (-2 * i / D)
            first, second = (i, i + D // 2) if layout == "half" else (2 * i, 2 * i + 1)
            a, b = x[0, 0, t, first].item(), x[0, 0, t, second].item()
            assert out[0, 0, t, first].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-6)
            assert out[0, 0, t, second].item() == pytest.approx(a * math.sin(angle) + b * math.cos(angle), abs=1e-6)


def test_rope_half_rotates_in_the_compute_dtype():
    """Under bf16 the half layout stays in bf16 (cos and sin cast to it); the interleaved one in float32."""
    cos, sin = rope_angles(8, 16, 10000.0, "cpu")
    x = torch.randn(1, 2, 8, 16).bfloat16()
    half = apply_rope(x, cos, sin, "half")
    assert half.dtype == torch.bfloat16
    expected = apply_rope(x.double(), cos.double(), sin.double(), "half")
    torch.testing.assert_close(half.double(), expected, atol=0.05, rtol=0.02)
    assert apply_rope(x, cos, sin, "interleaved").dtype == torch.bfloat16


def test_layouts_are_one_function_up_to_a_permutation():
    """An interleaved model whose q and k rows are permuted within each head (tools/export_hf) is the
    half-layout model: the same logits."""
    from tools.export_hf import permute_heads
    torch.manual_seed(0)
    interleaved = build_model(GPTConfig(**{**LLAMA.__dict__, "rope_layout": "interleaved"})).double()
    half = build_model(LLAMA).double()
    weights = interleaved.state_dict()
    for key in [k for k in weights if k.endswith("attn.wqkv.weight")]:
        q, k, v = weights[key].split(LLAMA.n_embd)
        weights[key] = torch.cat([permute_heads(q, LLAMA.n_head), permute_heads(k, LLAMA.n_head), v])
    half.load_state_dict(weights)
    idx = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.block_size))
    torch.testing.assert_close(half(idx), interleaved(idx))
    assert not torch.allclose(build_model(LLAMA).double()(idx), interleaved(idx))


def test_a_checkpoint_without_its_layout_was_trained_interleaved():
    """GPTConfig.from_checkpoint: a LLaMA model_config written before 'rope_layout' was recorded
    is interleaved; one that records it keeps it; a GPT-2 one has no RoPE to fill in."""
    old = {k: v for k, v in LLAMA.__dict__.items() if k != "rope_layout"}
    assert GPTConfig.from_checkpoint(old).rope_layout == "interleaved"
    assert GPTConfig.from_checkpoint(LLAMA.__dict__).rope_layout == "half"
    assert GPTConfig.from_checkpoint({"arch": "gpt2"}).rope_layout == "half"
    with pytest.raises(ValueError, match="rope_layout"):
        GPTConfig(rope_layout="halves")


def test_residual_stream_in_the_compute_dtype_under_autocast():
    """Every hidden state a block returns is bf16 under bf16 autocast (the one-GPU and DDP path, as
    FSDP's bf16 parameters give), float32 without it; the final norm computes in float32."""
    model = build_model(LLAMA)
    idx = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.block_size))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, hidden = model(idx, return_hidden_states=True)
    assert {h.dtype for h in hidden} == {torch.bfloat16} and logits.dtype == torch.bfloat16
    assert {h.dtype for h in model(idx, return_hidden_states=True)[1]} == {torch.float32}


def test_rope_scores_depend_only_on_relative_position():
    D = 16
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    cos, sin = (a.double() for a in rope_angles(12, D, 10000.0, "cpu"))
    rotated = lambda v, t: apply_rope(v.view(1, 1, 1, D).expand(1, 1, 12, D), cos, sin)[0, 0, t]  # noqa: E731
    # (either layout: the pairs differ, not the angles)
    s1 = rotated(q, 7) @ rotated(k, 4)
    s2 = rotated(q, 3) @ rotated(k, 0)
    assert s1.item() == pytest.approx(s2.item(), rel=1e-6)  # the angles are computed in float32
    assert not math.isclose((rotated(q, 7) @ rotated(k, 5)).item(), s1.item(), rel_tol=1e-6)


def moe_by_hand(moe, x):
    """Mixtral's MLP token by token: softmax over all experts, keep the top_k, renormalise."""
    E, k = moe.gate.size(0), moe.top_k
    out = torch.zeros_like(x)
    f, P = torch.zeros(E, dtype=x.dtype), torch.zeros(E, dtype=x.dtype)
    for n in range(x.size(0)):
        probs = torch.softmax(moe.router.weight @ x[n], dim=0)
        chosen = sorted(range(E), key=lambda e: -probs[e].item())[:k]
        total = sum(probs[e] for e in chosen)
        for e in chosen:
            h = F.silu(moe.gate[e] @ x[n]) * (moe.up[e] @ x[n])
            out[n] += probs[e] / total * (moe.down[e] @ h)
            f[e] += 1.0 / (x.size(0) * k)
        P += probs / x.size(0)
    return out, E * (f * P).sum()


def moe_by_expert_loop(moe, x):
    """The MoE forward as model.py had it before its static shapes (issue 31): a loop over the
    experts, each on the tokens routed to it (torch.where: a data-dependent shape), nothing dropped."""
    shape, E = x.shape, moe.gate.size(0)
    x = x.reshape(-1, shape[-1])
    probs = torch.softmax(moe.router(x), dim=-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        token, slot = torch.where(top_e == e)
        h = F.silu(x[token] @ moe.gate[e].t()) * (x[token] @ moe.up[e].t())
        out = out.index_add(0, token, (h @ moe.down[e].t()) * top_p[token, slot, None])
    return out.view(shape)


def random_moe(config, seed, std=0.5):
    torch.manual_seed(seed)
    moe = MixtureOfExperts(config).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, std)
    return moe


def test_moe_matches_token_by_token_routing_and_balance_loss():
    moe = random_moe(MOE, 0)
    x = torch.randn(2, 5, MOE.n_embd, dtype=torch.float64)
    out = moe(x)
    expected, aux = moe_by_hand(moe, x.view(-1, MOE.n_embd))
    torch.testing.assert_close(out.view(-1, MOE.n_embd), expected)
    torch.testing.assert_close(moe.aux_loss, aux)


@pytest.mark.parametrize("capacity", ["all tokens", "the fullest expert's load"])
def test_moe_outputs_and_gradients_equal_the_loop_over_experts_when_nothing_is_dropped(capacity):
    """Float64, every parameter's gradient and the input's: at the default factor (n_expert /
    top_k: room for every token in every expert), and at the factor whose capacity is exactly
    the fullest expert's load (one slot less drops)."""
    moe, loop = random_moe(MOE, 2), random_moe(MOE, 2)
    x = torch.randn(3, 8, MOE.n_embd, dtype=torch.float64, requires_grad=True)
    x_loop = x.detach().clone().requires_grad_()
    if capacity != "all tokens":
        N, E, k = 24, MOE.n_expert, MOE.top_k
        fullest = torch.bincount(moe.router(x.view(N, -1)).topk(k, dim=-1).indices.flatten(), minlength=E).max().item()
        assert fullest < N
        moe.capacity_factor = (fullest - 1) * E / (N * k)
        moe(x)
        assert moe.dropped_fraction.item() > 0
        moe.capacity_factor = (fullest - 0.5) * E / (N * k)  # ceil(capacity_factor * N * k / E) = fullest
    out, expected = moe(x), moe_by_expert_loop(loop, x_loop)
    assert moe.dropped_fraction.item() == 0.0
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    torch.testing.assert_close(x.grad, x_loop.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(moe.named_parameters(), loop.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_moe_drops_the_slots_past_capacity_and_reports_their_share():
    """Brute force: walk the slots in GShard's order (every token's first choice in token order,
    then every second choice), fill each expert up to `capacity`; a slot that finds its expert
    full adds nothing. Each token's output is the sum over its kept slots."""
    config = GPTConfig(**{**MOE.__dict__, "capacity_factor": 0.5})
    moe = random_moe(config, 3)
    x = torch.randn(2, 12, MOE.n_embd, dtype=torch.float64)
    out = moe(x).view(-1, MOE.n_embd)
    xs = x.view(-1, MOE.n_embd)
    N, E, k = xs.size(0), MOE.n_expert, MOE.top_k
    capacity = math.ceil(0.5 * N * k / E)
    probs = torch.softmax(xs @ moe.router.weight.t(), dim=-1)
    top_p, top_e = probs.topk(k, dim=-1)
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    load, dropped, expected = [0] * E, 0, torch.zeros_like(xs)
    for j in range(k):
        for n in range(N):
            e = top_e[n, j].item()
            if load[e] == capacity:
                dropped += 1
                continue
            load[e] += 1
            h = F.silu(moe.gate[e] @ xs[n]) * (moe.up[e] @ xs[n])
            expected[n] += top_p[n, j] * (moe.down[e] @ h)
    assert 0 < dropped < N * k  # the case is a real one: some slots dropped, not all
    assert moe.dropped_fraction.item() == pytest.approx(dropped / (N * k), abs=1e-12)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    lost = expected.abs().sum(dim=1) == 0  # tokens whose every slot was dropped get exactly zero
    assert lost.any() and torch.equal(out[lost], torch.zeros_like(out[lost]))


def test_moe_shapes_do_not_depend_on_the_data():
    """On the meta device tensors have shapes and no values: a forward whose shapes depended on the
    routing (the loop over experts: torch.where) cannot run there; this one runs, backward too."""
    with torch.device("meta"):
        moe = MixtureOfExperts(GPTConfig(**{**MOE.__dict__, "capacity_factor": 1.25}))
        x = torch.randn(2, 5, MOE.n_embd, requires_grad=True)
        out = moe(x)
        (out.sum() + moe.aux_loss).backward()
        assert out.shape == x.shape and moe.gate.grad.shape == moe.gate.shape and moe.dropped_fraction.shape == ()
        with pytest.raises(NotImplementedError, match="nonzero"):
            moe_by_expert_loop(moe, x)


@pytest.mark.parametrize("E, k", [(2, 1), (2, 2), (8, 1), (8, 2)])
def test_dropless_outputs_and_gradients_equal_capacity_n_and_the_token_by_token_formula(E, k):
    """moe_routing='dropless' (the slots sorted by expert, each expert over its own rows) against the
    static path at capacity N (every expert computes every token: nothing can be dropped, the
    reference) in float64: outputs, aux_loss, the input's gradient and every parameter's; and the
    outputs against Mixtral's formula token by token (moe_by_hand). Nothing is dropped."""
    config = GPTConfig(**{**MOE.__dict__, "n_expert": E, "top_k": k})
    reference = random_moe(config, 4)
    dropless = random_moe(GPTConfig(**{**config.__dict__, "moe_routing": "dropless"}), 4)
    x = torch.randn(3, 7, MOE.n_embd, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, expected = dropless(x), reference(x_ref)
    assert dropless.dropped_fraction.item() == 0.0
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    by_hand, aux = moe_by_hand(dropless, x.detach().view(-1, MOE.n_embd))
    torch.testing.assert_close(out.detach().view(-1, MOE.n_embd), by_hand, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dropless.aux_loss, reference.aux_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dropless.aux_loss.detach(), aux)
    grad_out = torch.randn_like(out)
    ((out * grad_out).sum() + dropless.aux_loss).backward()
    ((expected * grad_out).sum() + reference.aux_loss).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(dropless.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_dropless_routing_is_validated_and_counts_the_routed_flops():
    with pytest.raises(ValueError, match="key 'moe_routing' must be one of capacity, dropless, got 'sorted'"):
        GPTConfig(**{**MOE.__dict__, "moe_routing": "sorted"})
    with pytest.raises(ValueError, match="moe_routing='dropless' has no capacity to set"):
        GPTConfig(**{**MOE.__dict__, "moe_routing": "dropless", "capacity_factor": 1.25})
    config = GPTConfig(**{**MOE.__dict__, "n_expert": 8, "moe_routing": "dropless"})
    assert config.experts_computed == config.top_k == 2
    with torch.device("meta"):
        model = GPT(config)
    L, C, T, V = config.n_layer, config.n_embd, config.block_size, config.vocab_size
    expert = 3 * C * config.ffn_width
    # 6 per weight a token meets: attention, router, 2 experts, norms, the head (untied: no input lookup)
    weights = L * (4 * C * C + 8 * C + 2 * expert + 2 * C) + C + V * C
    assert model.flops_per_token() == 6 * weights + 12 * L * C * T
    assert model.flops_per_token(backward=False) == (6 * weights + 12 * L * C * T) // 3


def test_dropless_runs_on_meta_with_balanced_groups():
    """The meta device has no routing to count: the loop takes balanced_sizes (k N rows in all, as a
    real step), so memory.py can measure a dropless step there, backward too."""
    assert moe_module.balanced_sizes(10, 4) == [3, 3, 2, 2] and sum(moe_module.balanced_sizes(7, 8)) == 7
    with torch.device("meta"):
        moe = MixtureOfExperts(GPTConfig(**{**MOE.__dict__, "moe_routing": "dropless"}))
        x = torch.randn(2, 5, MOE.n_embd, requires_grad=True)
        out = moe(x)
        (out.sum() + moe.aux_loss).backward()
    assert out.shape == x.shape and moe.gate.grad.shape == moe.gate.shape and moe.dropped_fraction.shape == ()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_swiglu_is_the_loop_over_experts():
    """The CUDA path's torch._grouped_mm contract, checked where this torch runs it on the CPU too (bf16
    only): rows sorted by expert, int32 running ends as offsets, an expert with no rows among them.
    Outputs and gradients equal the loop over split rows, both in bf16."""
    torch.manual_seed(5)
    E, C, H = 4, 16, 24
    counts = torch.tensor([3, 0, 6, 2])
    rows = torch.randn(int(counts.sum()), C, dtype=torch.bfloat16, requires_grad=True)
    weights = [torch.randn(E, *shape, dtype=torch.bfloat16, requires_grad=True) for shape in ((H, C), (H, C), (C, H))]
    try:
        grouped = moe_module.grouped_swiglu(rows, counts, *weights)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {e}")
    copies = [t.detach().clone().requires_grad_() for t in (rows, *weights)]
    looped = moe_module.looped_swiglu(copies[0], counts.tolist(), *copies[1:])
    torch.testing.assert_close(grouped, looped, rtol=2e-2, atol=2e-2)
    grad_out = torch.randn_like(looped)
    (grouped * grad_out).sum().backward()
    (looped * grad_out).sum().backward()
    for mine, theirs in zip((rows, *weights), copies):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=2e-2, atol=5e-2)
    assert not moe_module.use_grouped_mm(rows, weights[0])  # the CPU's dropless path is the loop


def test_moe_gradcheck():
    moe = random_moe(MOE, 1)
    x = torch.randn(1, 4, MOE.n_embd, dtype=torch.float64, requires_grad=True)
    # top-k is piecewise constant; a step of 1e-6 does not change which experts are chosen here
    assert torch.autograd.gradcheck(lambda x: (moe(x), moe.aux_loss), (x,))


def test_balance_loss_is_one_when_balanced_and_e_when_collapsed():
    moe = MixtureOfExperts(GPTConfig(**{**MOE.__dict__, "top_k": 1}))
    C, E = MOE.n_embd, MOE.n_expert
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(E, C) * 50)  # token e (one-hot) goes to expert e
        moe(torch.eye(E, C).view(1, E, C))
        assert moe.aux_loss.item() == pytest.approx(1.0, abs=1e-4)
        moe(torch.eye(E, C)[:1].expand(E, C).reshape(1, E, C))  # every token to expert 0
        assert moe.aux_loss.item() == pytest.approx(E, abs=1e-3)


def closed_form_params(L, C, F_, V, E=1, k=None):
    block = 4 * C * C + E * 3 * C * F_ + (C * E if E > 1 else 0) + 2 * C  # attn, experts, router, 2 norms
    active = 4 * C * C + (k or E) * 3 * C * F_ + (C * E if E > 1 else 0) + 2 * C
    return L * block + 2 * V * C + C, L * active + 2 * V * C + C


@pytest.mark.parametrize("name, L, H, C, F_, E", [
    ("350m", 24, 16, 1024, 2371, 1), ("1.3b", 24, 32, 2048, 5461, 1), ("3b", 26, 32, 3072, 8640, 1),
    ("7b", 32, 32, 4096, 11008, 1), ("moe 8x1b", 24, 32, 2048, 5632, 8)])
def test_paper_sizes_match_closed_form(name, L, H, C, F_, E):
    config = GPTConfig(vocab_size=50304, block_size=2048, n_layer=L, n_head=H, n_embd=C, ffn_hidden=F_, n_expert=E,
                       arch="llama", tie_weights=False)
    with torch.device("meta"):
        model = GPT(config)
    total, active = closed_form_params(L, C, F_, 50304, E, 2 if E > 1 else None)
    assert model.num_params() == total and model.num_params(active=True) == active
    # FLOPs per token: 6 x (computed matmul weights: no input embedding lookup) + attention; a
    # mixture of experts that may drop nothing computes every expert on every token
    assert model.flops_per_token() == 6 * (total - 50304 * C) + 12 * L * C * 2048
    if E > 1:  # capacity 1.25 * N * top_k / E per expert: 2.5 experts' worth per token
        with torch.device("meta"):
            model = GPT(GPTConfig(**{**config.__dict__, "capacity_factor": 1.25}))
        assert model.flops_per_token() == 6 * (active + L * 3 * C * F_ // 2 - 50304 * C) + 12 * L * C * 2048


@pytest.mark.parametrize("config", [GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16), LLAMA, MOE],
                         ids=["gpt2", "llama", "moe"])
def test_every_architecture_trains_one_step_and_is_causal(config):
    torch.manual_seed(0)
    model = build_model(config)
    x = torch.randint(0, 40, (3, 16))
    logits, hidden = model(x, return_hidden_states=True)
    assert logits.shape == (3, 16, 40) and len(hidden) == config.n_layer + 2
    loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
    if config.n_expert > 1:
        loss = loss + 0.02 * model.aux_loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 40
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :10], model(x)[:, :10])


def test_llama_init_std_and_untied_head():
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=2000, block_size=16, n_layer=2, n_head=4, n_embd=256, arch="llama",
                                  tie_weights=False))
    assert model.wpe is None and model.lm_head.weight is not model.wte.weight
    assert model.wte.weight.std().item() == pytest.approx(0.01, rel=0.02)
    assert model.h[0].mlp.gate.weight.std().item() == pytest.approx(0.01, rel=0.02)
    assert model.config.ffn_width == 768  # 8/3 * 256 = 682.7 -> next multiple of 256
    assert torch.equal(model.h[0].attn_norm.weight, torch.ones(256))
    moe = build_model(GPTConfig(**{**model.config.__dict__, "n_expert": 4, "n_embd": 64, "n_head": 2}))
    for w in (moe.h[0].mlp.gate, moe.h[0].mlp.up, moe.h[0].mlp.down):  # each expert's weights as a dense MLP's
        assert w.shape[0] == 4 and w.mean().abs().item() < 1e-3 and w.std().item() == pytest.approx(0.01, rel=0.02)


def test_bad_architecture_settings_say_which_key():
    with pytest.raises(ValueError, match="arch"):
        GPTConfig(arch="mamba")
    with pytest.raises(ValueError, match="top_k"):
        GPTConfig(arch="llama", n_expert=4, top_k=5)
    with pytest.raises(ValueError, match="n_expert"):
        GPTConfig(arch="gpt2", n_expert=4)


def test_balance_loss_is_hugging_faces_mixtral_loss_divided_by_top_k():
    """transformers' load_balancing_loss_func counts the routed slots per token (they sum to top_k)
    where ours takes their fraction (sums to 1): for one layer it is exactly top_k times ours."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    moe = random_moe(MOE, 4)
    x = torch.randn(2, 9, MOE.n_embd, dtype=torch.float64)
    moe(x)
    theirs = mixtral.load_balancing_loss_func((moe.router(x.view(18, -1)),), MOE.n_expert, MOE.top_k)
    assert theirs.item() == pytest.approx(MOE.top_k * moe.aux_loss.item(), rel=1e-6)
