"""model.py: shapes, hidden states, tying, init, causality, generation."""

import math

import torch

from model import GPT, GPTConfig, build_model  # noqa: E402

TINY = GPTConfig(vocab_size=30, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_paper_model_size():
    # Stop Jostling, Sec. 4.1 and Table 4: ~0.8M parameters for 4 layers, 4 heads, 128 channels,
    # vocab 130, block 64
    model = build_model(GPTConfig())
    assert model.num_params() == 812_416
    assert model.lm_head.weight is model.wte.weight


def test_hidden_states_are_embedding_blocks_and_final_norm():
    torch.manual_seed(0)
    model = build_model(TINY)
    x = torch.randint(0, 30, (3, 10))
    logits, hidden = model(x, return_hidden_states=True)
    assert logits.shape == (3, 10, 30)
    assert len(hidden) == TINY.n_layer + 2 and all(h.shape == (3, 10, 32) for h in hidden)
    assert torch.allclose(hidden[0], model.wte(x) + model.wpe(torch.arange(10)))
    assert torch.allclose(hidden[1], model.h[0](hidden[0]))
    assert torch.allclose(hidden[-1], model.ln_f(hidden[-2]))
    assert torch.allclose(logits, hidden[-1] @ model.wte.weight.T, atol=1e-6)
    assert torch.equal(model(x), logits)


def test_untied_model_has_its_own_head():
    model = build_model(GPTConfig(**{**TINY.__dict__, "tie_weights": False}))
    assert model.lm_head.weight is not model.wte.weight
    assert model.num_params() == build_model(TINY).num_params() + 30 * 32


def test_a_loss_reaches_each_embedding_by_name_on_tied_and_untied_models():
    """objective.Trained hands the objective model.embeddings(): 'input' is the table looked up
    for input tokens, 'output' the LM head. A term on 'output' trains the LM head of an untied
    model and the one shared matrix of a tied one; a term on 'input' (CWT) trains the token table."""
    from objective import Objective, Trained
    x = torch.randint(0, 30, (2, 8))
    for tied in (True, False):
        model = build_model(GPTConfig(**{**TINY.__dict__, "tie_weights": tied}))
        names = model.embeddings()
        assert names["input"] is model.wte.weight and names["output"] is model.lm_head.weight
        assert (names["input"] is names["output"]) == tied

        class OnOutput(Objective):  # a term on the output embedding alone, as docs/adding_a_loss.md adds one
            def forward(self, logits, hidden_states, targets, embeddings, ignore_index=-1, router_loss=None):
                return embeddings["output"].square().sum(), {}
        Trained(model, OnOutput(TINY.n_layer, TINY.n_embd))(x, x)[0].backward()
        assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
        assert (model.wte.weight.grad is not None) == tied
        model.zero_grad(set_to_none=True)
        headless = Objective(TINY.n_layer, TINY.n_embd, ce_weight=0.0, cwt_weight=1.0)
        loss, terms, logits, _ = Trained(model, headless)(x, x)
        loss.backward()
        assert logits is None and set(terms) == {"cwt"} and model.wte.weight.grad.abs().sum() > 0
        assert (model.lm_head.weight.grad is not None) == tied


def test_init_follows_gpt2():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=500, block_size=64, n_layer=4, n_head=4, n_embd=256, bias=True)
    model = build_model(config)
    assert abs(model.wte.weight.std().item() - 0.02) < 1e-3
    proj = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.h])
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * 4)) < 5e-4
    assert all((b.attn.c_attn.bias == 0).all() for b in model.h)
    assert (model.ln_f.weight == 1).all()


def test_meta_build_equals_eager_build_with_same_seed():
    eager = GPT(TINY)  # PyTorch's default init runs here, then init_weights() overwrites all of it
    torch.manual_seed(5)
    eager.init_weights()
    torch.manual_seed(5)
    meta = build_model(TINY)
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = build_model(TINY)
    x = torch.randint(0, 30, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 30
    assert torch.allclose(model(x)[:, :8], model(y)[:, :8], atol=1e-6)
    assert not torch.allclose(model(x)[:, 8:], model(y)[:, 8:])


def test_generate_is_deterministic_with_a_generator_and_crops_context():
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    start = torch.zeros(1, 3, dtype=torch.long)
    a = model.generate(start, 20, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(start, 20, top_k=5, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 23) and torch.equal(a, b) and torch.equal(a[:, :3], start)


def test_flops_per_token():
    model = build_model(TINY)
    matmul_params = 2 * 12 * 32 * 32 + 30 * 32 + 2 * 2 * 32 + 32  # blocks (+ norms) and the tied head
    assert model.flops_per_token() == 6 * matmul_params + 12 * 2 * 32 * 16
