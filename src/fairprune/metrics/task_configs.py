"""The lm-eval task configs of the tasks the project defines on local files
(:data:`fairprune.metrics.harness.LOCAL_TASKS`): lm-eval's own YAML (or the project's, in
:mod:`fairprune.metrics.lm_tasks`) with the data source replaced by a local file in the data set's
public format (``dataset_path: json`` / ``csv`` / ``parquet`` with ``data_files``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

#: The project's own task definitions (YAML files in :mod:`fairprune.metrics.lm_tasks`).
OWN_TASKS = ("bbq_ambig_cloze3", "bbq_disambig_cloze3", "bbq_ambig_letter_balanced", "unqover_cloze3",
             "unqover_letter_balanced")
LETTERS = ("A", "B", "C")


def _stock(relative: str) -> dict[str, Any]:
    """One of lm-eval's task YAMLs, with its includes and ``!function`` entries resolved."""
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(Path(lm_eval.__file__).parent / "tasks" / relative)


def _own(name: str) -> dict[str, Any]:
    """One of the project's task YAMLs (:mod:`fairprune.metrics.lm_tasks`), its ``!function``
    entries resolved."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from fairprune.metrics import lm_tasks

    return load_yaml(Path(lm_tasks.__file__).parent / f"{name}.yaml")


def _local(config: dict[str, Any], path: str, split: str) -> dict[str, Any]:
    """``config`` reading ``path`` (json lines, csv or parquet, by the file's suffix) as its ``split`` alone."""
    suffix = Path(path).suffix.lower()
    builder = {".csv": "csv", ".parquet": "parquet"}.get(suffix, "json")
    config = {k: v for k, v in config.items() if k not in ("tag", "group", "dataset_name", "training_split",
                                                             "validation_split", "test_split", "fewshot_split")}
    config.update(dataset_path=builder, dataset_kwargs={"data_files": {split: str(Path(path).resolve())}})
    config[f"{split}_split"] = split
    config["fewshot_split"] = split  # --num_fewshot draws its examples from the same file (lm-eval leaves the scored doc out)
    return config


def letter_prompt(doc: dict[str, Any]) -> str:
    """Debias-SparseGPT's BBQ prompt."""
    return f"{doc['context']} {doc['question']}\nA. {doc['ans0']}\nB. {doc['ans1']}\nC. {doc['ans2']}\nAnswer:"


def _letter_results(doc: dict[str, Any], results: list) -> dict[str, Any]:
    """The letter answer (argmax over A-C) scored by lm-eval's BBQ rules: the chosen answer's text
    is found among lm-eval's BBQ choices and scored as a cloze answer of that text would be."""
    from lm_eval.tasks.bbq import utils as bbq

    picked = int(np.argmax([ll for ll, _ in results]))
    return bbq._process_results(doc, bbq.doc_to_choice(doc).index(doc[f"ans{picked}"]))


def task_config(name: str, path: str, seed: int = 0) -> dict[str, Any]:
    """The lm-eval task config of a local task ``name`` reading ``path`` (UnQover: the documents
    written from the generator's files, in the order ``seed`` stratifies)."""
    if name.startswith("unqover_"):
        from fairprune.data.unqover import write_docs

        return _local(_own(name), str(write_docs(path, seed)), "test")
    if name == "hellaswag":
        return _local(_stock("hellaswag/hellaswag.yaml"), path, "validation")
    if name == "mmlu":
        config = _local(_stock("mmlu/default/_default_template_yaml"), path, "test")
        config.update(task="mmlu", description="The following are multiple choice questions (with answers) about "
                                               "{{subject.replace('_', ' ')}}.\n\n")
        return config
    if name in ("bbq_ambig", "bbq_disambig"):
        return _local(_stock(f"bbq/bbq_multiple_choice_{name.removeprefix('bbq_')}.yaml"), path, "test")
    if name == "bbq_ambig_letter":
        config = task_config("bbq_ambig", path)
        config.update(task=name, doc_to_text=letter_prompt, doc_to_choice=list(LETTERS), doc_to_target="{{label}}",
                      process_results=_letter_results)
        return config
    if name in OWN_TASKS:
        return _local(_own(name), path, "test")
    if name == "crows_pairs_english":
        return _local(_stock("crows_pairs/crows_pairs_english.yaml"), path, "test")
    raise KeyError(name)
