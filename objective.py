"""
The training objective of a run: the losses of losses.py that a config switches on, each with its
weight, computed from what the model returns, and the one function that computes a micro-batch's
objective for train.py, plan.py and the benchmarks.
"""

from dataclasses import dataclass, field, fields
from typing import Optional

import torch
from torch import nn

import losses
from errors import NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE_NUMBER, broken_rule, is_number, one_of
# NITP's projection head is the same C -> hidden -> C block as a LLaMA MLP
from model import SwiGLU, fill_parameters


def setting(default, rule=None):
    """A key of the objective: its default and its rule, (what is expected, test) as errors.py
    phrases them (None: its type, which the config checks, is the whole rule)."""
    return field(default=default, metadata={"rule": rule})


@dataclass
class ObjectiveConfig:
    """Every key of the training objective, each declared here once: train.py takes them with
    these defaults, the config checks their rules, Objective reads them by name. A loss is on when
    its <name>_weight is above 0. The losses' docstrings in losses.py give formulas and papers."""
    # next-token cross-entropy; 0 with cwt_weight > 0 is a headless run (no LM head)
    ce_weight: float = setting(1.0, NON_NEGATIVE_NUMBER)
    # logit thresholding of the CE term (Stop Jostling); None = plain CE
    margin: Optional[float] = setting(None, ("None or a finite number > 0",
                                             lambda v: v is None or (is_number(v) and v > 0)))
    # n > 0: the LM head and CE together, n positions at a time, no whole logits; 0 = off
    ce_chunk_size: int = setting(0, NON_NEGATIVE)
    # SimReg (Eq. 3); the paper's rule (App. A.2): 10 sqrt(n_embd / 1024)
    simreg_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    simreg_tau: float = setting(0.01, POSITIVE_NUMBER)
    simreg_chunk_size: int = setting(0, NON_NEGATIVE)  # 0 = whole sequences
    # -1 = the final normed state; l = the output of block l (0 = the embedding)
    simreg_layer: int = setting(-1, ("-1 or a block index >= 0", lambda v: v >= -1))
    # dispersion loss (Liu et al., Eq. 2); the paper's 0.1 (Sec. 5.3)
    dispersion_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    dispersion_tau: float = setting(1.0, POSITIVE_NUMBER)
    dispersion_variant: str = setting("angular", one_of(*losses.DISPERSION_VARIANTS))
    # paper (Algorithm 1) | authors (the released code's constants; docs/fidelity.md)
    dispersion_form: str = setting("paper", one_of(*losses.DISPERSION_FORMS))
    dispersion_layers: str = setting("all", one_of("all", "last"))  # every block, or the last
    # P > 0: P random positions per layer, the same in every sequence (an estimate); 0 = all
    dispersion_positions: int = setting(0, NON_NEGATIVE)
    # NITP (NITP paper, Method); the paper's 1.0
    nitp_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    nitp_layer: int = setting(0, NON_NEGATIVE)  # the target block; 0 = max(1, round(0.2 n_layer))
    # predict from the last block's output instead of the final normed state
    nitp_prenorm: bool = setting(False)
    nitp_hidden: int = setting(0, NON_NEGATIVE)  # the SwiGLU head's width; 0 = 4 n_embd
    # contrastive weight tying (headless LM paper, Sec. 3.2)
    cwt_weight: float = setting(0.0, NON_NEGATIVE_NUMBER)
    # CWT's temperature, the released code's; 1 = the paper's raw dot products (docs/fidelity.md)
    cwt_tau: float = setting(1.0, POSITIVE_NUMBER)
    # a mixture of experts' router load-balancing loss (Mixtral-8x7B's 0.02); with n_expert > 1
    moe_aux_weight: float = setting(0.02, NON_NEGATIVE_NUMBER)

    @classmethod
    def rules(cls):
        """key -> rule, for the config checks (configurator.train_rules)."""
        return {f.name: f.metadata["rule"] for f in fields(cls) if f.metadata["rule"]}

    def __post_init__(self):
        if problem := broken_rule(vars(self), self.rules()):
            raise ValueError(problem)


