"""
The GPU check's section 2 (tools/gpu_check.py): each loss, the model and each kind of compiled block
on the device, fused AdamW, the float16 path and the attention kernel.
"""

import math

import torch
import torch.nn.functional as F

import losses
from model import GPTConfig, build_model
from optim import apply_gradients
from tools.gpu_steps import build, time_step

LOSS_TOLERANCE = 2e-2  # relative (L2), of the value and of each input gradient

# each kind of block; the MoE's static and dropless routings
MODELS = {"gpt2": {"arch": "gpt2"}, "llama": {"arch": "llama"},
          "llama MoE": {"arch": "llama", "n_expert": 4},
          "llama MoE dropless": {"arch": "llama", "n_expert": 4, "moe_routing": "dropless"}}


def verdict(ok):
    return "ok" if ok else "**FAILED**"


def relative_error(a, b):
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def loss_cases(B, T, C, V):
    """name -> fn(loss_inputs) -> scalar: every loss of losses.py."""
    cases = {"cross_entropy": lambda t: losses.cross_entropy(t["logits"], t["y"]),
             "cross_entropy, margin 0.6": lambda t: losses.cross_entropy(t["logits"], t["y"], margin=0.6),
             "simreg": lambda t: losses.simreg(t["h_condensed"], t["y_small"]),
             "simreg, chunks of T/4": lambda t: losses.simreg(t["h_condensed"], t["y_small"],
                                                              chunk_size=T // 4),
             "nitp": lambda t: losses.nitp(t["h"], t["h2"]),
             "cwt": lambda t: losses.cwt(t["h"], t["y"], t["wte"])}
    for variant in losses.DISPERSION_VARIANTS:
        for form in losses.DISPERSION_FORMS:
            cases[f"dispersion {variant}, {form}"] = (
                lambda t, variant=variant, form=form: losses.dispersion([t["h"], t["h2"]], 1.0, variant,
                                                                        form))
    return cases


def loss_inputs(B, T, C, V, device, dtype):
    generator = torch.Generator().manual_seed(0)
    t = {"logits": 3 * torch.randn(B, T, V, generator=generator),
         "h": torch.randn(B, T, C, generator=generator), "h2": torch.randn(B, T, C, generator=generator),
         # condensed states (cosines near 1): SimReg at tau 0.01 is O(1) there, ~1e-34 on random ones
         "h_condensed": (torch.randn(B, 1, C, generator=generator)
                         + 0.1 * torch.randn(B, T, C, generator=generator)),
         "wte": torch.randn(V, C, generator=generator) / math.sqrt(C),
         "y": torch.randint(0, V, (B, T), generator=generator),
         "y_small": torch.randint(0, 8, (B, T), generator=generator)}  # repeated labels: SimReg has positives
    return {k: v.to(device, dtype if v.is_floating_point() else None)
            .requires_grad_(v.is_floating_point()) for k, v in t.items()}


def correctness(check):
    shape = check.sizes["loss_shape"]
    rows = []
    for name, fn in loss_cases(*shape).items():
        reference = loss_inputs(*shape, "cpu", torch.float64)
        value64 = fn(reference)
        value64.backward()
        device_inputs = loss_inputs(*shape, check.device, torch.float32)
        with check.autocast:
            value = fn(device_inputs)
        value.backward()
        errors = [relative_error(value, value64)] + [relative_error(device_inputs[k].grad, reference[k].grad)
                                                     for k in reference if reference[k].grad is not None]
        rows.append((name, f"{value64.item():.6f}", f"{value.item():.6f}", f"{errors[0]:.1e}",
                     f"{max(errors[1:]):.1e}", verdict(max(errors) <= LOSS_TOLERANCE)))
    check.line(f"Each loss on (B, T, C, V) = {shape}: float32 inputs on {check.device} under bf16 "
               "autocast against the same inputs in float64 on the CPU; relative error (L2) of the value "
               f"and of the worst input gradient, tolerance {LOSS_TOLERANCE:g}. (T <= "
               f"{losses.AUTHORS_MAX_POSITIONS}: beyond it the authors' dispersion draws a random subset of "
               "positions, a different one on each device.)\n")
    check.table(["loss", "float64 (CPU)", f"bf16 autocast ({check.device})", "value error", "gradient error",
                 ""], rows)

    rows = []
    compiled = []
    for name, keys in MODELS.items():
        config = check.config("config/c4_tiny.py", **check.sizes["small"], n_layer=2, **keys,
                              tie_weights=keys["arch"] == "gpt2", compile=False)
        rows.append((name, *against_float64(check, config)))
        compiled.append((name, *compiled_steps(check, {**config, "compile": True})))
    check.line(f"\nThe model (2 blocks, width {check.sizes['small']['n_embd']}): CE forward and backward "
               "under bf16 autocast against float64 on the CPU, same weights; tolerance 5e-2 on the loss and "
               "on all the gradients together (a router's gradient alone can move more: bf16 may flip a "
               "near-tie top-2 choice).\n")
    check.table(["model", "loss float64", "loss bf16", "loss error", "gradient error",
                 "worst single parameter", ""], rows)
    check.line(f"\nEach kind of block compiled with fullgraph=True ({check.sizes['compile_backend']}; "
               "parallelism.compile_blocks): graphs compiled in the first step, graph breaks, graphs "
               "compiled in 3 later steps (a recompile).\n")
    check.table(["block", "graphs", "graph breaks", "recompiles", "first step s", "later step ms", ""],
                compiled)

    # configure_optimizers' fused AdamW
    torch.manual_seed(0)
    params = [torch.randn(64, 64, device=check.device) for _ in range(3)]
    results = {}
    for fused in (True, False):
        ps = [p.clone().requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        for step in range(3):
            for i, p in enumerate(ps):
                p.grad = torch.sin(params[i] * (step + 1 + i))
            opt.step()
        results[fused] = torch.cat([p.detach().flatten() for p in ps])
    difference = (results[True] - results[False]).abs().max().item()
    moved = (results[False] - torch.cat([p.flatten() for p in params])).abs().max().item()
    check.line("\n- fused AdamW against unfused, 3 steps on the same gradients: max |difference| "
               f"{difference:.1e} (the steps moved the weights by up to {moved:.1e}): "
               f"{verdict(difference <= 1e-6)}")

    # float16: an overflowing step is skipped and the scale halves
    config = check.config("config/c4_tiny.py", **check.sizes["small"], n_layer=1, compile=False)
    trained, optimizers = build(check, config)
    model = trained.model
    scale = 2.0 ** 16
    scaler = torch.amp.GradScaler(check.device, init_scale=scale)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, config["vocab_size"], (2, 8), device=check.device)
    with torch.autocast(check.device, dtype=torch.float16):
        loss = losses.cross_entropy(model(x), x) * 1e30  # fp16's largest is 65504: the gradients overflow
    scaler.scale(loss).backward()
    stepped = apply_gradients(optimizers, scaler)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    check.line(f"- float16 + loss scaling, an overflowing step: stepped {stepped}, weights unchanged "
               f"{unchanged}, scale {scale:g} -> {scaler.get_scale():g}: "
               f"{verdict(not stepped and unchanged and scaler.get_scale() < scale)}")

    check.line(f"- scaled_dot_product_attention, causal, bf16: {attention_kernels(check)}")


def attention_kernels(check):
    """The kernels of one causal attention forward + backward at the 350M shape."""
    heads, T = (16, 2048) if check.cuda else (2, 32)
    q, k, v = (torch.randn(1, heads, T, 64, device=check.device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    attention()  # the profile is of a second run
    words = ("flash", "fmha", "attention", "cudnn", "efficient", "attn")
    names = [e.key for e in check.profiled(attention) if any(w in e.key.lower() for w in words)]
    return ", ".join(f"`{n[:90]}`" for n in names[:4]) or "no attention kernel found in the profile"


def against_float64(check, config):
    """A report row: the model's CE under bf16 autocast against float64 on the CPU."""
    cfg = GPTConfig.from_config(config, config["vocab_size"])
    torch.manual_seed(0)
    reference = build_model(cfg, "cpu").double()
    model = build_model(cfg, "cpu").to(check.device)
    model.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    loss64 = losses.cross_entropy(reference(x), x)
    loss64.backward()
    with check.autocast:
        loss = losses.cross_entropy(model(x.to(check.device)), x.to(check.device))
    loss.backward()
    params = dict(model.named_parameters())
    errors = {n: relative_error(params[n].grad, p.grad) for n, p in reference.named_parameters()}
    worst = max(errors, key=errors.get)
    whole = relative_error(torch.cat([params[n].grad.flatten().cpu() for n in errors]),
                           torch.cat([p.grad.flatten() for p in reference.parameters()]))
    loss_error = relative_error(loss, loss64)
    return (f"{loss64.item():.5f}", f"{loss.item():.5f}", f"{loss_error:.1e}", f"{whole:.1e}",
            f"{errors[worst]:.1e} (`{worst}`)", verdict(max(whole, loss_error) <= 5e-2))


def dynamo_graphs():
    """(graphs compiled, graph breaks) so far in this process."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compiled_steps(check, config):
    """A report row: the model compiled afresh, its first step's graphs and graph breaks,
    3 later steps' recompiles, their times."""
    torch._dynamo.reset()
    graphs0, breaks0 = dynamo_graphs()
    run = time_step(check, config, 2, 1, 0, 1)
    graphs1, _ = dynamo_graphs()
    later = check.step_times(run.step, 0, 3)[1]
    graphs2, breaks2 = dynamo_graphs()
    ok = breaks2 == breaks0 and graphs2 == graphs1 and graphs1 > graphs0
    return (graphs1 - graphs0, breaks2 - breaks0, graphs2 - graphs1, f"{run.first:.1f}",
            f"{1000 * later:.1f}", verdict(ok))
