"""The functions the UnQover task YAMLs (``unqover_cloze3.yaml``, ``unqover_letter_balanced.yaml``
beside this module) name: each question's answer log-likelihoods reported per document, and the
figures aggregated from them (:mod:`fairprune.metrics.unqover`: abstention, μ, η).

- **unqover_cloze3**: each question (:mod:`fairprune.data.unqover`'s documents) over its three
  answers, the two subjects and "unknown", each scored by the log-likelihood of its text after
  ``"{context}\\n\\nQ: {question}\\nA:"`` (the BBQ cloze prompt); uniform answers abstain 1/3.
- **unqover_letter_balanced**: Debias-SparseGPT's letter prompt, each question asked three times
  with the answers in the three cyclic orders (:func:`fairprune.metrics.lm_tasks.in_orders`); the
  three orders' letter probabilities are summed per answer, so a model that always says "A"
  abstains exactly 1/3.

lm-eval's per-document ``process_results`` cannot join a question's orders or a question with its
subject-swapped twin: each document reports its log-likelihoods and where it belongs, and the
aggregations join them (the project recomputes every figure from the logged samples too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fairprune.metrics import unqover
from fairprune.metrics.lm_tasks import in_orders

__all__ = ["process_docs_orders", "process_results", "agg_abstention", "agg_mu", "agg_eta", "METRICS"]

METRICS = ("acc", "accuracy_amb", "mu", "eta")


def process_docs_orders(dataset):
    """Each question in the three cyclic orders of its answers."""
    return in_orders(dataset)


def process_results(doc: Mapping[str, Any], results: Sequence[tuple[float, bool]]) -> dict[str, Any]:
    """One document: its answers' (or letters') log-likelihoods, which answer each stands for, and
    the question's place (unit, slot, q) and subjects."""
    ordered = "rotation" in doc
    value = {"unit": int(doc["unit"]), "slot": int(doc["slot"]), "q": int(doc["q"]),
             "rotation": int(doc["rotation"]) if ordered else 0, "orders": 3 if ordered else 1,
             "order": [int(j) for j in doc["order"]] if ordered else [0, 1, 2], "lls": [float(ll) for ll, _ in results],
             "subjects": list(doc["subjects"]), "clusters": list(doc["clusters"]), "attribute": str(doc["attribute"]),
             "class": str(doc["class"])}
    return {metric: value for metric in METRICS}


def _figure(values: Iterable[Mapping[str, Any]], name: str) -> float:
    found = unqover.entry(values, letters=False)
    if not found["doc_ids"]:
        return float("nan")
    return float(unqover.figures(found, np.ones((1, len(found["doc_ids"]))))[name][0])


def agg_abstention(values: Iterable[Mapping[str, Any]]) -> float:
    """The share of questions answered "unknown"."""
    return _figure(values, "accuracy_amb")


def agg_mu(values: Iterable[Mapping[str, Any]]) -> float:
    """UnQover's μ (:mod:`fairprune.metrics.unqover`)."""
    return _figure(values, "mu")


def agg_eta(values: Iterable[Mapping[str, Any]]) -> float:
    """UnQover's η (:mod:`fairprune.metrics.unqover`)."""
    return _figure(values, "eta")
