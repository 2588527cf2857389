"""
The training objective: the losses a config weighs, and Trained (the
model with its objective).
Design notes: docs/losses.md.
"""

from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import nn

import losses
from errors import (NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE_NUMBER,
                    Settings, one_of, setting)
# NITP's head is the same C -> hidden -> C block as a LLaMA MLP
from model import SwiGLU, fill_parameters


@dataclass
class ObjectiveConfig(Settings):
    """Every key of the objective, declared once, read by name. A loss
    is on when its <name>_weight is > 0; losses.py has their papers
    and recommended weights."""
    # next-token cross-entropy; 0 with cwt_weight > 0: headless
    ce_weight: float = setting(1.0, NON_NEGATIVE_NUMBER)
    # Stop Jostling's logit threshold on CE; None: plain CE
    margin: Optional[float] = setting(None, POSITIVE_NUMBER)
    # n > 0: LM head and CE together, n positions at a time
    ce_chunk_size: int = setting(0, NON_NEGATIVE)
    simreg_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    simreg_tau: float = setting(0.01, POSITIVE_NUMBER)
    simreg_chunk_size: int = setting(0, NON_NEGATIVE)  # 0: whole
    # -1: the final normed state; l: block l's output (0: embedding)
    simreg_layer: int = setting(
        -1, ("-1 or a block index >= 0", lambda v: v >= -1))
    dispersion_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    dispersion_tau: float = setting(1.0, POSITIVE_NUMBER)
    dispersion_variant: str = setting(
        "angular", one_of(*losses.DISPERSION_VARIANTS))
    # paper (Algorithm 1) | authors (the released code)
    dispersion_form: str = setting(
        "paper", one_of(*losses.DISPERSION_FORMS))
    # every block, or the last one
    dispersion_layers: str = setting("all", one_of("all", "last"))
    # P > 0: P random positions per layer (an estimate); 0: all
    dispersion_positions: int = setting(0, NON_NEGATIVE)
    nitp_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    # the target block; 0: max(1, round(0.2 n_layer))
    nitp_layer: int = setting(0, NON_NEGATIVE)
    # predict from the last block's output, not the final normed one
    nitp_prenorm: bool = setting(False)
    nitp_hidden: int = setting(0, NON_NEGATIVE)  # head width; 0: 4 C
    # contrastive weight tying (the headless LM)
    cwt_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    cwt_tau: float = setting(1.0, POSITIVE_NUMBER)  # 1: the paper's
    # a mixture of experts' router load-balancing loss (Mixtral's)
    moe_aux_weight: float = setting(0.02, NON_NEGATIVE_NUMBER)


class Objective(nn.Module):
    """The weighted sum of the losses (a weight of 0: not computed) on
    what the model returns (model.py: logits, hidden states)."""

    @classmethod
    def from_config(cls, config):
        """From train.py's keys."""
        settings = {f.name: config[f.name] for f in fields(ObjectiveConfig)
                    if f.name in config}
        if config.get("n_expert", 1) == 1:
            settings["moe_aux_weight"] = 0.0
        return cls(config["n_layer"], config["n_embd"], **settings)

    def __init__(self, n_layer, n_embd, **settings):
        super().__init__()
        c = self.config = ObjectiveConfig(**settings)
        # every <name>_weight but the router's
        self.weights = {f.name.removesuffix("_weight"): getattr(c, f.name)
                        for f in fields(c) if f.name.endswith("_weight")}
        del self.weights["moe_aux"]
        if not any(self.weights.values()):
            raise ValueError("every loss weight is 0: nothing to train "
                             "(set ce_weight or another *_weight)")
        if c.simreg_layer > n_layer:
            raise ValueError("simreg_layer must be -1 (final normed state) "
                             f"or 0..{n_layer}, got {c.simreg_layer}")
        self.n_layer = n_layer
        self.nitp_layer = c.nitp_layer or max(1, round(0.2 * n_layer))
        if not 1 <= self.nitp_layer <= n_layer:
            raise ValueError(f"nitp_layer must be in 1..{n_layer} "
                             f"(0 = ~20 % depth), got {c.nitp_layer}")
        hidden = c.nitp_hidden or 4 * n_embd
        self.nitp_head = SwiGLU(n_embd, hidden) if c.nitp_weight > 0 else None

    @property
    def trains_head(self):
        return self.weights["ce"] > 0

    @property
    def needs_logits(self):
        """Not headless, nor with ce_chunk_size."""
        return self.trains_head and not self.config.ce_chunk_size

    def initializers(self):
        """(name, fill) of every parameter, in init_weights' order."""
        for name, _ in self.named_parameters():
            yield name, lambda t: nn.init.normal_(t, mean=0.0, std=0.02)

    @torch.no_grad()
    def init_weights(self):
        fill_parameters(self, self.initializers())

    def forward(self, logits, hidden_states, targets, embeddings,
                router_loss=None):
        """-> (weighted sum, {name: unweighted term}). embeddings:
        model.embeddings(); router_loss: a mixture of experts' one."""
        c = self.config
        terms = {}
        final = hidden_states[-1]
        if self.weights["ce"] and logits is None:  # ce_chunk_size
            terms["ce"] = losses.linear_cross_entropy(
                final, embeddings["output"], targets, margin=c.margin,
                chunk_size=c.ce_chunk_size)
        elif self.weights["ce"]:
            terms["ce"] = losses.cross_entropy(logits, targets,
                                               margin=c.margin)
        if self.weights["simreg"]:
            h = final if c.simreg_layer == -1 else hidden_states[c.simreg_layer]
            chunk = c.simreg_chunk_size or None
            terms["simreg"] = losses.simreg(h, targets, c.simreg_tau, chunk)
        if self.weights["dispersion"]:
            layers = hidden_states[1:self.n_layer + 1]
            if c.dispersion_layers == "last":
                layers = layers[-1:]
            P = c.dispersion_positions
            if 0 < P < final.size(1):
                layers = losses.random_positions(layers, P)
            terms["dispersion"] = losses.dispersion(
                layers, c.dispersion_tau, c.dispersion_variant, c.dispersion_form)
        if self.weights["nitp"]:
            source = hidden_states[self.n_layer] if c.nitp_prenorm else final
            terms["nitp"] = losses.nitp(self.nitp_head(source),
                                        hidden_states[self.nitp_layer])
        if self.weights["cwt"]:
            terms["cwt"] = losses.cwt(final, targets, embeddings["input"],
                                      tau=c.cwt_tau)
        if c.moe_aux_weight and router_loss is not None:
            terms["moe_aux"] = router_loss
        weights = {**self.weights, "moe_aux": c.moe_aux_weight}
        total = sum(weights[name] * value for name, value in terms.items())
        return total, terms


class Trained(nn.ModuleDict):
    """What a run trains: {'model', 'objective'}, the one module
    parallelism.parallelize wraps. Its forward is a micro-batch's
    objective: -> (loss, terms, logits or None, hidden_states)."""

    def __init__(self, model, objective):
        super().__init__({"model": model, "objective": objective})

    def forward(self, x, targets):
        model = self.model
        logits, hidden_states = model(
            x, return_hidden_states=True,
            compute_logits=self.objective.needs_logits)
        loss, terms = self.objective(
            logits, hidden_states, targets, model.embeddings(),
            router_loss=model.aux_loss)
        return loss, terms, logits, hidden_states
