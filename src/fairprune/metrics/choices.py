"""A multiple-choice item's answer probabilities and the answer a model picks, shared by the BBQ
and UnQover figures: the softmax of the answers' log-likelihoods, and the answers tied at the
highest value (a figure scores a tie as the expected outcome of picking one of them uniformly)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def softmax(lls: Sequence[float]) -> list[float]:
    """The softmax of log-likelihoods (shifted by their maximum; the normaliser an exact sum)."""
    top = max(lls)
    weights = [math.exp(ll - top) for ll in lls]
    total = math.fsum(weights)
    return [w / total for w in weights]


def tied_best(values: Sequence[float]) -> list[int]:
    """The indices of the highest of ``values`` (several where they tie exactly)."""
    top = max(values)
    return [j for j, v in enumerate(values) if v == top]
