"""Benchmark: calibration statistics shared by the layers that read one input, against one per layer.

Run: ``.venv/bin/python bench/shared_statistics.py [--hidden 1024 --intermediate 2816 --nsamples 16 --seqlen 256]``
(``--hidden 576 --intermediate 1536 --out bench/results/shared_statistics_smollm2`` for SmolLM2-135M's block shape).

SparseGPT, Debias-SparseGPT and Wanda accumulate a statistic of each prunable layer's input over
the calibration batches (:func:`fairprune.pruning.calibration._collect`). In a Llama-shaped block
q, k and v read the same tensor, as do gate and up, so their statistics are the same sums of the
same terms: shared (the default), each is accumulated and held once. This runs one block of a
random Llama (float32) on the same captured calibration batches both ways, side by side in one
process (``time_side_by_side``: the two take turns, so load on the machine hits both alike), and
reports the seconds per block, the float64 bytes the block's statistics hold (ExactSum parts),
and that every layer's statistic value is bit-identical both ways, for SparseGPT's Hessian and
Wanda's input norms. Results: ``bench/results/shared_statistics.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fairprune.causal.blocks import Resident
from fairprune.causal.families import family_of, linear_weight
from fairprune.causal.pipeline import capture as capture_block_inputs
from fairprune.models.deploy import time_side_by_side
from fairprune.pruning.calibration import _collect, make_inputs
from fairprune.pruning.sparsegpt import Hessian
from fairprune.pruning.wanda import InputNorms

OUT = Path(__file__).resolve().parent / "results" / "shared_statistics"


def held_bytes(stats: dict) -> int:
    """Bytes of the float64 sums the distinct statistics of ``stats`` hold."""
    total, seen = 0, set()
    for stat in stats.values():
        if id(stat) in seen:
            continue
        seen.add(id(stat))
        sums = [stat.sum] if hasattr(stat, "sum") else [stat.sq]
        total += sum(part.numel() * part.element_size() for s in sums for part in s.parts.values())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")))
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=1,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                         vocab_size=1000, max_position_embeddings=args.seqlen)
    model = LlamaForCausalLM(config).eval()
    family = family_of(model)
    ids = torch.randint(0, config.vocab_size, (args.nsamples, args.seqlen))
    with torch.no_grad():
        batches = capture_block_inputs(Resident(model), make_inputs(ids, batch_size=1), "cpu")
    block = family.block_list(model)[0]
    layers = family.block_linears(block)
    result = {"settings": {**vars(args), "torch": torch.__version__, "python": platform.python_version(),
                           "machine": platform.machine(), "cpus": os.cpu_count()}, "statistics": {}}
    for make in (Hessian, InputNorms):
        held: dict[str, dict] = {}

        def run(share: bool, make=make, held=held) -> None:
            stats = {name: make(linear_weight(layer).shape[1]) for name, layer in layers.items()}
            with torch.no_grad():
                _collect(0, block, layers, stats, batches, share=share)
            held["shared" if share else "per layer"] = stats

        seconds = time_side_by_side({"shared": lambda: run(True), "per layer": lambda: run(False)}, warmup=0,
                                    repeats=args.repeats)
        shared, apart = held["shared"], held["per layer"]
        identical = all(torch.equal(shared[name].value(), apart[name].value()) for name in layers)
        median = {name: statistics.median(values) for name, values in seconds.items()}
        result["statistics"][make.__name__] = {
            "seconds": median, "speedup": median["per layer"] / median["shared"],
            "bytes": {"shared": held_bytes(shared), "per layer": held_bytes(apart)},
            "distinct": {"shared": len({id(s) for s in shared.values()}), "per layer": len(layers)},
            "identical": identical,
        }
        print(f"[bench] {make.__name__}: {median['per layer']:.2f} s per layer → {median['shared']:.2f} s shared, "
              f"identical {identical}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = [f"# Shared calibration statistics: one Llama block (hidden {s['hidden']}, intermediate {s['intermediate']})",
             "", f"`python bench/shared_statistics.py`: {s['nsamples']} × {s['seqlen']} calibration tokens, batches of one, "
             f"float32, {s['threads']} thread(s), median of {s['repeats']} timings taken in turns.", "",
             "| statistic | seconds, one per layer | seconds, shared | speed-up | MB, one per layer | MB, shared | statistics | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in r["statistics"].items():
        lines.append(f"| {name} | {v['seconds']['per layer']:.2f} | {v['seconds']['shared']:.2f} | {v['speedup']:.2f}× | "
                     f"{v['bytes']['per layer'] / 1e6:.1f} | {v['bytes']['shared'] / 1e6:.1f} | "
                     f"{v['distinct']['per layer']} → {v['distinct']['shared']} | {'yes' if v['identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
