"""Benchmark: --moe_calibrate all against routed, on tiny mixture-of-experts models.

Run: ``.venv/bin/python bench/moe_calibrate.py`` (about a minute on two cores).

For Mixtral, Qwen3-MoE and OLMoE built from their configs (8 experts, 2 per token, hidden 128),
with the router's weights scaled so that routing is uneven (as in trained models, where some
experts see few tokens), SparseGPT at 50 % is run on the same calibration windows (the bundled
corpus, a BPE tokenizer trained on it) with each expert calibrated on every token (``all``) and on
the tokens its router sends it (``routed``), at two calibration budgets. Measured on held-out
windows of the same corpus: the pruned model's output error against the dense model's
(``‖logits − dense‖ / ‖dense‖``) and the mean KL divergence of its next-token distributions from
the dense model's; and how many experts no calibration token reached (``routed`` prunes them by
magnitude). Results: ``bench/results/moe_calibrate.{json,md}``.
"""

from __future__ import annotations

import copy
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fairprune.data.text import calibration_ids, lm_corpus, train_bpe_tokenizer
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.options import SolverOptions
from fairprune.pruning.sparsity import Sparsity

OUT = Path(__file__).resolve().parent / "results" / "moe_calibrate"
SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, num_experts_per_tok=2)
FAMILIES = {"mixtral": dict(num_local_experts=8), "qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, head_dim=32),
            "olmoe": dict(num_experts=8)}
ROUTER_SCALE = 8.0


def build(family: str, vocab: int):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, vocab_size=vocab, **SHAPE, **FAMILIES[family]))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    return model.eval()


@torch.no_grad()
def errors(model, dense, held: torch.Tensor) -> tuple[float, float]:
    a, b = model(input_ids=held).logits.float(), dense(input_ids=held).logits.float()
    rel = float((a - b).norm() / b.norm())
    kl = float(torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none")
               .sum(-1).mean())
    return rel, kl


def main() -> None:
    torch.set_num_threads(2)
    corpus = lm_corpus(train_docs=80, validation_docs=12, seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_bpe_tokenizer(corpus.train, 500, Path(tmp) / "tok")
    held = calibration_ids(tokenizer, corpus.validation, 8, 64, seed=1)
    rows = []
    for family in FAMILIES:
        dense = build(family, len(tokenizer))
        for nsamples in (2, 32):
            calib = calibration_ids(tokenizer, corpus.train, nsamples, 64, seed=0)
            for mode in ("all", "routed"):
                model = copy.deepcopy(dense)
                tick = time.perf_counter()
                result = prune_causal_lm(model, "sparsegpt", Sparsity.parse(0.5), calib,
                                         solver=SolverOptions(moe_calibrate=mode), progress=False)
                seconds = time.perf_counter() - tick
                rel, kl = errors(model, dense, held)
                routed = [c for counts in result["experts"]["routed_tokens"].values() for c in counts]
                rows.append({"family": family, "nsamples": nsamples, "mode": mode, "relative_error": rel, "kl": kl,
                             "seconds": seconds, "experts_without_tokens": len(result["experts"]["magnitude_fallback"]) // 2,
                             "fewest_routed_tokens": min(routed), "experts": len(routed)})
                print(rows[-1], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    facts = {"machine": platform.processor() or platform.machine(), "threads": 2, "router_scale": ROUTER_SCALE,
             "shape": SHAPE, "rows": rows}
    OUT.with_suffix(".json").write_text(json.dumps(facts, indent=1))
    lines = ["| family | windows | --moe_calibrate | output error vs dense | KL vs dense | experts with no routed token | fewest routed tokens | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['nsamples']} | {r['mode']} | {r['relative_error']:.4f} | {r['kl']:.5f} | "
              f"{r['experts_without_tokens']} of {r['experts']} | {r['fewest_routed_tokens']} | {r['seconds']:.1f} |" for r in rows]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
