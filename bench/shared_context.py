"""Benchmark: multiple-choice scoring with each context read once against lm-eval's own HFLM.

Run: ``.venv/bin/python bench/shared_context.py [--limit 40] [--rounds 3] [--batch_size 16] [--threads 1]``
(a few minutes on two cores).

The packaged SmolLM2-135M (float32, CPU) scores the log-likelihood requests of each task on the
bundled sets (``fairprune.metrics.harness.bundled_data()``, the first ``--limit`` documents)
through lm-eval's ``HFLM`` and through the project's
:class:`~fairprune.metrics.shared_context.SharedContextLM`, the two taking turns in every round
(``loglikelihood`` on the task's instances: tokenizing and scoring, the same requests for both);
the medians give requests per second, of wall time and of this process's CPU time (one thread by
default: on a shared machine the CPU seconds are the steadier figure), and the speed-ups. The last
round's answers are checked: each request's log-likelihood within 1e-4 of HFLM's, the same greedy
flag, and the task's figures (lm-eval's ``process_results`` and aggregation over the documents)
equal.

Writes ``bench/results/shared_context.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parent / "results" / "shared_context"
TASKS = ("bbq_ambig_cloze3", "bbq_ambig_letter_balanced", "hellaswag", "mmlu", "bbq_ambig")
TOLERANCE = 1e-4
#: ``--second``: other families at SmolLM2-135M's shape (hidden 576, MLP 1536, 30 layers, 9 query and
#: 3 key-value heads), so that the speed-up is checked on a second model.
SECOND = {"qwen3": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
          "gemma2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64)}


def task_instances(name: str, data: dict[str, str], limit: int):
    """lm-eval's tasks of ``name`` (a group gives several) on the bundled set, and their instances."""
    from fairprune.metrics.harness import LOCAL_TASKS, _manager, task_config

    tasks = _manager(False).load([task_config(name, data[LOCAL_TASKS[name][0]])])["tasks"]
    for task in tasks.values():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
    return tasks


def figures(tasks, answers: list) -> dict[str, dict[str, float]]:
    """Each task's figures from ``answers`` (its instances' in order), as lm-eval aggregates them."""
    found, at = {}, 0
    for name, task in tasks.items():
        by_doc = defaultdict(list)
        for instance in task.instances:
            by_doc[instance.doc_id].append((instance.idx, answers[at]))
            at += 1
        docs = {instance.doc_id: instance.doc for instance in task.instances}
        values = defaultdict(list)
        for doc_id, got in by_doc.items():
            for metric, value in task.process_results(docs[doc_id], [a for _, a in sorted(got)]).items():
                values[metric].append(value)
        found[name] = {m: float(task.aggregation()[m](v)) for m, v in values.items()}
    return found


