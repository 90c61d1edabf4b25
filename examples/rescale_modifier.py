"""A modifier of one's own, end to end: after pruning, each row of a layer is rescaled so that its
output energy on the calibration inputs, ``w H wᵀ``, is the dense row's (a variance correction).

Run it from a recipe once this module is imported (``register_modifier``), e.g. with
``[{sparsegpt: {sparsity: 0.5}}, {rescale: {}}]``.
"""

import torch

from fairprune.causal.families import linear_weight, set_linear_weight
from fairprune.pruning.modifiers import Modifier, register_modifier
from fairprune.pruning.sparsegpt import Hessian


class Rescale(Modifier):
    name = "rescale"
    calibrates = True  # it collects from the calibration batches

    def __init__(self, options: dict, settings: dict):
        self.options, self.dense = options, {}

    def statistic(self, name, unit, held, device):
        """Called before any change to the block: keep the dense rows, and take the Hessian an
        earlier modifier collects (SparseGPT's) rather than accumulate a second one."""
        self.dense[name] = linear_weight(unit).detach().clone()
        earlier = next((stat for modifier, stat in held if modifier.hessian and stat is not None), None)
        return earlier if earlier is not None else Hessian(linear_weight(unit).shape[1], device)

    def apply(self, name, unit, stat):
        """Called after the modifiers before it changed the unit: rescale its rows."""
        dense, W = self.dense.pop(name).double(), linear_weight(unit).double()
        if stat is None:  # an expert no calibration token reached: nothing to match
            return
        H = stat.value().double()
        before, after = ((dense @ H) * dense).sum(1), ((W @ H) * W).sum(1)
        scale = torch.where(after > 0, (before / after.clamp_min(1e-30)).sqrt(), torch.ones_like(after))
        set_linear_weight(unit, (W * scale[:, None]).to(unit.weight.dtype))


register_modifier("rescale", Rescale)
