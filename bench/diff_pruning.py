"""Diff-Pruning step time: a training step with hard-concrete gates against plain fine-tuning.

Same model (a BERT of all-MiniLM-L6-v2's shape, built from a config, or ``--size tiny``), same
batch of random token ids, same optimizer (AdamW), measured side by side in one run: the two
steps alternate after a warm-up and the median of each is kept. The gated step samples every
gate, adds the expected-L0 penalty and updates δ, log α and the head; the plain step updates
every parameter. Writes ``bench/results/diff_pruning.json``. Target: gated / plain <= 1.5.

    python bench/diff_pruning.py [--size minilm] [--batch-size 32] [--seqlen 128] [--steps 10] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fairprune.hub import build_model
from fairprune.models.text_classifier import tiny_bert_config
from fairprune.pruning import diff

SIZES = {
    "minilm": {"model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
               "intermediate_size": 1536, "max_position_embeddings": 512},
    "tiny": tiny_bert_config(),
}
VOCAB = {"minilm": 30522, "tiny": 1000}


def build(size: str, device: torch.device, gated: bool):
    torch.manual_seed(0)
    model = build_model(SIZES[size], "sequence-classification", num_labels=8, vocab_size=VOCAB[size]).to(device)
    if gated:
        diff.attach_gates(model)
    optimizer = torch.optim.AdamW(diff.param_groups(model), lr=1e-4)
    return model.train(), optimizer


def step(model, optimizer, batch, device) -> float:
    """One optimizer step; returns its wall time (synchronised on GPU)."""
    ids, labels = batch
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels) + diff.l0_penalty(model).to(device)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="minilm")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "diff_pruning.json"))
    args = parser.parse_args()
    device = torch.device(args.device)

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, VOCAB[args.size], (args.batch_size, args.seqlen), generator=g).to(device),
             torch.randint(0, 8, (args.batch_size,), generator=g).to(device))
    runs = {"plain": build(args.size, device, gated=False), "gated": build(args.size, device, gated=True)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        for name, (model, optimizer) in runs.items():  # alternating: both see the same machine load
            seconds = step(model, optimizer, batch, device)
            if i >= args.warmup:
                times[name].append(seconds)
    median = {name: statistics.median(t) for name, t in times.items()}
    gated_model = runs["gated"][0]
    result = {
        "benchmark": "diff_pruning_step_time", "size": args.size, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "batch_size": args.batch_size, "seqlen": args.seqlen, "steps": args.steps,
        "parameters": sum(p.numel() for p in runs["plain"][0].parameters()),
        "gated_entries": diff.gated_total(gated_model),
        "seconds_per_step": median, "ratio_gated_over_plain": median["gated"] / median["plain"], "target_ratio": 1.5,
        "torch": torch.__version__,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
