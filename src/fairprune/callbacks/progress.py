"""The progress bar fairprune runs use: Lightning's, without the logger-version column.

Lightning shows the last characters of the logger's version as ``v_num``; fairprune names run
folders after methods (``fairgrape``, ``magnitude_s0.9``), so that column carries a meaningless
fragment of a name. Everything else is Lightning's bar unchanged.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

if _RICH_AVAILABLE:
    from lightning.pytorch.callbacks import RichProgressBar as _Base
else:  # pragma: no cover - depends on whether rich is installed
    _Base = TQDMProgressBar


class ProgressBar(_Base):
    """Lightning's progress bar without ``v_num``."""

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
