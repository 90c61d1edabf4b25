"""Option types of the pruning methods, shared by the commands (``prune.py``), the callbacks and the
library: one name, one default and one check per option wherever it is set.

``CalibrationOptions``: what a post-training LM run calibrates and measures with; ``TaskOptions``:
its lm-eval pass (``--tasks``); ``LMOptions``: both, with the model, its texts and how the run is
saved: what every LM run takes (:func:`fairprune.runs.lm.prune_run`; ``prune.py``'s LM
commands take it as one group of flat options, the ``PostTrainingPruning`` callback builds it from
its own ``calibration`` and ``lm_eval``). ``SolverOptions``: SparseGPT's solver. ``HeadOptions``:
FASP and its baselines.

This module imports nothing heavy: ``prune.py --help`` reads it without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from fairprune.errors import UserError
from fairprune.hub.formats import DTYPES, QUANTIZE, SAVE_FORMATS
from fairprune.pruning.sparsity import Sparsity


@dataclass(frozen=True)
class CalibrationOptions:
    """What a post-training LM run calibrates and measures with.

    Args:
        pairs: StereoSet JSON or CrowS-Pairs CSV (default: the bundled pairs).
        nsamples: calibration windows.
        seqlen: calibration / scoring window length.
        eval_seqlen: perplexity window length (default: seqlen).
        device: auto, cpu, cuda, cuda:1 ...
        seed: seed of the calibration sample, the pair split and generation.
        eval_tokens: measure perplexity on the first N tokens of eval_text only (default: all of it); the stereotype pairs are unaffected.
    """

    pairs: str | None = None
    nsamples: int = 128
    seqlen: int = 128
    eval_seqlen: int | None = None
    device: str = "auto"
    seed: int = 0
    eval_tokens: int | None = None

    def __post_init__(self) -> None:
        from fairprune.hub import resolve_device

        # Checked here once for every LM command and the callback. One token predicts nothing.
        window = " (a window predicts each token from the ones before it)"
        for name, value, least, why in (("nsamples", self.nsamples, 1, ""), ("seqlen", self.seqlen, 2, window),
                                        ("eval_seqlen", self.eval_seqlen, 2, window)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise UserError(f"--{name} must be a whole number >= {least}{why}, got {value}")
        resolve_device(self.device)  # an unknown or absent device is refused before any loading
        if self.eval_tokens is not None and self.eval_tokens < self.window:
            raise UserError(f"--eval_tokens {self.eval_tokens} is less than one perplexity window of {self.window} tokens; "
                            f"give at least {self.window} or a smaller --eval_seqlen")

    @property
    def window(self) -> int:
        """The perplexity window."""
        return self.eval_seqlen or self.seqlen


@dataclass(frozen=True)
class TaskOptions:
    """The lm-evaluation-harness pass beside perplexity and the stereotype score (``--tasks``):
    every LM command's, and the ``PostTrainingPruning`` callback's ``lm_eval``.

    Args:
        tasks: lm-evaluation-harness tasks measured beside perplexity, on the model in memory, e.g. [hellaswag, mmlu, bbq_ambig, bbq_ambig_letter, crows_pairs_english] (these read local files: --task_data, else the bundled sets; any other lm-eval task name loads as lm-eval defines it and downloads its data).
        task_data: NAME=PATH entries pointing a task (or a data format: bbq, hellaswag, mmlu, crows_pairs) at a file in the data set's public format, e.g. bbq=/data/BBQ/data/Age.jsonl; NAME=hub: lm-eval's stock data.
        limit: lm-eval's --limit: the first N documents of each task (a fraction below 1: that share of them).
        num_fewshot: lm-eval's --num_fewshot (default: each task's own, zero-shot for the bundled tasks).
    """

    tasks: list[str] | str | None = None
    task_data: list[str] | str | None = None
    limit: float | None = None
    num_fewshot: int | None = None

    def __post_init__(self) -> None:
        for name in ("tasks", "task_data"):  # one item may come without brackets, as people type it
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, [value])
        if self.limit is not None and not (self.limit > 0 and math.isfinite(self.limit)):
            raise UserError(f"--limit must be a positive number of documents (or a fraction below 1); got {self.limit}")
        if self.limit is not None and self.limit > 1 and self.limit != int(self.limit):
            raise UserError(f"--limit {self.limit}: above 1 it counts documents, so give a whole number (below 1 it is "
                            "a share of each task's documents)")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UserError(f"--num_fewshot must be 0 or more; got {self.num_fewshot}")
        for name, value in (("--limit", self.limit), ("--num_fewshot", self.num_fewshot)):
            if value is not None and not self.tasks:
                raise UserError(f"{name} sets how lm-eval runs the --tasks, and no --tasks are given: add --tasks "
                                f"[...] or leave {name} out")


@dataclass(frozen=True)
class LMOptions(CalibrationOptions, TaskOptions):
    """What every LM run shares, whether a command or the ``PostTrainingPruning`` callback runs it:
    the model, its texts, where it runs, how it is saved (the calibration and measuring settings
    are :class:`CalibrationOptions`, the lm-eval pass :class:`TaskOptions`; the callback takes those
    two as they are and builds the rest).

    Args:
        model: hub name or folder of a causal LM (e.g. runs/lm/tiny_gpt2/model).
        calib_text: text file, folder of *.txt or chat .jsonl (UltraChat rows) the method calibrates or scores on, or bundled:ultrachat (256 generated UltraChat-format conversations) (default: the bundled corpus).
        calib_text_for: {SPARSITY: TEXT}, e.g. {"2:4": bundled:ultrachat}: the runs at that sparsity (an N:M pattern or a fraction, one of --sparsities or the run's --sparsity) calibrate on TEXT (as --calib_text takes it) instead of --calib_text; Debias-SparseGPT keeps its --pairs beside it. The Debias-SparseGPT paper adds 256 UltraChat rows at 2:4 alone: {"2:4": ROWS.jsonl} (configs/compare/debias_paper.yaml).
        eval_text: text measured for perplexity, e.g. WikiText-2 raw test (default: the bundled corpus).
        trust_remote_code: allow a hub model's own code to run.
        dense_cache: reuse the dense model's figures measured by an earlier run with the same weights, texts and settings (kept in the project cache, .cache/fairprune/dense); false: measure again.
        dtype: float32, bfloat16 or float16: the dtype the model is loaded, pruned and saved in (the solvers work in float32 inside each layer).
        save_format: dense (save_pretrained: zeros stored) or compressed (compressed-tensors sparse-bitmask, or sparse-24-bitmask at 2:4: the nonzeros and a bitmask; read by fairprune alone today); weight pruning only.
        quantize: none, w4a16, w8a16, w4a16-gptq or w8a16-gptq: after pruning, the blocks' linear layers quantized to 4- or 8-bit symmetric integers per group (a pruned zero stays zero; -gptq: with GPTQ's error compensation from the layer Hessian, the sparsity mask held fixed) and written as a compressed-tensors pack-quantized folder that plain transformers loads; the run's figures are measured on the model loaded back from it (the prune commands, in memory or --stream true, and compare --model beside each pruned row; not with --save_format compressed).
        quant_group_size: inputs per quantization group (a power of two); a layer whose input width it does not divide takes the largest power of two below it that does (at least 32, or the value given when smaller).
        quantize_methods: compare --model with --quantize: the methods that get a pruned + quantized row (default: every compared method).
        stream: true: read the weights block by block from the model's safetensors folder and write the pruned ones block by block, so the model is never whole in memory (one block resident; magnitude, wanda, sparsegpt, debias-sparsegpt, fasp and its baselines, evaluate, and compare with --sparsities or --alphas); false: load it whole; auto: stream when its weights in --dtype exceed half the available memory (the run prints which way it went).
    """

    model: str = field(kw_only=True)
    calib_text: str | None = None
    calib_text_for: dict[str, str] | None = None
    eval_text: str | None = None
    trust_remote_code: bool = False
    dense_cache: bool = True
    dtype: str = "float32"
    save_format: str = "dense"
    quantize: str = "none"
    quant_group_size: int = 128
    quantize_methods: list[str] | None = None
    stream: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        CalibrationOptions.__post_init__(self)
        TaskOptions.__post_init__(self)
        object.__setattr__(self, "calib_text_for", _by_sparsity(self.calib_text_for))
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.save_format not in SAVE_FORMATS:
            raise UserError(f"--save_format {self.save_format!r} is not one of {', '.join(SAVE_FORMATS)} (compressed: "
                            "compressed-tensors' sparse-bitmask / sparse-24-bitmask)")
        if self.quantize not in QUANTIZE:
            raise UserError(f"--quantize {self.quantize!r} is not one of {', '.join(QUANTIZE)}")
        group = self.quant_group_size
        if isinstance(group, bool) or not isinstance(group, int) or group < 8 or group & (group - 1):
            raise UserError(f"--quant_group_size must be a power of two of at least 8 (e.g. 128); got {group}")
        if self.quantize_methods is not None and self.quantize == "none":
            raise UserError("--quantize_methods names the methods that get a quantized row; give --quantize too "
                            "(e.g. --quantize w4a16)")
        if self.quantize != "none" and self.save_format != "dense":
            raise UserError(f"--quantize {self.quantize} writes a pack-quantized folder; it does not combine with "
                            f"--save_format {self.save_format} (compressed-tensors has no sparse + quantized layout today)")


    def calib_text_at(self, sparsity: Sparsity) -> str | None:
        """The calibration text of the runs at ``sparsity``: its ``calib_text_for`` entry, else ``calib_text``."""
        return (self.calib_text_for or {}).get(str(sparsity), self.calib_text)

    def at_sparsity(self, sparsity: Sparsity) -> LMOptions:
        """These options as one run at ``sparsity`` takes them: ``calib_text_for`` down to that
        sparsity's entry (None without one), so a run's settings name the text it calibrated on and
        nothing another sparsity does."""
        entry = {str(sparsity): self.calib_text_for[str(sparsity)]} if str(sparsity) in (self.calib_text_for or {}) else None
        return replace(self, calib_text_for=entry)

    def check_calib_text_for(self, sparsities: list[Sparsity], given: str = "--sparsities") -> None:
        """Every ``calib_text_for`` sparsity must be one the command runs (``sparsities``, named ``given``)."""
        runs = [str(s) for s in sparsities]
        stray = [key for key in self.calib_text_for or {} if key not in runs]
        if stray:
            raise UserError(f"--calib_text_for names {', '.join(stray)}, which {given} does not run ({', '.join(runs)}); "
                            "name sparsities the command runs")


def _by_sparsity(given) -> dict[str, str] | None:
    """``--calib_text_for`` checked, its keys written as :class:`Sparsity` writes them (``"2:4"``,
    ``"0.5"``); None when empty."""
    if not given:
        return None
    example = '(e.g. {"2:4": bundled:ultrachat})'
    if not isinstance(given, dict):
        raise UserError(f"--calib_text_for must map sparsities to calibration texts {example}; got {given!r}")
    found: dict[str, str] = {}
    for key, text in given.items():
        sparsity = str(Sparsity.parse(key, what="--calib_text_for sparsity"))
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"--calib_text_for {sparsity}: give a text file, a folder of *.txt, a chat .jsonl file or "
                            f"bundled:ultrachat; got {text!r}")
        if sparsity in found:
            raise UserError(f"--calib_text_for names sparsity {sparsity} twice ({found[sparsity]!r} and {text!r}); "
                            "give one text per sparsity")
        found[sparsity] = text
    return found


@dataclass(frozen=True)
class SolverOptions:
    """SparseGPT's solver settings.

    Args:
        percdamp: damping added to diag(H), as a fraction of its mean.
        blocksize: columns solved per block.
        moe_calibrate: mixture-of-experts models: all (every calibration token through every expert: each expert's statistics from every token; Debias-SparseGPT needs it) or routed (each expert from the tokens its router sends it; an expert that gets none is pruned by magnitude). Dense models: ignored.
    """

    percdamp: float = 0.01
    blocksize: int = 128
    moe_calibrate: str = "all"

    def __post_init__(self) -> None:
        if self.moe_calibrate not in ("all", "routed"):
            raise UserError(f"--moe_calibrate must be all or routed, got {self.moe_calibrate!r}")
        if self.percdamp < 0 or self.blocksize < 1:
            raise UserError(f"--percdamp must be >= 0 and --blocksize >= 1, got {self.percdamp} and {self.blocksize}")


@dataclass(frozen=True)
class HeadOptions:
    """Attention-head pruning (FASP and its baselines).

    Args:
        gamma: share of heads protected for perplexity; null = search on the validation prompts.
        alpha: share of all heads to remove.
        axis: bias axis (gender_and_sex, race_ethnicity, ...) or 'all'.
        scorer: 'auto' (jigsaw if toxic-comment-classifier is installed, else lexicon), 'jigsaw' or
            'jigsaw:<label>' (offline Jigsaw classifier), 'lexicon' (bundled) or an HF classifier name or folder.
        prompts: HolisticBias-format CSV (text,axis,bucket,descriptor), or a HolisticBias release folder
            (descriptors.json, nouns.json, sentence_templates.json: 10 seeded templates per descriptor, the
            descriptors as subgroups); default bundled.
        max_new_tokens: length of each generated continuation.
        max_batch: rows per forward pass when many head configurations are scored together
            (windows or prompts × configurations); null = chosen from the free memory.
    """

    gamma: float | None = 0.3
    alpha: float = 0.1
    axis: str = "gender_and_sex"
    scorer: str = "auto"
    prompts: str | None = None
    max_new_tokens: int = 20
    max_batch: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("alpha", self.alpha), ("gamma", self.gamma)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise UserError(f"--{name} must be in [0, 1], got {value}")
