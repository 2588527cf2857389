"""Separated embeddings: a row with no gradient this step is not touched by the optimizer. Loss
scaling for float16 (optim.apply_gradients): exact when nothing overflows, a whole skipped update
when something does."""


import pytest
import torch

from losses import cross_entropy  # noqa: E402
from model import GPTConfig, build_model  # noqa: E402
from optim import AdaGC, SeparatedRowsAdamW, apply_gradients, configure_optimizers  # noqa: E402

HP = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def test_equals_torch_adamw_when_every_row_has_a_gradient():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    reference = torch.optim.AdamW([a], foreach=False, **HP)
    ours = SeparatedRowsAdamW([b], **HP)
    for _ in range(10):
        grad = torch.randn(6, 4, dtype=torch.float64)
        a.grad, b.grad = grad.clone(), grad.clone()
        reference.step()
        ours.step()
    assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert torch.allclose(reference.state[a]["exp_avg"], ours.state[b]["exp_avg"], atol=1e-15)
    assert torch.allclose(reference.state[a]["exp_avg_sq"], ours.state[b]["exp_avg_sq"], atol=1e-15)


def test_row_without_gradient_is_bitwise_unchanged_and_counts_its_own_steps():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = SeparatedRowsAdamW([p], **HP)
    for _ in range(3):  # build up momentum in every row
        p.grad = torch.randn(5, 3)
        opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    weights = p.detach().clone()
    grad = torch.randn(5, 3)
    grad[2] = 0.0
    p.grad = grad
    opt.step()
    assert torch.equal(p[2], weights[2])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[p][key][2], before[key][2]), key
    assert not torch.equal(p[1], weights[1])
    assert opt.state[p]["step"].flatten().tolist() == [4, 4, 3, 4, 4]
    # the next time row 2 gets a gradient it takes its 4th step, as a separate parameter would
    single = torch.nn.Parameter(torch.zeros(1, 3))
    twin = SeparatedRowsAdamW([single], **HP)
    twin.state[single] = {k: v[2:3].clone() for k, v in opt.state[p].items()}
    single.data.copy_(p.detach()[2:3])
    g = torch.randn(5, 3)
    p.grad, single.grad = g, g[2:3].clone()
    opt.step()
    twin.step()
    assert torch.equal(p[2:3], single)


def test_plain_adamw_moves_a_row_without_gradient():
    """Why SE needs its own optimizer: with torch.optim.AdamW (also what the authors' one-Parameter-
    per-row version amounts to, because torch.stack hands every row a zero gradient, not None),
    momentum and weight decay move a row whose gradient is zero."""
    rows = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(3)) for _ in range(4)])
    opt = torch.optim.AdamW(rows.parameters(), **HP)
    for step in range(3):
        weight = torch.stack(list(rows))
        mask = torch.ones(4, 1)
        if step == 2:
            mask[1] = 0.0  # row 1 is not used in this step's loss
        (weight * mask).pow(2).sum().backward()
        assert rows[1].grad is not None  # zeros, not None: AdamW will step it
        before = rows[1].detach().clone()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(rows[1].detach(), before)


class ListingTwoEmbedding(torch.nn.Module):
    """Stop Jostling's Listing 2 (App. C), as the paper prints it: one 1-D parameter per token,
    stacked into a table in every forward."""

    def __init__(self, table):
        super().__init__()
        self.rows = torch.nn.ParameterList([torch.nn.Parameter(row.clone()) for row in table])

    def forward(self, idx):
        return torch.stack(list(self.rows))[idx]


