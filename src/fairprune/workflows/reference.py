"""The compute-matched dense reference of a vision pruning run, and the check that a pruned model
did not simply outgrow its dense model.

A pruning run retrains the model for ``start_epoch + steps × retrain_epochs`` epochs. Measured
against the dense checkpoint, those epochs of extra training count as a cost (or a gain) of
pruning: a dense model that was not trained to convergence makes every pruned model look better
than it and the degradation figures read backwards. The *continued* reference is the same dense
checkpoint trained on for exactly those epochs, with the same optimizer, schedule, Trainer settings
and data, without pruning. Its per-group validation and test figures are what degradation is
measured against (``--reference continued``, the default; ``--reference dense`` keeps the old
measure). They are cached in ``<cache>/reference/<key>.json`` (:func:`fairprune.hub.cache_dir`),
the key being the checkpoint's bytes, the epochs, the Trainer and data settings and the seed, so a
compare trains it once for all its methods and a rerun not at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from typing import Any

import lightning as L

from fairprune.callbacks.progress import ProgressBar
from fairprune.callbacks.pruning import EpochSeeds, IterativePruning, evaluate
from fairprune.errors import UserError
from fairprune.hub import cache_dir
from fairprune.reporting.report import write_json
from fairprune.workflows.options import result_settings

REFERENCES = ("continued", "dense")
_VERSION = 1


def check_reference(reference: str) -> str:
    if reference not in REFERENCES:
        raise UserError(f"--reference must be one of {', '.join(REFERENCES)}, got {reference!r}: continued (the dense "
                        "model trained as long as the pruning schedule retrains) or dense (the checkpoint as it is)")
    return reference


def schedule_epochs(callback: IterativePruning, trainer: dict[str, Any]) -> int:
    """The epochs the pruning fit trains: the schedule's, or more when the Trainer asks for more."""
    return max(int(trainer.get("max_epochs") or 0), callback.last_epoch_needed)


def continued_reference(load: Callable[[], tuple[L.LightningModule, L.LightningDataModule]], ckpt_sha256: str,
                        epochs: int, seed: int, trainer: dict[str, Any], data: dict[str, Any],
                        use_cache: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-split figures (``{"val": ..., "test": ...}``) of the dense checkpoint (``load()`` builds
    its model and data module; ``ckpt_sha256`` names its bytes) trained on for ``epochs`` epochs
    without pruning, and the facts the report carries about it."""
    settings = {"accelerator": "auto", "devices": 1, "log_every_n_steps": 10, **trainer, "max_epochs": epochs}
    identity = {"version": _VERSION, "ckpt_sha256": ckpt_sha256, "epochs": epochs, "seed": seed, "data": data,
                "trainer": result_settings(settings)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = cache_dir() / "reference" / f"{key}.json"
    facts = {"epochs": epochs, "seed": seed, "cache": str(path)}
    if use_cache:
        try:
            cached = json.loads(path.read_text())
            if cached.get("identity") == json.loads(json.dumps(identity, default=str)):
                print(f"[reference] the dense model trained {epochs} more epochs: from the cache ({path})", flush=True)
                return cached["figures"], {**facts, "from_cache": True, "train_seconds": cached.get("seconds", 0.0)}
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # absent or unreadable: train it
    start = time.perf_counter()
    print(f"[reference] training the dense model {epochs} more epochs without pruning (the compute-matched "
          f"reference) ...", flush=True)
    model, datamodule = load()
    L.seed_everything(seed, workers=True, verbose=False)
    fit = L.Trainer(logger=False, enable_checkpointing=False,
                    callbacks=[EpochSeeds(seed)] + ([ProgressBar()] if settings.get("enable_progress_bar", True) else []),
                    **settings)
    fit.fit(model, datamodule=datamodule)
    model.eval()
    figures = {stage: evaluate(model, getattr(datamodule, f"{stage}_dataloader")()) for stage in ("val", "test")}
    seconds = time.perf_counter() - start
    if fit.is_global_zero:
        write_json(path, {"identity": identity, "figures": figures, "seconds": seconds})
    return figures, {**facts, "from_cache": False, "train_seconds": seconds}


def outgrown(report: dict[str, Any], z: float = 1.96) -> list[str]:
    """Warnings when the pruned model's test accuracy beats the dense model's (or the reference's)
    by more than noise: a two-proportion test on the test items, ``z`` standard errors."""
    warnings = []
    accuracy = (report.get("metrics") or {}).get("accuracy")
    n = sum(int(g.get("count") or 0) for g in (report.get("groups") or {}).values())
    for key in ("dense", "reference"):
        figures = report.get(key) or {}
        base = (figures.get("metrics") or {}).get("accuracy")
        if accuracy is None or base is None or n == 0 or (key == "reference" and figures.get("method") == "dense"):
            continue
        noise = z * math.sqrt(max(accuracy * (1 - accuracy) + base * (1 - base), 1e-12) / n)
        if accuracy - base > noise:
            if key == "dense" and report.get("reference", {}).get("method") == "dense":
                warnings.append(f"the pruned model beats the dense model by {accuracy - base:.3f} accuracy (noise ±{noise:.3f} "
                                f"over {n} test items): the dense model was not trained to convergence, and degradation "
                                "figures measure training, not pruning; use --reference continued")
            elif key == "dense":
                warnings.append(f"the pruned model beats the dense checkpoint by {accuracy - base:.3f} accuracy (noise "
                                f"±{noise:.3f} over {n} test items): the dense model was not trained to convergence; "
                                "degradation is measured against the continued reference, trained as long as the "
                                "pruning schedule retrains")
            else:
                warnings.append(f"the pruned model beats its continued reference by {accuracy - base:.3f} accuracy (noise "
                                f"±{noise:.3f} over {n} test items): the dense model is far from convergence even after "
                                "the extra epochs; degradation figures measure training, not pruning")
    return warnings


def small_group_warnings(ci: dict[str, Any], report: dict[str, Any]) -> list[str]:
    """One warning naming the groups with too few test items for their figures to be read alone."""
    small = ci.get("small_groups") or []
    if not small:
        return []
    sizes = ", ".join(f"{g} ({int(report['groups'][g]['count'])}: {ci['groups'][g][0]:.2f}–{ci['groups'][g][1]:.2f})"
                      for g in small)
    return [f"groups with fewer than {ci['min_group']} test items, whose accuracy is uncertain (95 % interval): {sizes}; "
            "read their figures and any difference of a few points as noise"]