class Objective(nn.Module):
    """The training objective of a run: a weighted sum of the losses of losses.py, each computed
    from the logits and hidden states the model returns.

    hidden_states follow model.py: [0] embedding output, [l] output of block l = 1..L, [L+1] the
    final normed state that feeds the LM head. A weight of 0 switches a term off (and it is not
    computed); ce_weight=0 with cwt_weight>0 is a headless run (needs_logits is False: no LM head).

    Trainable parts that belong to a loss and not to the model -- NITP's projection head -- live
    here, so train.py optimises model and objective together, checkpoints both, and inference
    uses the model alone.
    """

    @classmethod
    def from_config(cls, config):
        """The objective train.py's keys describe (a key the config lacks keeps its default); the
        router's loss only with experts."""
        settings = {f.name: config[f.name] for f in fields(ObjectiveConfig) if f.name in config}
        if config.get("n_expert", 1) == 1:
            settings["moe_aux_weight"] = 0.0
        return cls(config["n_layer"], config["n_embd"], **settings)

    def __init__(self, n_layer, n_embd, **settings):
        """settings: ObjectiveConfig's keys, e.g. simreg_weight=1.0 (ValueError if one breaks its rule)."""
        super().__init__()
        self.config = c = ObjectiveConfig(**settings)
        # each loss's weight by its name (the moe_aux term is the router's, not the representations')
        self.weights = {f.name[:-len("_weight")]: getattr(c, f.name) for f in fields(c)
                        if f.name.endswith("_weight") and f.name != "moe_aux_weight"}
        if not any(self.weights.values()):
            raise ValueError("every loss weight is 0: nothing to train (set ce_weight or another *_weight)")
        if c.simreg_layer > n_layer:
            raise ValueError(f"simreg_layer must be -1 (final normed state) or 0..{n_layer}, "
                             f"got {c.simreg_layer}")
        self.n_layer = n_layer
        self.nitp_layer = c.nitp_layer or max(1, round(0.2 * n_layer))
        if not 1 <= self.nitp_layer <= n_layer:
            raise ValueError(f"nitp_layer must be in 1..{n_layer} (0 = ~20 % depth), got {c.nitp_layer}")
        self.nitp_head = SwiGLU(n_embd, c.nitp_hidden or 4 * n_embd) if c.nitp_weight > 0 else None

    @property
    def trains_head(self):
        """Whether the LM head is trained (it is not in a headless run)."""
        return self.weights["ce"] > 0

    @property
    def needs_logits(self):
        """Whether the model must compute the logits: not in a headless run, nor with ce_chunk_size."""
        return self.trains_head and not self.config.ce_chunk_size

    def initializers(self, std=0.02):
        """(name, fill) for every parameter in the order init_weights draws them (model.GPT.initializers)."""
        for name, _ in self.named_parameters():
            yield name, lambda t: nn.init.normal_(t, mean=0.0, std=std)

    @torch.no_grad()
    def init_weights(self, std=0.02):
        fill_parameters(self, self.initializers(std))

    def forward(self, logits, hidden_states, targets, embeddings, ignore_index=-1, router_loss=None):
        """-> (total, terms): the weighted sum and a dict of each active term's unweighted value.
        embeddings: the weights a loss may need, by name (model.embeddings()): 'input', the (V, C)
        rows looked up for input tokens, and 'output', the rows the final state is scored against
        (the LM head; the same tensor as 'input' on a tied model).
        router_loss: a mixture of experts' load-balancing loss of this forward (Mixtral; model.aux_loss),
        added with weight moe_aux_weight (computed per micro-batch like every term)."""
        c, terms = self.config, {}
        final = hidden_states[-1]
        if self.weights["ce"] and logits is None:  # ce_chunk_size: the head's rows, not its logits
            terms["ce"] = losses.linear_cross_entropy(final, embeddings["output"], targets,
                                                      ignore_index, c.margin, c.ce_chunk_size)
        elif self.weights["ce"]:
            terms["ce"] = losses.cross_entropy(logits, targets, ignore_index, c.margin)
        if self.weights["simreg"]:
            h = final if c.simreg_layer == -1 else hidden_states[c.simreg_layer]
            terms["simreg"] = losses.simreg(h, targets, c.simreg_tau, c.simreg_chunk_size or None,
                                            ignore_index)
        if self.weights["dispersion"]:
            blocks = hidden_states[1:self.n_layer + 1]
            layers = blocks if c.dispersion_layers == "all" else blocks[-1:]
            P = c.dispersion_positions
            if 0 < P < final.size(1):
                layers = [z[:, torch.randperm(z.size(1), device=z.device)[:P]] for z in layers]
            terms["dispersion"] = losses.dispersion(layers, c.dispersion_tau, c.dispersion_variant,
                                                    c.dispersion_form)
        if self.weights["nitp"]:
            source = hidden_states[self.n_layer] if c.nitp_prenorm else final
            terms["nitp"] = losses.nitp(self.nitp_head(source), hidden_states[self.nitp_layer])
        if self.weights["cwt"]:
            terms["cwt"] = losses.cwt(final, targets, embeddings["input"], ignore_index, c.cwt_tau)
        if c.moe_aux_weight and router_loss is not None:
            terms["moe_aux"] = router_loss
        weights = {**self.weights, "moe_aux": c.moe_aux_weight}
        total = sum(weights[name] * value for name, value in terms.items())
        return total, terms


def objective_step(model, objective, x, targets, run_model=None, run_objective=None):
    """One micro-batch's training objective, the one way train.py, plan.py and the benchmarks
    compute it: the model's forward (through run_model, the parallel wrapper a step runs, else the
    model), then every loss of the objective on its outputs, each reaching the weights it needs by
    name (model.embeddings()), and a mixture of experts' router loss. -> (loss, terms, logits,
    hidden_states); logits is None for a headless objective (no LM head computed)."""
    logits, hidden_states = (run_model or model)(x, return_hidden_states=True,
                                                 compute_logits=objective.needs_logits)
    loss, terms = (run_objective or objective)(logits, hidden_states, targets, model.embeddings(),
                                               router_loss=model.aux_loss)
    return loss, terms, logits, hidden_states
