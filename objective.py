"""
The training objective of a run: the losses of losses.py that a config switches on, each with its
weight, computed from what the model returns, and the one function that computes a micro-batch's
objective for train.py, plan.py and the benchmarks.
"""

import torch
from torch import nn

import losses
# NITP's projection head is the same C -> hidden -> C block as a LLaMA MLP
from model import SwiGLU, fill_parameters


class Objective(nn.Module):
    """The training objective of a run: a weighted sum of the losses of losses.py, each computed
    from the logits and hidden states the model returns.

    hidden_states follow model.py: [0] embedding output, [l] output of block l = 1..L, [L+1] the
    final normed state that feeds the LM head. A weight of 0 switches a term off (and it is not
    computed); ce=0 with cwt>0 is a headless run (needs_logits is False: no LM head at all).

    Trainable parts that belong to a loss and not to the model -- NITP's projection head -- live
    here, so train.py optimises model and objective together, checkpoints both, and inference
    uses the model alone.

    Options (the docstrings of the losses in losses.py cite their papers):
      margin               logit thresholding of the CE term (None = plain CE)
      ce_chunk_size        n > 0: the LM head and CE computed together, n positions at a time
                           (linear_cross_entropy; the model returns no logits); 0 = the model's logits
      simreg_layer         -1 = final normed state (default), l = output of block l (0 = embedding)
      simreg_chunk_size    0 = full sequences
      dispersion_form      'paper' (default) or 'authors' (the released code's constants; see dispersion)
      dispersion_layers    'all' blocks (default) or 'last'
      dispersion_positions P > 0: P random positions per layer, the same for every sequence,
                           redrawn per layer (an estimate of the full loss; not the paper's); 0 = all
      nitp_layer           target block k; 0 = max(1, round(0.2 L)) (~20 % depth)
      nitp_prenorm         predict from the last block's output instead of the final normed state
      nitp_hidden          head width; 0 = 4C
      cwt_tau              CWT's temperature (the released code's; 1 = the paper's raw dot products)
      moe_aux              weight of a mixture of experts' router load-balancing loss, which the
                           model computes (model.aux_loss) and forward() takes as router_loss
    """

    LOSSES = ("ce", "simreg", "dispersion", "nitp", "cwt")  # train.py's <name>_weight
    SETTINGS = ("margin", "ce_chunk_size", "simreg_tau", "simreg_chunk_size", "simreg_layer",
                "dispersion_tau", "dispersion_variant", "dispersion_form", "dispersion_layers",
                "dispersion_positions", "nitp_layer", "nitp_prenorm", "nitp_hidden", "cwt_tau")

    @classmethod
    def from_config(cls, config):
        """The objective train.py's keys describe: `<loss>_weight` for each loss, SETTINGS by name."""
        weights = {name: config[f"{name}_weight"] for name in cls.LOSSES
                   if f"{name}_weight" in config}  # a key the config lacks keeps __init__'s default
        moe_aux = config["moe_aux_weight"] if config.get("n_expert", 1) > 1 else 0.0
        return cls(config["n_layer"], config["n_embd"], **weights,
                   **{key: config[key] for key in cls.SETTINGS if key in config}, moe_aux=moe_aux)

    def __init__(self, n_layer, n_embd, ce=1.0, margin=None, ce_chunk_size=0, simreg=0.0,
                 simreg_tau=0.01, simreg_chunk_size=0, simreg_layer=-1, dispersion=0.0,
                 dispersion_tau=1.0, dispersion_variant="angular", dispersion_form="paper",
                 dispersion_layers="all", dispersion_positions=0, nitp=0.0, nitp_layer=0,
                 nitp_prenorm=False, nitp_hidden=0, cwt=0.0, cwt_tau=1.0, moe_aux=0.0):
        super().__init__()
        self.weights = dict(ce=ce, simreg=simreg, dispersion=dispersion, nitp=nitp, cwt=cwt)
        for name, weight in self.weights.items():
            if weight < 0:
                raise ValueError(f"{name}_weight must be >= 0, got {weight}")
        if not any(self.weights.values()):
            raise ValueError("every loss weight is 0: nothing to train (set ce_weight or another *_weight)")
        for key, value, valid in (
                ("dispersion_variant", dispersion_variant, tuple(losses.DISPERSION_VARIANTS)),
                ("dispersion_form", dispersion_form, losses.DISPERSION_FORMS)):
            if value not in valid:
                raise ValueError(f"{key} must be one of {', '.join(valid)}, got {value!r}")
        if dispersion_layers not in ("all", "last"):
            raise ValueError(f"dispersion_layers must be 'all' or 'last', got {dispersion_layers!r}")
        if not -1 <= simreg_layer <= n_layer:
            raise ValueError(f"simreg_layer must be -1 (final normed state) or 0..{n_layer}, "
                             f"got {simreg_layer}")
        if ce_chunk_size < 0:
            raise ValueError(f"ce_chunk_size must be >= 0 (0: the model's whole logits), got {ce_chunk_size}")
        self.n_layer = n_layer
        self.margin = margin
        self.ce_chunk_size = ce_chunk_size
        self.moe_aux = moe_aux  # not in weights: a term of the router, not of the representations
        self.simreg_tau, self.simreg_layer = simreg_tau, simreg_layer
        self.simreg_chunk_size = simreg_chunk_size or None
        self.dispersion_tau, self.dispersion_variant = dispersion_tau, dispersion_variant
        self.dispersion_form = dispersion_form
        self.dispersion_layers, self.dispersion_positions = dispersion_layers, dispersion_positions
        self.nitp_layer = nitp_layer or max(1, round(0.2 * n_layer))
        if not 1 <= self.nitp_layer <= n_layer:
            raise ValueError(f"nitp_layer must be in 1..{n_layer} (0 = ~20 % depth), got {nitp_layer}")
        self.nitp_prenorm, self.cwt_tau = nitp_prenorm, cwt_tau
        self.nitp_head = SwiGLU(n_embd, nitp_hidden or 4 * n_embd) if nitp > 0 else None

    @property
    def trains_head(self):
        """Whether the LM head is trained (it is not in a headless run)."""
        return self.weights["ce"] > 0

    @property
    def needs_logits(self):
        """Whether the model must compute the logits: not in a headless run, nor with ce_chunk_size."""
        return self.trains_head and not self.ce_chunk_size

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
        added with weight moe_aux (computed per micro-batch like every term)."""
        terms = {}
        final = hidden_states[-1]
        if self.weights["ce"] and logits is None:  # ce_chunk_size: the head's rows, not its logits
            terms["ce"] = losses.linear_cross_entropy(final, embeddings["output"], targets,
                                                      ignore_index, self.margin, self.ce_chunk_size)
        elif self.weights["ce"]:
            terms["ce"] = losses.cross_entropy(logits, targets, ignore_index, self.margin)
        if self.weights["simreg"]:
            h = final if self.simreg_layer == -1 else hidden_states[self.simreg_layer]
            terms["simreg"] = losses.simreg(h, targets, self.simreg_tau, self.simreg_chunk_size,
                                            ignore_index)
        if self.weights["dispersion"]:
            blocks = hidden_states[1:self.n_layer + 1]
            layers = blocks if self.dispersion_layers == "all" else blocks[-1:]
            P = self.dispersion_positions
            if 0 < P < final.size(1):
                layers = [z[:, torch.randperm(z.size(1), device=z.device)[:P]] for z in layers]
            terms["dispersion"] = losses.dispersion(layers, self.dispersion_tau, self.dispersion_variant,
                                                    self.dispersion_form)
        if self.weights["nitp"]:
            source = hidden_states[self.n_layer] if self.nitp_prenorm else final
            terms["nitp"] = losses.nitp(self.nitp_head(source), hidden_states[self.nitp_layer])
        if self.weights["cwt"]:
            terms["cwt"] = losses.cwt(final, targets, embeddings["input"], ignore_index, self.cwt_tau)
        if self.moe_aux and router_loss is not None:
            terms["moe_aux"] = router_loss
        weights = {**self.weights, "moe_aux": self.moe_aux}
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
