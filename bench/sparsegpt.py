"""SparseGPT: the blocked solver against an unblocked float64 OBS oracle, and the layer-wise
reconstruction error of magnitude, Wanda and SparseGPT on GPT-2-sized layers.

Layers (out × in): attention projection 768×768, MLP up 3072×768, MLP down 768×3072. Inputs are
random but LLM-like: correlated columns, uneven channel scales and a few outlier channels.

* accuracy — relative reconstruction error ``‖WX − ŴX‖ / ‖WX‖`` on held-out tokens for
  magnitude (layer-wide), Wanda and SparseGPT at 50 % unstructured and 2:4, full layers.
* speed — the blocked solver (fp32 and fp64) against the unblocked oracle: float64, one column
  at a time, every remaining column updated immediately (no lazy block updates), same mask rule.
  Both run on full layers (``--oracle-rows N`` restricts both to the first N output rows for a
  quicker run); the mask agreement and largest weight difference between the two are reported.
  Both start with the same Hessian factorisation (three O(in³) Cholesky steps), timed separately.
  On CPU the run uses one thread and reports CPU seconds of this process, which stay meaningful
  on a shared machine where wall time does not; they are single measurements.

Writes ``bench/results/sparsegpt.json`` and ``.md``.

    python bench/sparsegpt.py [--tokens 2048] [--oracle-rows N] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from fairprune.pruning.select import n_m, top_k
from fairprune.pruning.sparsegpt import inverse_hessian_cholesky, sparsegpt_solve
from fairprune.pruning.sparsity import Sparsity
from fairprune.pruning.wanda import wanda_mask

LAYERS = {"attn 768x768": (768, 768), "mlp-up 3072x768": (3072, 768), "mlp-down 768x3072": (768, 3072)}
SETTINGS = {"50%": dict(sparsity=0.5), "2:4": dict(nm=(2, 4))}  # the oracle's own arguments
TYPED = {"50%": Sparsity.parse(0.5), "2:4": Sparsity.parse("2:4")}


def llm_like_inputs(tokens: int, cols: int, seed: int, device) -> torch.Tensor:
    """Correlated columns (low-rank mix), log-normal channel scales, 1 % outlier channels ×20."""
    g = torch.Generator().manual_seed(seed)
    rank = max(8, cols // 8)
    mix = torch.randn(rank, cols, generator=g) / math.sqrt(rank)
    X = torch.randn(tokens, rank, generator=g) @ mix + 0.3 * torch.randn(tokens, cols, generator=g)
    scale = torch.exp(0.5 * torch.randn(cols, generator=g))
    scale[torch.randperm(cols, generator=g)[: max(1, cols // 100)]] *= 20
    return (X * scale).to(device)


def unblocked_oracle(W: torch.Tensor, H: torch.Tensor, sparsity=None, nm=None, blocksize=128, percdamp=0.01):
    """Column-by-column OBS in float64 with the same mask rule and no lazy updates."""
    W, H = W.double().clone(), H.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    U = inverse_hessian_cholesky(H, percdamp)
    d = U.diagonal()
    rows, cols = W.shape
    mask = torch.zeros_like(W, dtype=torch.bool)
    for i in range(cols):
        if nm is None and i % blocksize == 0:
            i2 = min(i + blocksize, cols)
            k = math.floor(sparsity * rows * i2) - math.floor(sparsity * rows * i)
            score = (W[:, i:i2] ** 2 / d[i:i2] ** 2).flatten()
            block = torch.zeros_like(score, dtype=torch.bool)
            block[score.argsort()[:k]] = True
            mask[:, i:i2] = block.view(rows, -1)
        if nm is not None and i % nm[1] == 0:
            score = W[:, i : i + nm[1]] ** 2 / d[i : i + nm[1]] ** 2
            mask[:, i : i + nm[1]].scatter_(1, score.argsort(dim=1)[:, : nm[0]], True)
        w = W[:, i]
        q = w.masked_fill(mask[:, i], 0)
        W[:, i:] -= ((w - q) / d[i]).unsqueeze(1) * U[i, i:].unsqueeze(0)
        W[:, i] = q
    return W


def rel_error(W: torch.Tensor, Q: torch.Tensor, X: torch.Tensor) -> float:
    ref = X @ W.T
    return float((ref - X @ Q.to(W.dtype).T).norm() / ref.norm())


def timed(fn, device):
    """Result and seconds: CPU seconds of this process on CPU (stable on a shared machine), wall on GPU."""
    cuda = str(device).startswith("cuda")
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize()
    start = clock()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, clock() - start


def bench_layer(name: str, shape, seed: int, args) -> dict:
    rows, cols = shape
    device = args.device
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(device)
    # One distribution: calibrate on the first tokens, measure on the held-out rest.
    X, X_test = llm_like_inputs(args.tokens * 3 // 2, cols, seed=1, device=device).split([args.tokens, args.tokens // 2])
    H = 2 / len(X) * X.T @ X
    norms = X.norm(dim=0)
    # Both solvers start with the same Hessian factorisation; timed once so the loops can be compared.
    _, factor64 = timed(lambda: inverse_hessian_cholesky(H.double()), device)
    _, factor32 = timed(lambda: inverse_hessian_cholesky(H), device)
    result = {"shape": [rows, cols], "factorisation_s": {"fp64": factor64, "fp32": factor32}, "error": {}, "speed": {}}
    for setting, kw in SETTINGS.items():
        nm = kw.get("nm")
        keep = n_m(W.abs(), *nm) if nm else top_k(W.abs(), W.numel() - int(W.numel() * kw["sparsity"]))
        magnitude = ~keep  # pruned: the lowest |W| of the layer (N:M: of every M columns)
        sgpt, seconds = timed(lambda: sparsegpt_solve(W, H, TYPED[setting]), device)  # noqa: B023 (timed() calls it at once)
        result["error"][setting] = {
            "magnitude": rel_error(W, W.masked_fill(magnitude, 0), X_test),
            "wanda": rel_error(W, W.masked_fill(wanda_mask(W, norms, TYPED[setting]), 0), X_test),
            "sparsegpt": rel_error(W, sgpt, X_test),
            "sparsegpt_seconds_full_layer": seconds,
        }
        sub = W[: args.oracle_rows or rows]
        fast32, t32 = timed(lambda: sparsegpt_solve(sub, H, TYPED[setting]), device)  # noqa: B023 (timed() calls it at once)
        fast64, t64 = timed(lambda: sparsegpt_solve(sub, H.double(), TYPED[setting]), device)  # noqa: B023 (timed() calls it at once)
        slow, t_oracle = timed(lambda: unblocked_oracle(sub, H, **kw), device)  # noqa: B023 (timed() calls it at once)
        result["speed"][setting] = {
            "rows": int(sub.shape[0]),
            "blocked_fp32_s": t32, "blocked_fp64_s": t64, "oracle_fp64_s": t_oracle,
            "speedup_vs_oracle_fp32": t_oracle / t32, "speedup_vs_oracle_fp64": t_oracle / t64,
            "mask_agreement_fp64": float(((fast64 == 0) == (slow == 0)).float().mean()),
            "max_abs_diff_fp64": float((fast64 - slow).abs().max()),
            "mask_agreement_fp32": float(((fast32 == 0) == (slow == 0)).float().mean()),
            "rel_error_rows_fp32_vs_oracle": [rel_error(sub, fast32, X_test), rel_error(sub, slow, X_test)],
        }
        print(f"{name:18s} {setting:4s} err mag={result['error'][setting]['magnitude']:.3f} "
              f"wanda={result['error'][setting]['wanda']:.3f} sgpt={result['error'][setting]['sparsegpt']:.3f} | "
              f"oracle/blocked fp32 {t_oracle / t32:.1f}x fp64 {t_oracle / t64:.1f}x", flush=True)
    return result


def markdown(report: dict) -> str:
    lines = [
        "# SparseGPT benchmark", "",
        f"device: {report['device']} ({report['threads']} threads), tokens: {report['tokens']}, "
        f"torch {report['torch']}, {report['seconds']:.0f} s total", "",
        "## Relative reconstruction error ‖WX − ŴX‖/‖WX‖ (held-out tokens, full layers)", "",
        "| layer | setting | magnitude | Wanda | SparseGPT |", "|---|---|---|---|---|",
    ]
    for name, r in report["layers"].items():
        for setting, e in r["error"].items():
            lines.append(f"| {name} | {setting} | {e['magnitude']:.4f} | {e['wanda']:.4f} | {e['sparsegpt']:.4f} |")
    lines += [
        "", "## Blocked solver vs unblocked float64 oracle", "",
        "Seconds are CPU seconds on CPU (one thread, single runs). Both solvers run on the same `rows` "
        "output rows and include the same Hessian factorisation.", "",
        "| layer | setting | rows | factorisation fp64 s | oracle s | blocked fp64 s | blocked fp32 s | speed-up fp64 | speed-up fp32 | mask agree fp64 | max abs diff fp64 | mask agree fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["layers"].items():
        for setting, s in r["speed"].items():
            lines.append(
                f"| {name} | {setting} | {s['rows']} | {r['factorisation_s']['fp64']:.2f} | {s['oracle_fp64_s']:.2f} | "
                f"{s['blocked_fp64_s']:.2f} | {s['blocked_fp32_s']:.2f} | {s['speedup_vs_oracle_fp64']:.1f}× | "
                f"{s['speedup_vs_oracle_fp32']:.1f}× | {s['mask_agreement_fp64']:.4f} | "
                f"{s['max_abs_diff_fp64']:.1e} | {s['mask_agreement_fp32']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--oracle-rows", type=int, default=None, help="run the oracle on the first N output rows only (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; 1 by default because idle OpenMP threads spin and inflate CPU time")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sparsegpt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    layers = {name: bench_layer(name, shape, seed, args) for seed, (name, shape) in enumerate(LAYERS.items())}
    report = {
        "device": str(args.device) if args.device == "cpu" else torch.cuda.get_device_name(),
        "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "tokens": args.tokens, "oracle_rows": args.oracle_rows, "layers": layers,
        "seconds": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
