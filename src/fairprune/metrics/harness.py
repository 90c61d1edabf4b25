"""Zero-shot and bias yardsticks through lm-evaluation-harness, on the model already in memory.

lm-eval (``lm_eval``) is the evaluation engine: a run hands it the loaded model and tokenizer
as lm-eval's own HF model (:class:`~fairprune.metrics.shared_context.SharedContextLM`, an ``HFLM``
built as ``HFLM(pretrained=model, tokenizer=tokenizer)`` is, which reads each context once and
scores its answers from the context's key/value cache: HFLM's figures, rounding aside) and the
tasks named by ``--tasks``, and keeps its per-sample outputs (``log_samples``). The project's figures, their bootstrap intervals and the
paired differences between models are computed from those per-sample outputs
(:class:`TaskItems`), by the aggregation rules of each task as lm-eval defines them (a test checks
them against lm-eval's own aggregates).

**Offline by design.** The tasks below are lm-eval's own definitions (its YAML, its prompt, its
``process_docs`` / ``process_results``), with the data source replaced by a local file in the
data set's public format (``dataset_path: json`` / ``csv`` with ``data_files``). ``--task_data
NAME=PATH`` points a task at a file (the public release); without it the task reads the bundled,
generated set of that format (:mod:`fairprune.data.yardsticks`), as ``--eval_text`` defaults to
the bundled corpus. ``--task_data NAME=hub`` and every task name not listed here go to lm-eval's
stock definitions, which download their data.

=============================  ========================================  ===========  ============================
task                           lm-eval definition                        data         scoring
=============================  ========================================  ===========  ============================
``hellaswag``                  hellaswag/hellaswag.yaml                  hellaswag    cloze (acc, acc_norm)
``mmlu``                       mmlu/default (all subjects as one task)   mmlu         letter (A-D, lm-eval's)
``bbq_ambig``                  bbq/bbq_multiple_choice_ambig.yaml        bbq          cloze (12 answers)
``bbq_disambig``               bbq/bbq_multiple_choice_disambig.yaml     bbq          cloze (12 answers)
``bbq_ambig_letter``           bbq_ambig with Debias-SparseGPT's prompt  bbq          letter (A-C)
``bbq_ambig_cloze3``           the project's (lm_tasks/)                 bbq          cloze (the item's 3 answers)
``bbq_disambig_cloze3``        the project's (lm_tasks/)                 bbq          cloze (the item's 3 answers)
``bbq_ambig_letter_balanced``  the project's (lm_tasks/)                 bbq          letter, 3 answer orders
``unqover_cloze3``             the project's (lm_tasks/)                 unqover      cloze (2 subjects, "unknown")
``unqover_letter_balanced``    the project's (lm_tasks/)                 unqover      letter, 3 answer orders
``crows_pairs_english``        crows_pairs/crows_pairs_english.yaml      crows_pairs  likelihood of each sentence
=============================  ========================================  ===========  ============================

``bbq_ambig`` / ``bbq_disambig`` are lm-eval's BBQ tasks, whose choices are the item's two people
and the ten "unknown" phrasings of HELM: a model answering uniformly abstains 10/12 of the time.
``bbq_ambig_cloze3`` / ``bbq_disambig_cloze3`` (:mod:`fairprune.metrics.lm_tasks`) score each item's
own three answers (chance 1/3); ``bbq_ambig_letter_balanced`` asks the letter prompt with the
answers in the three cyclic orders and joins the three (a model that always says "A" scores 1/3).

``unqover_*`` read UnQover's generated questions (:mod:`fairprune.data.unqover`: the generator's JSON
files as it writes them, ``--task_data unqover=FILE_OR_FOLDER``, sampled by ``--limit`` stratified
over bias classes and subject pairs) and report abstention and UnQover's own μ / η
(:mod:`fairprune.metrics.unqover`).

``bbq_ambig_letter`` scores ambiguous BBQ contexts as the Debias-SparseGPT authors' code does: the
prompt ``"{context} {question}\\nA. {ans0}\\nB. {ans1}\\nC. {ans2}\\nAnswer:"`` and the argmax of the
next-token log-probabilities over the letters (lm-eval's log-likelihood of a one-token
continuation; where the tokenizer splits the space off the letter, the space is shared by all three
and the argmax is over the letter after it). Small models often answer one letter whatever the
question: a run warns when one letter takes 90 % of the answers, reports the shares, and marks the
task's figures invalid (:func:`~fairprune.metrics.task_figures.task_validity`, which also marks a
task at or below its chance level with an interval that includes it).

**Abstention accuracy** is ``accuracy_amb``: on ambiguous contexts the correct answer is the
"unknown" one, so accuracy is the share of abstentions. **BBQ bias scores** (Parrish et al. 2022,
as lm-eval computes them): ``disamb_bias_score = 2·n_biased / n_non_unknown − 1`` over
disambiguated contexts, ``amb_bias_score = (1 − accuracy_amb)·(2·n_biased / n_non_unknown − 1)``
over ambiguous ones, overall and per category. Every accuracy has a **chance level**, what uniform
answers over the task's own choices score (:func:`task_chance`). **DTO** (:func:`dto`) is computed
over the rows of a comparison, from valid figures only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import string
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fairprune.errors import UserError
from fairprune.metrics.task_configs import LETTERS, OWN_TASKS, letter_prompt, task_config  # noqa: F401 - re-exported
from fairprune.metrics.task_figures import (  # noqa: F401 - the yardsticks' figures, re-exported beside the runner
    HEADLINE,
    ONE_LETTER_SHARE,
    TaskItems,
    dto,
    headline,
    task_chance,
    task_entry,
    task_figures,
    task_intervals,
    task_paired,
    task_validity,
)

#: The tasks the project defines on local files: name → (the data format it reads, the scoring).
LOCAL_TASKS: dict[str, tuple[str, str]] = {
    "hellaswag": ("hellaswag", "cloze"),
    "mmlu": ("mmlu", "letter"),
    "bbq_ambig": ("bbq", "cloze"),
    "bbq_disambig": ("bbq", "cloze"),
    "bbq_ambig_letter": ("bbq", "letter"),
    "bbq_ambig_cloze3": ("bbq", "cloze"),
    "bbq_disambig_cloze3": ("bbq", "cloze"),
    "bbq_ambig_letter_balanced": ("bbq", "letter"),
    "unqover_cloze3": ("unqover", "cloze"),
    "unqover_letter_balanced": ("unqover", "letter"),
    "crows_pairs_english": ("crows_pairs", "likelihood"),
}
#: The task to read beside a letter task whose answers are nearly all one letter.
CLOZE_OF = {"bbq_ambig_letter": "bbq_ambig_cloze3", "bbq_ambig_letter_balanced": "bbq_ambig_cloze3",
            "unqover_letter_balanced": "unqover_cloze3", "mmlu": "hellaswag"}
HUB = "hub"  # --task_data NAME=hub: lm-eval's stock definition (downloads its data)


# -- the options ------------------------------------------------------------------------------
def parse_task_data(entries: Iterable[str] | None) -> dict[str, str]:
    """``["bbq=/data/bbq.jsonl", ...]`` → ``{"bbq": "/data/bbq.jsonl"}``, keyed by task or data
    format name (``bbq`` serves every BBQ task); each file checked against its format (one line
    naming the file, the format and where the public set is published)."""
    from fairprune.data.task_files import check_format

    formats = {fmt for fmt, _ in LOCAL_TASKS.values()}
    found: dict[str, str] = {}
    for entry in entries or []:
        name, sep, path = str(entry).partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise UserError(f"--task_data {entry!r} is not NAME=PATH; e.g. --task_data 'bbq=/data/BBQ/Age.jsonl'")
        if name not in formats and name not in LOCAL_TASKS:
            raise UserError(f"--task_data {name}=…: {name!r} is neither a data format ({', '.join(sorted(formats))}) nor a "
                            f"task the project defines on local files ({', '.join(LOCAL_TASKS)})")
        fmt = LOCAL_TASKS[name][0] if name in LOCAL_TASKS else name
        if path == HUB and fmt == "unqover":
            raise UserError("--task_data unqover=hub: lm-eval has no UnQover task; give a file or folder of UnQover's "
                            "generator (github.com/allenai/unqover)")
        if path != HUB:
            check_format(fmt, path)
        found[name] = path
    return found


def check_tasks(tasks: Sequence[str] | None, task_data: Iterable[str] | None = None) -> dict[str, str]:
    """Check ``--tasks`` and ``--task_data`` before any work; returns the parsed ``task_data``."""
    data = parse_task_data(task_data)
    for name in tasks or []:
        if not isinstance(name, str) or not name.strip() or "=" in name:
            raise UserError(f"--tasks holds {name!r}; pass lm-eval task names, e.g. --tasks '[hellaswag, mmlu, bbq_ambig]'")
    if len(set(tasks or [])) != len(tasks or []):
        raise UserError(f"--tasks names a task twice: {list(tasks)}")
    from fairprune.data.task_files import check_condition

    for name in tasks or []:  # a BBQ task keeps the rows of one context condition: the file must have some
        path = data.get(name, data.get("bbq")) if LOCAL_TASKS.get(name, ("",))[0] == "bbq" else None
        if path and path != HUB:
            check_condition(name, path, "disambig" if "disambig" in name else "ambig")
    return data


def bundled_data() -> dict[str, str]:
    """The bundled sets (generated once into the project cache), by data format."""
    from fairprune.data.yardsticks import write_yardsticks

    return {name: str(path) for name, path in write_yardsticks().items()}


@dataclass(frozen=True)
class TaskSpec:
    """What a task reads and how it is scored: ``data`` (a file, or None for lm-eval's stock data)."""

    name: str
    data: str | None
    scoring: str


def resolve_tasks(tasks: Sequence[str], task_data: dict[str, str]) -> list[TaskSpec]:
    """Each task's data file (``--task_data`` by task name, then by format, else the bundled set)."""
    bundled: dict[str, str] | None = None
    specs = []
    for name in tasks:
        if name not in LOCAL_TASKS:
            specs.append(TaskSpec(name, None, "lm-eval"))
            continue
        fmt, scoring = LOCAL_TASKS[name]
        path = task_data.get(name) or task_data.get(fmt)
        if path is None:
            bundled = bundled or bundled_data()
            path = bundled[fmt]
        specs.append(TaskSpec(name, None if path == HUB else path, scoring if path != HUB else "lm-eval"))
    return specs


# -- running lm-eval --------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet(progress: bool):
    """lm-eval's and datasets' log lines and bars off (its warnings are not the user's to act on):
    its loggers, numpy's empty-slice warnings of BBQ's per-context aggregates (the project
    recomputes them), and the ``git describe`` lm-eval runs for its results' metadata (a
    ``fatal: not a git repository`` line outside a clone; the project records its own version)."""
    import warnings

    import datasets
    from lm_eval import evaluator

    loggers = [logging.getLogger(n) for n in ("lm-eval", "lm_eval", "datasets", "absl")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    stderr, git_hash = sys.stderr, evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = lambda: None
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.simplefilter("ignore", RuntimeWarning)
    try:
        if not progress:
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lm-eval's request bars write to stderr
        yield
    finally:
        caught.__exit__(None, None, None)
        evaluator.get_git_commit_hash = git_hash
        if sys.stderr is not stderr:
            sys.stderr.close()
            sys.stderr = stderr
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


_STOCK_MANAGER = None


def _manager(stock: bool):
    """lm-eval's task index: empty for the project's tasks (scanning lm-eval's thousands of YAML
    files takes half a minute), the stock one, built once, when a stock task is named."""
    global _STOCK_MANAGER
    from lm_eval.tasks import TaskManager

    # Its log level comes from the loggers (_quiet), not from TaskManager's deprecated verbosity argument.
    if not stock:
        return TaskManager(include_defaults=False)
    if _STOCK_MANAGER is None:
        _STOCK_MANAGER = TaskManager()
    return _STOCK_MANAGER


def check_runnable(specs: Sequence[TaskSpec], num_fewshot: int | None = None) -> None:
    """Before the model loads, what lm-eval would otherwise find only once the model has been loaded
    and measured: a task name it does not know (one line naming the closest ones), and a
    ``num_fewshot`` larger than the examples a task can draw its shots from (the task's own
    documents less the one being asked, or its few-shot split). Builds the tasks as :func:`run_tasks`
    does (the stock index is built once per process, so the later run does not build it again)."""
    import difflib

    stock = [s.name for s in specs if not s.data]
    if stock:
        with _quiet(False):
            known = set(_manager(True).all_tasks)
        for name in stock:
            if name not in known:
                close = difflib.get_close_matches(name, [*LOCAL_TASKS, *known], n=3)
                raise UserError(f"--tasks: {name!r} is neither a task fairprune defines ({', '.join(LOCAL_TASKS)}) nor "
                                f"an lm-eval task, group or tag" + (f"; did you mean {', '.join(close)}?" if close else ""))
    if not num_fewshot:
        return
    local = [s for s in specs if s.data]
    if not local:
        return
    with _quiet(False):
        tasks = _manager(False).load([task_config(s.name, s.data) for s in local])["tasks"]
    for name, task in tasks.items():
        config = task.config
        docs = list(task.fewshot_docs() or [])
        available = len(docs) - (config.fewshot_split in (None, config.test_split))
        if num_fewshot > available:
            raise UserError(f"--num_fewshot {num_fewshot}: task {name} can draw at most {available} examples from its "
                            f"data; give --num_fewshot {available} or less, or more data")


@dataclass
class TaskResults:
    """A model's task figures (``{task: {metric: value}}``), their samples, and what was run."""

    figures: dict[str, dict[str, float]]
    items: TaskItems
    facts: dict[str, Any]
    seconds: float = 0.0
    from_cache: bool = False

    def chance(self) -> dict[str, dict[str, float]]:
        """Each accuracy's chance level (:func:`task_chance`)."""
        return task_chance(self.items)

    def validity(self, intervals: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Each headline figure's chance level and whether it is invalid (:func:`task_validity`)."""
        return task_validity(self.items, self.facts, intervals)


def run_tasks(model, tokenizer, specs: Sequence[TaskSpec], *, limit: float | None = None, num_fewshot: int | None = None,
              batch_size: int = 16, device: Any = None, progress: bool = True, seed: int = 0,
              streamed: bool = False) -> TaskResults:
    """Evaluate ``model`` (in memory) on ``specs`` through lm-eval; the figures are recomputed from
    the logged samples. ``limit`` and ``num_fewshot`` are passed through as lm-eval reads them.
    ``streamed``: the model's parameters stay on ``meta`` and each part is read in by hooks as the
    forward reaches it (:meth:`fairprune.causal.streamed.StreamedModel.runnable`)."""
    import torch
    from lm_eval import simple_evaluate

    from fairprune.metrics.shared_context import SharedContextLM

    start = time.perf_counter()
    configs = [task_config(s.name, s.data, seed) if s.data else s.name for s in specs]
    stock = any(isinstance(c, str) for c in configs)
    device = str(device or next(model.parameters()).device)
    if not streamed:  # a streamed model's parts are loaded onto the device by its hooks
        model.to(device)
    was_training = model.training
    try:
        with _quiet(progress):
            # A tokenizer that adds a BOS gets it on every request, as on every window the project reads.
            from fairprune.data.text import bos_of

            lm = SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                                 add_bos_token=True if bos_of(tokenizer) is not None else None)
            if streamed:  # HFLM takes a given model's device from its parameters: "meta" until a part is read
                lm._device = torch.device(device)
            results = simple_evaluate(model=lm, tasks=configs, limit=limit, num_fewshot=num_fewshot, log_samples=True,
                                      bootstrap_iters=0, task_manager=_manager(stock), verbosity="ERROR",
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed)
    except UserError:
        raise
    except Exception as err:  # lm-eval's own errors: a stock task offline, a malformed file it could not read
        names = ", ".join(s.name for s in specs)
        hint = (" (stock lm-eval tasks download their data: without network, use a task the project defines on local "
                f"files — {', '.join(LOCAL_TASKS)} — with --task_data)") if stock else ""
        raise UserError(f"lm-eval could not evaluate --tasks [{names}]: {type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}{hint}") from err
    finally:
        model.train(was_training)
    samples = results.get("samples") or {}
    items = TaskItems({name: task_entry(found, letters=LOCAL_TASKS.get(name, ("", ""))[1] == "letter")
                       for name, found in samples.items()})
    figures = task_figures(items)
    return TaskResults(figures, items, task_facts(specs, items, limit, num_fewshot), time.perf_counter() - start)


def task_facts(specs: Sequence[TaskSpec], items: TaskItems, limit: float | None, num_fewshot: int | None) -> dict[str, Any]:
    """What each task was measured on: its file, its scoring, the samples scored and, for letter
    tasks, the share of each letter among the answers (recomputed from the samples, also when they
    come from the cache)."""
    facts: dict[str, Any] = {"lm_eval": _lm_eval_version(), "limit": limit, "num_fewshot": num_fewshot}
    for spec in specs:
        for name in [n for n in items.tasks if n == spec.name or n.startswith(f"{spec.name}_")] or [spec.name]:
            entry = items.tasks.get(name, {"doc_ids": []})
            fact = {"data": spec.data or "lm-eval stock", "scoring": spec.scoring, "samples": len(entry["doc_ids"])}
            if entry.get("letters"):
                letters = string.ascii_uppercase[:entry.get("choices") or len(LETTERS)]
                # an item asked in three orders: its three letters (an UnQover unit: those of its questions)
                answered = np.asarray([int(x) for found in entry["letters"] for x in np.ravel(found)], dtype=int)
                shares = np.bincount(answered, minlength=len(letters)) / len(answered)
                fact["letter_shares"] = {letter: float(s) for letter, s in zip(letters, shares)}
            facts[name] = fact
    return facts


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def letter_warnings(facts: dict[str, Any], model: str) -> list[str]:
    """A line per letter task whose answers are nearly all one letter (a position bias)."""
    lines = []
    for name, fact in facts.items():
        shares = fact.get("letter_shares") if isinstance(fact, dict) else None
        if shares and max(shares.values()) >= ONE_LETTER_SHARE:
            letter, share = max(shares.items(), key=lambda kv: kv[1])
            cloze = CLOZE_OF.get(name)
            lines.append(f"warning: {model} answers {letter} to {share:.0%} of {name}'s letter prompts: a position bias, "
                         "not a measurement (marked invalid, left out of DTO)"
                         + (f"; read the cloze scoring ({cloze}) beside it" if cloze else ""))
    return lines
