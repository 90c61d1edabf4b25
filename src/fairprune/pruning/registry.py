"""The one registry of pruning methods: every name the command lines, configs, compare commands and
error messages know comes from here.

A method has a *kind*, which says what runs it:

- ``vision``: iterative pruning with retraining, the ``IterativePruning`` callback
  (``prune.py vision`` / ``compare --ckpt``, or ``trainer.callbacks`` in a ``train.py`` config);
- ``lm``: post-training pruning of a causal LM's linear weights (``prune.py <name>`` /
  ``compare --model``, or the ``PostTrainingPruning`` callback);
- ``heads``: attention-head pruning of a causal LM (``prune.py fasp --method <name>`` /
  ``compare --model --alphas``);
- ``diff``: fine-tuning with a sparse difference (the ``DiffPruning`` callback, ``prune.py diff-compare``).

The same name may exist in several kinds (``magnitude`` prunes vision weights, LM weights and heads);
a look-up always names the kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairprune.errors import UserError, suggest

KINDS = {
    "vision": "iterative pruning of a vision model with retraining between steps",
    "lm": "post-training pruning of a causal LM's weights",
    "heads": "attention-head pruning of a causal LM",
    "diff": "fine-tuning with a sparse difference to a pretrained model",
}


@dataclass(frozen=True)
class Method:
    name: str
    kind: str
    summary: str
    scope: str = "per-layer"  # how the sparsity budget is shared: per-layer, global, per-row or heads
    uses_data: bool = True  # needs data (gradients, calibration, generations) besides the weights

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.name


_METHODS = (
    Method("fairgrape", "vision", "per-group importance (g·w)², greedy selection keeping each group's share"),
    Method("magnitude", "vision", "weight magnitude |w| (WS)", uses_data=False),
    Method("snip", "vision", "connection sensitivity |g·w| on a few batches", scope="global"),
    Method("grasp", "vision", "gradient-flow preservation −w·Hg", scope="global"),
    Method("random", "vision", "uniformly random weights", uses_data=False),
    Method("lottery", "vision", "magnitude, kept weights rewound to an early epoch", uses_data=False),
    Method("magnitude", "lm", "weight magnitude |w| within each output row", scope="per-row", uses_data=False),
    Method("wanda", "lm", "|w|·‖x‖₂ within each output row, no weight update", scope="per-row"),
    Method("sparsegpt", "lm", "OBS mask and weight update from the layer Hessian XXᵀ", scope="per-row"),
    Method("debias-sparsegpt", "lm", "SparseGPT with the paired Hessian X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ", scope="per-row"),
    Method("fasp", "heads", "protect the top-γ heads for perplexity, remove those whose removal lowers bias most", scope="heads"),
    Method("fairness", "heads", "remove the heads whose removal lowers bias most (γ = 0)", scope="heads"),
    Method("performance", "heads", "remove the heads whose removal raises perplexity least", scope="heads"),
    Method("magnitude", "heads", "remove the heads with the smallest output-projection norm", scope="heads", uses_data=False),
    Method("gradient", "heads", "remove the heads with the smallest |gate gradient| of the LM loss", scope="heads"),
    Method("random", "heads", "remove random heads", scope="heads", uses_data=False),
    Method("diff-pruning", "diff", "θ₀ + z ⊙ δ with hard-concrete gates, then magnitude pruning of δ", scope="global"),
)

REGISTRY: dict[tuple[str, str], Method] = {m.key: m for m in _METHODS}


def names(kind: str) -> tuple[str, ...]:
    """Method names of one kind, in registry order."""
    _check_kind(kind)
    return tuple(m.name for m in _METHODS if m.kind == kind)


def get(name: str, kind: str, what: str | None = None) -> Method:
    """The method ``name`` of ``kind``; an unknown name is a one-line error listing the choices."""
    _check_kind(kind)
    method = REGISTRY.get((kind, name))
    if method is None:
        choices = names(kind)
        raise UserError(f"unknown {what or KINDS[kind].split(' of ')[0]} method '{name}'{suggest(str(name), choices)}; "
                        f"choose one of {', '.join(choices)}")
    return method


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UserError(f"unknown method kind '{kind}'; choose one of {', '.join(KINDS)}")