def test_listing_two_under_adamw_takes_the_steps_of_a_stacked_table():
    """Separated embeddings as released change no update: under torch.optim.AdamW, with the rows in
    the decayed group (as the authors' SE model puts them), Listing 2's rows follow exactly the
    steps of one nn.Embedding table, rows without gradient included (stack's backward gives them
    zeros, not None), so "SE as released" needs no key of its own. SeparatedRowsAdamW, the paper's
    text, leaves those rows where they are."""
    V, C = 8, 4
    g = torch.Generator().manual_seed(0)
    start, head = torch.randn(V, C, generator=g, dtype=torch.float64), torch.randn(C, V, generator=g, dtype=torch.float64)
    listing = ListingTwoEmbedding(start)
    table = torch.nn.Embedding(V, C).double()
    separated = torch.nn.Embedding(V, C).double()
    with torch.no_grad():
        table.weight.copy_(start)
        separated.weight.copy_(start)
    optimizers = [torch.optim.AdamW([{"params": list(listing.parameters()), "weight_decay": 0.1}], lr=1e-2,
                                    betas=(0.9, 0.99)),
                  torch.optim.AdamW([{"params": [table.weight], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.99)),
                  SeparatedRowsAdamW([separated.weight], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)]
    unused_moved = 0
    for step in range(6):
        used = 5 if step < 3 else 3  # from step 3 on, rows 3..7 are neither inputs nor targets
        x = torch.randint(0, used, (2, 5), generator=g)
        y = torch.randint(0, used, (2, 5), generator=g)
        before = table.weight.detach().clone()
        for embedding, opt in zip((listing, table, separated), optimizers):
            opt.zero_grad(set_to_none=True)
            # a fixed head that sees only the inputs' rows: a row outside x gets no gradient
            torch.nn.functional.cross_entropy((embedding(x) @ head).reshape(-1, V), y.reshape(-1)).backward()
        unused = torch.ones(V, dtype=torch.bool)
        unused[x.unique()] = False
        assert unused.any()
        for r in unused.nonzero().flatten().tolist():
            assert listing.rows[r].grad is not None and (listing.rows[r].grad == 0).all()
        separated_before = separated.weight.detach().clone()
        for opt in optimizers:
            opt.step()
        assert torch.allclose(torch.stack(list(listing.rows)), table.weight, rtol=0, atol=1e-14), step
        unused_moved += int((table.weight[unused] != before[unused]).any(dim=1).sum())
        assert torch.equal(separated.weight[unused], separated_before[unused])
    assert unused_moved > 0, "rows without gradient must move under AdamW (momentum and decay)"
    assert not torch.allclose(separated.weight, table.weight)


def test_gpt_step_with_thresholding_leaves_unused_embedding_rows_untouched():
    """A real training step: tied embedding, margin 0 thresholding. Rows that are neither inputs
    nor targets and fall below the target everywhere get an all-zero gradient; after the step
    they and their optimizer state are bitwise unchanged, while used rows moved."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=130, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizers = configure_optimizers(model, 1e-2, 0.1, (0.9, 0.99), separate_embeddings=True)
    assert isinstance(optimizers[-1], SeparatedRowsAdamW)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        shape = (1, 2) if step == 3 else (2, 8)  # few positions: many rows below the target everywhere
        x = torch.randint(0, 130, shape, generator=g)
        y = torch.randint(0, 130, shape, generator=g)
        cross_entropy(model(x), y, margin=0.0 if step == 3 else None).backward()
        wte = model.wte.weight
        if step == 3:
            zero_rows = (wte.grad == 0).all(dim=1)
            assert zero_rows.sum() > 10, "the example must contain rows without gradient"
            state = optimizers[-1].state[wte]
            before = (wte.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), state["step"].clone())
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = optimizers[-1].state[wte]
    after = (wte.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"])
    for old, new in zip(before, after):
        assert torch.equal(old[zero_rows], new[zero_rows])
        assert not torch.equal(old[~zero_rows], new[~zero_rows])


def test_configure_optimizers_groups():
    model = build_model(GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16, bias=True))
    (adamw,) = configure_optimizers(model, 1e-3, 0.1, (0.9, 0.99))
    decay, no_decay = adamw.param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    n = sum(p.numel() for group in adamw.param_groups for p in group["params"])
    assert n == model.num_params()  # every parameter once, the tied matrix included
    adamw, rowwise = configure_optimizers(model, 1e-3, 0.1, (0.9, 0.99), separate_embeddings=True)
    assert rowwise.param_groups[0]["params"][0] is model.wte.weight
    assert all(p is not model.wte.weight for group in adamw.param_groups for p in group["params"])


def test_embedding_weight_decay_applies_to_the_embedding_only():
    model = build_model(GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16, bias=True))
    (adamw,) = configure_optimizers(model, 1e-3, 0.1, (0.9, 0.99), embedding_weight_decay=0.0)
    decay, no_decay, embedding = adamw.param_groups
    assert embedding["params"] == [model.wte.weight] and embedding["weight_decay"] == 0.0
    assert decay["weight_decay"] == 0.1 and decay["params"] and all(p is not model.wte.weight for p in decay["params"])
    assert sum(p.numel() for g in adamw.param_groups for p in g["params"]) == model.num_params()
    _, rowwise = configure_optimizers(model, 1e-3, 0.1, (0.9, 0.99), separate_embeddings=True, embedding_weight_decay=0.0)
    assert rowwise.param_groups[0]["weight_decay"] == 0.0
    (same,) = configure_optimizers(model, 1e-3, 0.1, (0.9, 0.99), embedding_weight_decay=0.1)
    assert len(same.param_groups) == 2  # equal to weight_decay: no group of its own


def test_learning_rate_schedule_closed_forms():
    from optim import learning_rate_at
    lr = lambda step, schedule="cosine": learning_rate_at(step, 1e-3, 100, schedule, 1100, 1e-4)  # noqa: E731
    assert lr(0) == pytest.approx(1e-3 / 101) and lr(99) == pytest.approx(1e-3 * 100 / 101)  # linear warm-up
    assert lr(100) == pytest.approx(1e-3) and lr(1100) == pytest.approx(1e-4) and lr(5000) == 1e-4
    assert lr(600) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # halfway down the cosine: the midpoint
    assert lr(600, "constant") == lr(5000, "constant") == 1e-3


def _two_optimizer_setup(seed=0):
    """A GPT with SE (two optimizers: fused AdamW and the row-wise one) and a batch."""
    torch.manual_seed(seed)
    model = build_model(GPTConfig(vocab_size=40, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizers = configure_optimizers(model, 1e-2, 0.1, (0.9, 0.99), separate_embeddings=True)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 40, (2, 8), generator=g), torch.randint(0, 40, (2, 8), generator=g)
    return model, optimizers, x, y


def _snapshot(model, optimizers):
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    states = [[{k: v.clone() for k, v in opt.state[p].items()} for group in opt.param_groups for p in group["params"]]
              for opt in optimizers]
    return weights, states


def _assert_same(a, b):
    (wa, sa), (wb, sb) = a, b
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for opt_a, opt_b in zip(sa, sb):
        assert len(opt_a) == len(opt_b) and all(a.keys() == b.keys() for a, b in zip(opt_a, opt_b))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(opt_a, opt_b) for k in a)


def test_loss_scaling_gives_the_unscaled_update_bit_for_bit():
    """Scaling the loss by a power of two and dividing the gradients back is exact in float32
    (only the exponent changes), so three steps with loss scaling and gradient clipping land on
    the same weights and optimizer states, bit for bit, as three steps without."""
    runs, norms = [], {False: [], True: []}
    for enabled in (False, True):
        model, optimizers, x, y = _two_optimizer_setup()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, enabled=enabled)

        def clip():  # records the norm it clipped (> 0.5: it acts)
            norms[enabled].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        for _ in range(3):
            scaler.scale(cross_entropy(model(x), y)).backward()
            assert apply_gradients(optimizers, scaler, clip)
            assert all(p.grad is None for p in model.parameters())
        runs.append(_snapshot(model, optimizers))
    assert norms[True] == norms[False] and min(norms[False]) > 0.5  # clipping saw the true gradients
    _assert_same(*runs)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_overflowing_step_is_skipped_on_every_optimizer_and_the_scale_halves(bad):
    """An inf or NaN in one gradient (of the main AdamW's parameters) skips the whole update:
    the weights, both optimizers' states and AdaGC's history stay bitwise as they were, even the
    row-wise optimizer's embedding, whose own gradient was finite; the scale halves; the next
    clean step updates normally at the new scale."""
    model, optimizers, x, y = _two_optimizer_setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    clipper = AdaGC(model.parameters(), max_norm=1.0, warmup=1)
    scaler.scale(cross_entropy(model(x), y)).backward()
    assert apply_gradients(optimizers, scaler, clipper.clip_)  # one good step: optimizer and AdaGC states exist
    before, adagc_before = _snapshot(model, optimizers), {k: v for k, v in clipper.state_dict().items()}
    scaler.scale(cross_entropy(model(x), y)).backward()
    block_weight = next(p for n, p in model.named_parameters() if n.startswith("h.0.") and p.dim() == 2)
    block_weight.grad[0, 0] = bad
    assert model.wte.weight.grad.isfinite().all()
    assert not apply_gradients(optimizers, scaler, clipper.clip_)
    _assert_same(before, _snapshot(model, optimizers))
    assert clipper.state_dict()["step"] == adagc_before["step"]
    assert torch.equal(clipper.state_dict()["ema"], adagc_before["ema"])
    assert scaler.get_scale() == 2.0 ** 9
    assert all(p.grad is None for p in model.parameters())
    scaler.scale(cross_entropy(model(x), y)).backward()
    assert apply_gradients(optimizers, scaler, clipper.clip_)
    assert scaler.get_scale() == 2.0 ** 9  # grows only after 2,000 clean steps in a row
    assert not torch.equal(before[0]["wte.weight"], model.wte.weight)
