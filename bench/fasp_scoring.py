"""FASP head scoring: gates in one process against reloading the model for every head.

Both paths compute, for the unpruned model and for every head removed alone, the perplexity on
the same text and the per-axis bias of continuations for the same validation prompts (seeded
sampling, lexicon scorer):

* gated — :func:`fairprune.pruning.fasp.score_heads`: one model, a forward pre-hook per layer,
  each head silenced by its gate;
* reload — per head, ``from_pretrained`` of the saved model, the head zeroed
  (:func:`~fairprune.pruning.heads.remove_heads`), then the same measurement.

The model is a randomly initialised GPT-2 built from a config (nothing is downloaded) with a
byte-level BPE tokenizer trained on the bundled corpus. The two paths must give the same scores
(the largest difference is reported). CPU runs use one thread and report both wall and process
CPU seconds; these are single measurements.

Writes ``bench/results/fasp_scoring.json`` and ``.md``.

    python bench/fasp_scoring.py [--layers 4] [--heads 8] [--width 128] [--new-tokens 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from fairprune.data.prompts import holistic_prompts, split_prompts
from fairprune.data.text import lm_corpus, train_bpe_tokenizer
from fairprune.metrics.toxicity import LexiconScorer
from fairprune.pruning.fasp import Evaluator, Generation, score_heads, token_ids
from fairprune.pruning.heads import remove_heads


def build(args, tokenizer):
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=args.layers, n_head=args.heads, n_embd=args.width, n_positions=256,
                           vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tf.GPT2LMHeadModel(config).eval().to(args.device)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def reload_per_head(folder: Path, evaluator_for, layers: int, heads: int) -> list[dict]:
    rows = []
    for layer, head in [(-1, -1)] + [(l, h) for l in range(layers) for h in range(heads)]:
        model = tf.AutoModelForCausalLM.from_pretrained(folder).eval().to(evaluator_for.device)
        if layer >= 0:
            remove_heads(model, [(layer, head)])
        result = evaluator_for(model)()
        rows.append({"layer": layer, "head": head, "perplexity": result["perplexity"],
                     **{f"bias:{a}": b for a, b in result["bias"].items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fasp_scoring"))
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    corpus = lm_corpus(train_docs=300, validation_docs=60)
    tokenizer = train_bpe_tokenizer(corpus.train, 512)
    prompts, _ = split_prompts(holistic_prompts(), 0.2, seed=0)
    ppl_ids = token_ids(tokenizer, corpus.validation)[: args.ppl_tokens]
    generation = Generation(max_new_tokens=args.new_tokens, batch_size=64)
    model = build(args, tokenizer)

    def evaluator_for(m):
        return Evaluator(model=m, tokenizer=tokenizer, prompts=prompts, ppl_ids=ppl_ids, scorer=LexiconScorer(),
                         generation=generation, seqlen=128, ppl_batch_size=8)

    evaluator_for.device = args.device
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model.save_pretrained(folder)
        gated, gated_wall, gated_cpu = timed(lambda: score_heads(evaluator_for(model), Path(tmp) / "scores.csv", progress=False))
        reload, reload_wall, reload_cpu = timed(lambda: reload_per_head(folder, evaluator_for, args.layers, args.heads))
    columns = [c for c in gated.columns if c not in ("layer", "head")]
    by_head = {(int(r["layer"]), int(r["head"])): r for r in gated.to_dict("records")}
    max_diff = max(abs(by_head[(r["layer"], r["head"])][c] - r[c]) for r in reload for c in columns)
    result = {
        "device": args.device, "platform": platform.platform(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "model": {"layers": args.layers, "heads": args.heads, "width": args.width},
        "prompts": len(prompts), "new_tokens": args.new_tokens, "ppl_tokens": int(ppl_ids.numel()),
        "evaluations": len(reload),
        "gated": {"wall_s": gated_wall, "cpu_s": gated_cpu},
        "reload": {"wall_s": reload_wall, "cpu_s": reload_cpu},
        "speedup_wall": reload_wall / gated_wall, "speedup_cpu": reload_cpu / gated_cpu,
        "max_abs_score_diff": max_diff,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(
        f"# FASP head scoring ({args.device}, {result['threads']} thread(s))\n\n"
        f"GPT-2 {args.layers}×{args.heads} heads, width {args.width}; {len(prompts)} prompts × {args.new_tokens} new tokens; "
        f"{result['ppl_tokens']} perplexity tokens; {len(reload)} evaluations per path.\n\n"
        "| path | wall s | CPU s |\n|---|---|---|\n"
        f"| gated (one process) | {gated_wall:.2f} | {gated_cpu:.2f} |\n"
        f"| reload per head | {reload_wall:.2f} | {reload_cpu:.2f} |\n\n"
        f"Speed-up: {result['speedup_wall']:.2f}× wall, {result['speedup_cpu']:.2f}× CPU. "
        f"Largest score difference between the paths: {max_diff:.3g}.\n"
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
