"""The typed option groups the workflows take and ``prune.py`` exposes (the methods' own option
types, ``CalibrationOptions``, ``SolverOptions`` and ``HeadOptions``, are in :mod:`fairprune.pruning.options`).

``prune.py`` is built from the workflow functions' signatures: a parameter typed with one of these
dataclasses becomes a group of flat options (``--model``, ``--seqlen``, ...) shared by every command
that takes it, so an LM option has one name and one meaning everywhere. The two TypedDicts type
the dictionaries passed on to Lightning: ``--trainer '{max_epochs: 3, accelerator: gpu}'`` and
``--data '{root: /data/UTKFace}'``; an unknown key is an error, not a silent no-op.

This module imports nothing heavy: ``prune.py --help`` reads it without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from fairprune.errors import UserError
from fairprune.hub.formats import DTYPES, QUANTIZE, SAVE_FORMATS
from fairprune.pruning.options import CalibrationOptions


@dataclass(frozen=True)
class LMOptions(CalibrationOptions):
    """What every LM command shares: the model, its texts, where it runs (the calibration and
    measuring settings are :class:`~fairprune.pruning.options.CalibrationOptions`, which the
    ``PostTrainingPruning`` callback takes too).

    Args:
        model: hub name or folder of a causal LM (e.g. runs/lm/tiny_gpt2/model).
        calib_text: text file or folder of *.txt the method calibrates or scores on (default: the bundled corpus).
        eval_text: text measured for perplexity, e.g. WikiText-2 raw test (default: the bundled corpus).
        trust_remote_code: allow a hub model's own code to run.
        dense_cache: reuse the dense model's figures measured by an earlier run with the same weights, texts and settings (kept in the project cache, .cache/fairprune/dense); false: measure again.
        dtype: float32, bfloat16 or float16: the dtype the model is loaded, pruned and saved in (the solvers work in float32 inside each layer).
        save_format: dense (save_pretrained: zeros stored) or compressed (compressed-tensors sparse-bitmask, or sparse-24-bitmask at 2:4: the nonzeros and a bitmask; read by fairprune alone today); weight pruning only.
        quantize: none, w4a16, w8a16, w4a16-gptq or w8a16-gptq: after pruning, the blocks' linear layers quantized to 4- or 8-bit symmetric integers per group (a pruned zero stays zero; -gptq: with GPTQ's error compensation from the layer Hessian, the sparsity mask held fixed) and written as a compressed-tensors pack-quantized folder that plain transformers loads; the run's figures are measured on the model loaded back from it (the prune commands, in memory or --stream true, and compare --model beside each pruned row; not with --save_format compressed).
        quant_group_size: inputs per quantization group (a power of two); a layer whose input width it does not divide takes the largest power of two below it that does (at least 32, or the value given when smaller).
        quantize_methods: compare --model with --quantize: the methods that get a pruned + quantized row (default: every compared method).
        tasks: lm-evaluation-harness tasks measured beside perplexity, on the model in memory, e.g. [hellaswag, mmlu, bbq_ambig, bbq_ambig_letter, crows_pairs_english] (these read local files: --task_data, else the bundled sets; any other lm-eval task name loads as lm-eval defines it and downloads its data).
        task_data: NAME=PATH entries pointing a task (or a data format: bbq, hellaswag, mmlu, crows_pairs) at a file in the data set's public format, e.g. bbq=/data/BBQ/data/Age.jsonl; NAME=hub: lm-eval's stock data.
        limit: lm-eval's --limit: the first N documents of each task (a fraction below 1: that share of them).
        num_fewshot: lm-eval's --num_fewshot (default: each task's own, zero-shot for the bundled tasks).
        stream: true: read the weights block by block from the model's safetensors folder and write the pruned ones block by block, so the model is never whole in memory (one block resident; magnitude, wanda, sparsegpt, debias-sparsegpt, fasp and its baselines, evaluate, and compare with --sparsities or --alphas); false: load it whole; auto: stream when its weights in --dtype exceed half the available memory (the run prints which way it went).
    """

    model: str = field(kw_only=True)
    calib_text: str | None = None
    eval_text: str | None = None
    trust_remote_code: bool = False
    dense_cache: bool = True
    dtype: str = "float32"
    save_format: str = "dense"
    quantize: str = "none"
    quant_group_size: int = 128
    quantize_methods: list[str] | None = None
    stream: bool | Literal["auto"] = "auto"
    tasks: list[str] | str | None = None
    task_data: list[str] | str | None = None
    limit: float | None = None
    num_fewshot: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
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


@dataclass(frozen=True)
class GGUFOptions:
    """``prune.py export --format gguf``: the GGUF type and what the written file is measured on.

    Args:
        gguf_type: f16, q8_0 or q4_0: the ggml type of the 2-D tensors (norms and biases stay F32; with q4_0 the embedding and LM head are Q8_0).
        eval_text: text the loaded-back model's perplexity is measured on beside the source's (default: the bundled corpus).
        eval_tokens: measure on the first N tokens of eval_text.
        eval_seqlen: perplexity window length; the logits check runs on the first window.
        trust_remote_code: allow a hub model's own code to run.
    """

    gguf_type: str = "f16"
    eval_text: str | None = None
    eval_tokens: int = 2048
    eval_seqlen: int = 128
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        from fairprune.hub.formats import GGUF_TYPES

        if self.gguf_type not in GGUF_TYPES:
            raise UserError(f"--gguf_type {self.gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
        for name, value in (("eval_seqlen", self.eval_seqlen), ("eval_tokens", self.eval_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise UserError(f"--{name} must be a whole number >= 2; got {value}")
        if self.eval_tokens < self.eval_seqlen:
            raise UserError(f"--eval_tokens {self.eval_tokens} is less than one --eval_seqlen window of {self.eval_seqlen}")


def check_trainer(trainer: dict | None, name: str = "--trainer's max_epochs") -> None:
    """One line for Trainer settings Lightning would take and misread (``max_epochs`` below -1
    trains on and on): checked wherever fairprune builds a Trainer, before any work."""
    max_epochs = (trainer or {}).get("max_epochs")
    if isinstance(max_epochs, int) and not isinstance(max_epochs, bool) and max_epochs < -1:
        raise UserError(f"{name} {max_epochs}: give a number of epochs >= 0, or -1 for no limit")


#: Trainer settings that change nothing a fit computes (progress bars, the model summary, logging).
RESULT_NEUTRAL = frozenset({"enable_progress_bar", "enable_model_summary", "log_every_n_steps"})


def result_settings(trainer: dict | None) -> dict:
    """A Trainer's settings less the result-neutral ones (:data:`RESULT_NEUTRAL`): what decides
    whether an earlier run can stand for this one."""
    return {k: v for k, v in (trainer or {}).items() if k not in RESULT_NEUTRAL}


def model_folder(lm: LMOptions, **_: object) -> str:
    """The places an LM command reads its model from (``@locked(..., reads=model_folder)``: no
    output may be one, lie inside one or hold one): the ``--model`` value and what it resolves to
    on disk (a GGUF model's converted folder, a hub name's cached snapshot)."""
    from fairprune.hub import read_folders

    return read_folders(lm.model)


@dataclass(frozen=True)
class MachineOptions:
    """How a command runs on this machine; every prune.py command takes these.

    Args:
        threads: CPU threads for torch, and for numba, OpenMP / MKL and the tokenizers likewise (default: torch's own choice).
        quiet: no progress bars, fairprune's nor transformers' (the one-line results are still printed); --quiet alone means true.
    """

    threads: int | None = None
    quiet: bool = False

    @property
    def progress(self) -> bool:
        """Show progress bars."""
        return not self.quiet

    def apply(self) -> None:
        """Make the process follow these options (call before the work starts).

        Threads: torch's intra-op pool now; numba's pool now when numba is loaded (capped at the
        pool it was started with), else when it loads; OpenMP, MKL and the tokenizers' pool through
        the environment, for what starts later. ``threads`` None leaves every library its own
        choice. Quiet: transformers' and the hub's own bars (loading, saving) are turned off too;
        fairprune's bars read :attr:`progress` where they are made."""
        import os
        import sys

        skip_gpu_compiler()
        if self.quiet:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when transformers loads
            if "transformers" in sys.modules:
                from transformers.utils import logging

                logging.disable_progress_bar()
        if self.threads is None:
            return
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise UserError(f"--threads must be a whole number >= 1, got {self.threads}")
        import torch

        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
            os.environ[name] = str(self.threads)
        numba = sys.modules.get("numba")
        if numba is None:
            os.environ["NUMBA_NUM_THREADS"] = str(self.threads)
        else:
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        # torch last: numba's OpenMP layer resets the OpenMP thread count torch reads.
        torch.set_num_threads(self.threads)


def skip_gpu_compiler() -> None:
    """On a machine where torch sees no GPU, make triton read as not installed.

    triton compiles GPU kernels and nothing else. ``torch._dynamo``, which transformers' model
    code imports (``masking_utils``), imports it whenever it is installed, and that costs a CPU
    run about 80 MB of resident memory for no use. Once triton is imported, or with a GPU,
    nothing changes; a process that later wants it (torch.compile for a GPU) must run on a
    machine with one, where it is left alone."""
    import sys

    import torch

    if "triton" not in sys.modules and not torch.cuda.is_available():
        sys.modules["triton"] = None  # what importlib reads as absent: find_spec gives None, import raises ImportError


class TrainerOptions(TypedDict, total=False):
    """Lightning Trainer arguments passed on by the vision commands."""

    accelerator: str
    devices: int | str
    strategy: str
    num_nodes: int
    precision: str | int
    max_epochs: int
    limit_train_batches: int | float
    limit_val_batches: int | float
    limit_test_batches: int | float
    log_every_n_steps: int
    enable_progress_bar: bool
    enable_model_summary: bool
    num_sanity_val_steps: int
    deterministic: bool
    benchmark: bool
    accumulate_grad_batches: int
    gradient_clip_val: float


class DataOptions(TypedDict, total=False):
    """Overrides of the data module a checkpoint was trained with."""

    root: str
    batch_size: int
    num_workers: int
    max_samples: int
