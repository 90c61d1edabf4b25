"""A resumed fit keeps its run's history in ``metrics.csv``.

Lightning's CSV logger deletes ``metrics.csv`` when its writer is created, at the very start of a
fit (before any callback hook), so a fit resumed from a checkpoint would hold only the epochs after
the resume. Whoever starts a fit calls :func:`remember_metrics` first (``prune.py vision`` and
``train.py fit`` do): it reads each CSV logger's file. :func:`continue_metrics`, called by the
report callback once the training state is restored, writes back the rows logged before the
checkpoint (rows of later epochs / steps, which the killed run logged after its last checkpoint,
are dropped: the resumed run logs them again) and lets the writer append to them. A fit that does
not resume leaves the file to Lightning, which starts it afresh.
"""

from __future__ import annotations

import csv
import io
import math
import weakref
from pathlib import Path

import lightning as L
from lightning.fabric.loggers import CSVLogger

from fairprune.storage.atomic import write_text

METRICS_FILE = "metrics.csv"

_REMEMBERED: weakref.WeakKeyDictionary[L.Trainer, dict[CSVLogger, str]] = weakref.WeakKeyDictionary()


def remember_metrics(trainer: L.Trainer) -> None:
    """Before ``trainer.fit``: read the ``metrics.csv`` of every CSV logger whose writer does not
    exist yet (creating it deletes the file), for :func:`continue_metrics`."""
    found: dict[CSVLogger, str] = {}
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger) and getattr(logger, "_experiment", None) is None:
            path = Path(logger.log_dir) / METRICS_FILE
            if path.is_file():
                found[logger] = path.read_text()
    _REMEMBERED[trainer] = found


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value not in (None, "") else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def logged_before(row: dict[str, str], epoch: int, step: int) -> bool:
    """Whether a ``metrics.csv`` row was logged before the point a fit resumes from (``epoch``,
    optimizer ``step``): an earlier epoch, or this epoch at an earlier step."""
    row_epoch, row_step = _number(row.get("epoch")), _number(row.get("step"))
    if row_epoch is not None and row_epoch != epoch:
        return row_epoch < epoch
    return row_step is None or row_step < step


def continue_metrics(trainer: L.Trainer, epoch: int, step: int) -> int:
    """Write back each remembered logger's rows logged before (``epoch``, ``step``) and make its
    writer append to them (first process only); return how many rows were kept."""
    kept_total = 0
    saved = _REMEMBERED.pop(trainer, {})
    if not trainer.is_global_zero:
        return 0
    for logger, text in saved.items():
        reader = csv.DictReader(io.StringIO(text))
        header = list(reader.fieldnames or [])
        if not header:
            continue
        kept = [row for row in reader if logged_before(row, epoch, step)]
        writer = logger.experiment  # created now if not yet: creating it deletes the old file
        keys = header + [k for k in getattr(writer, "metrics_keys", []) if k not in header]
        out = io.StringIO()
        table = csv.DictWriter(out, fieldnames=keys)
        table.writeheader()
        table.writerows(kept)
        write_text(Path(logger.log_dir) / METRICS_FILE, out.getvalue())
        writer.metrics_keys = keys  # the file's header: later rows are appended under it
        kept_total += len(kept)
    return kept_total
