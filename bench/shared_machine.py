"""Benchmark: LM work on a busy machine, by OpenMP wait policy and thread count.

Run: ``.venv/bin/python bench/shared_machine.py [--rounds 3] [--work prune score]`` (about six
minutes on two cores).

Two workloads, each in a fresh process per measurement: ``prune``, a SparseGPT prune of one
SmolLM2-135M-shaped Llama block (hidden 576, MLP 1536, 64 calibration windows of 128 tokens: the
calibration forward, the Hessians and the solve, through ``fairprune.pruning.llm.prune_causal_lm``);
``score``, the packaged SmolLM2-135M (float32) scoring lm-eval's log-likelihood requests of the
bundled BBQ three-answer cloze (its first 24 documents, 72 requests) through
:class:`~fairprune.metrics.shared_context.SharedContextLM`, as the yardsticks do. A fresh process
starts its OpenMP runtime with its own settings: two threads with OpenMP's default wait (GNU
OpenMP's waiting threads spin for a while), with ``OMP_WAIT_POLICY=PASSIVE`` (they sleep at once),
with ``GOMP_SPINCOUNT`` 10k and 1k; one thread; and the command lines' default
(:func:`fairprune.cli.fit_threads`: the defaults on an idle machine, on a busy one as many threads
as idle cores, waiting passively).

Each runs on an idle machine and beside one busy process (a Python loop spinning on one core, as
another user's job would), the configurations taking turns in every round so that load hits them
alike. Results (median seconds, and each against one thread on the same machine state and workload):
``bench/results/shared_machine.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "shared_machine"
CONFIGS = {"2 threads, OpenMP's default": ("2", None, None), "2 threads, passive": ("2", "PASSIVE", None),
           "2 threads, spin 10k": ("2", None, "10000"), "2 threads, spin 1k": ("2", None, "1000"),
           "1 thread": ("1", None, None), "the command lines' default": (None, None, None)}

PRUNE = """
import sys
if sys.argv[1:] == ["cli"]:  # as prune.py starts: the threads fitted to the machine before torch loads
    import fairprune.cli
import time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.sparsity import Sparsity
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                                     num_key_value_heads=3, vocab_size=512, max_position_embeddings=256)).eval()
ids = torch.randint(0, 512, (64, 128), generator=torch.Generator().manual_seed(1))
tick = time.perf_counter()
prune_causal_lm(model, "sparsegpt", Sparsity.parse(0.5), ids, progress=False)
print(time.perf_counter() - tick)
"""

SCORE = """
import sys
if sys.argv[1:] == ["cli"]:
    import fairprune.cli
import time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from fairprune.data.text import bos_of
from fairprune.hub import resolve_name
from fairprune.hub.converted import SMOLLM2
from fairprune.metrics.harness import LOCAL_TASKS, _manager, _quiet, bundled_data, task_config
from fairprune.metrics.shared_context import SharedContextLM
folder = resolve_name(SMOLLM2)
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
with _quiet(False):
    lm = SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=16, device="cpu",
                         add_bos_token=True if bos_of(tokenizer) is not None else None)
    task = "bbq_ambig_cloze3"
    tasks = _manager(False).load([task_config(task, bundled_data()[LOCAL_TASKS[task][0]])])["tasks"]
    instances = []
    for one in tasks.values():
        one.build_all_requests(limit=24, rank=0, world_size=1)
        instances += one.instances
    lm.loglikelihood(instances[:6], disable_tqdm=True)  # one-time kernel set-up
    tick = time.perf_counter()
    lm.loglikelihood(instances, disable_tqdm=True)
print(time.perf_counter() - tick)
"""
WORKS = {"prune": PRUNE, "score": SCORE}


def measure(work: str, threads: str | None, policy: str | None, spin: str | None) -> float:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads is not None:
        env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    env.update({**({"OMP_WAIT_POLICY": policy} if policy else {}), **({"GOMP_SPINCOUNT": spin} if spin else {})})
    argv = [] if threads is not None else ["cli"]
    done = subprocess.run([sys.executable, "-c", WORKS[work], *argv], env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", nargs="+", choices=sorted(WORKS), default=list(WORKS))
    args = parser.parse_args()
    seconds = {work: {state: {c: [] for c in CONFIGS} for state in ("idle", "busy")} for work in args.work}
    for state in ("idle", "busy"):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if state == "busy" else None
        try:
            time.sleep(0.5)
            for _ in range(args.rounds):
                for work in args.work:
                    for name, (threads, policy, spin) in CONFIGS.items():
                        seconds[work][state][name].append(measure(work, threads, policy, spin))
                        print(work, state, name, f"{seconds[work][state][name][-1]:.2f} s", flush=True)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    medians = {work: {state: {c: statistics.median(v) for c, v in found.items()} for state, found in states.items()}
               for work, states in seconds.items()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                                    "cores": os.cpu_count(), "rounds": args.rounds,
                                                    "seconds": seconds, "median": medians}, indent=1))
    lines = ["| work | machine | configuration | median seconds | against 1 thread |", "|---|---|---|---|---|"]
    for work, states in medians.items():
        for state, found in states.items():
            for name, value in found.items():
                lines.append(f"| {work} | {state} | {name} | {value:.2f} | ×{value / found['1 thread']:.2f} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