def measure(scorers: dict, instances: list, rounds: int) -> tuple[dict, dict, dict]:
    """Each scorer's wall and CPU seconds per round (taking turns) and its last answers."""
    wall: dict[str, list[float]] = {s: [] for s in scorers}
    cpu: dict[str, list[float]] = {s: [] for s in scorers}
    answers: dict[str, list] = {}
    for _ in range(rounds):
        for label, lm in scorers.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            answers[label] = lm.loglikelihood(instances, disable_tqdm=True)
            wall[label].append(time.perf_counter() - start)
            cpu[label].append(time.process_time() - start_cpu)
    return wall, cpu, answers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=40, help="documents per task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds mean something on a shared machine)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--second", choices=sorted(SECOND), default=None,
                        help="a second model: that family built from its config at SmolLM2's size, random weights "
                             "(seed 0), SmolLM2's tokenizer; results in shared_context_<family>.{json,md}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fairprune.data.text import bos_of
    from fairprune.hub import resolve_name
    from fairprune.hub.converted import SMOLLM2
    from fairprune.metrics.harness import _quiet, bundled_data
    from fairprune.metrics.shared_context import SharedContextLM

    folder = resolve_name(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if args.second:
        from transformers import AutoConfig

        torch.manual_seed(0)
        config = AutoConfig.for_model(args.second, vocab_size=len(tokenizer), **SECOND[args.second])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        label, out = f"{args.second} (SmolLM2-135M's size, random weights)", OUT.with_name(f"{OUT.name}_{args.second}")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        label, out = SMOLLM2, OUT
    common = dict(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, device="cpu",
                  add_bos_token=True if bos_of(tokenizer) is not None else None)
    data = bundled_data()
    results: dict[str, dict] = {}
    loads = [os.getloadavg()]
    with _quiet(False):
        scorers = {"HFLM": HFLM(**common), "shared context": SharedContextLM(**common)}
        for name in args.tasks:
            tasks = task_instances(name, data, args.limit)
            instances = [i for task in tasks.values() for i in task.instances]
            scorers["shared context"].loglikelihood(instances[:8], disable_tqdm=True)  # one-time kernel set-up
            wall, cpu, answers = measure(scorers, instances, args.rounds)
            reference, got = answers["HFLM"], answers["shared context"]
            worst = max(abs(a[0] - b[0]) for a, b in zip(reference, got))
            assert worst <= TOLERANCE, f"{name}: a log-likelihood differs by {worst:.2e}"
            assert [a[1] for a in reference] == [b[1] for b in got], f"{name}: a greedy flag differs"
            np.testing.assert_equal(figures(tasks, got), figures(tasks, reference), err_msg=f"{name}: the figures differ")
            median = {label: statistics.median(s) for label, s in wall.items()}
            median_cpu = {label: statistics.median(s) for label, s in cpu.items()}
            results[name] = {"requests": len(instances), "contexts": len({tuple(i.args[:1]) for i in instances}),
                             "wall_s": wall, "cpu_s": cpu, "median_wall_s": median, "median_cpu_s": median_cpu,
                             "requests_per_s": {label: len(instances) / s for label, s in median.items()},
                             "requests_per_cpu_s": {label: len(instances) / s for label, s in median_cpu.items()},
                             "speedup": median["HFLM"] / median["shared context"],
                             "speedup_cpu": median_cpu["HFLM"] / median_cpu["shared context"],
                             "largest_difference": worst, "figures": figures(tasks, got)}
            loads.append(os.getloadavg())
            print(name, f"x{results[name]['speedup']:.2f} (CPU x{results[name]['speedup_cpu']:.2f})", median, flush=True)
    settings = {"model": label, "dtype": "float32", "device": "cpu", "limit": args.limit, "rounds": args.rounds,
                "batch_size": args.batch_size, "threads": args.threads, "cpus": os.cpu_count(), "load_average": loads,
                "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
                "lm_eval": version("lm_eval"), "transformers": version("transformers"), "tolerance": TOLERANCE}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"settings": settings, "tasks": results}, indent=1) + "\n")
    one_minute = [load[0] for load in loads]
    lines = ["# Shared-context scoring", "",
             f"`python bench/shared_context.py --limit {args.limit} --rounds {args.rounds}"
             f"{f' --second {args.second}' if args.second else ''}` — {label} in float32 on "
             f"CPU, {args.threads} thread(s) of {settings['cpus']} cores, batch size {args.batch_size}; the first "
             f"{args.limit} documents of each bundled set; medians of {args.rounds} rounds, the two scorers taking "
             f"turns; load average {min(one_minute):.1f}–{max(one_minute):.1f} (a shared machine: the CPU-second "
             f"figures are the steadier). Every request's log-likelihood within {TOLERANCE:g} of HFLM's, the same "
             "greedy flags, the same figures.", "",
             "| task | requests | contexts | HFLM requests/s | shared requests/s | speed-up | "
             "HFLM requests/CPU-s | shared requests/CPU-s | speed-up (CPU) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, found in results.items():
        rps, cps = found["requests_per_s"], found["requests_per_cpu_s"]
        lines.append(f"| {name} | {found['requests']} | {found['contexts']} | {rps['HFLM']:.1f} | "
                     f"{rps['shared context']:.1f} | ×{found['speedup']:.2f} | {cps['HFLM']:.1f} | "
                     f"{cps['shared context']:.1f} | ×{found['speedup_cpu']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
