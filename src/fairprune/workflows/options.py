"""The typed option groups the workflows take and ``prune.py`` exposes (the option types a run shares
with the callbacks, ``LMOptions`` and its parts ``CalibrationOptions`` and ``TaskOptions``,
``SolverOptions`` and ``HeadOptions``, are in :mod:`fairprune.pruning.options`).

``prune.py`` is built from the workflow functions' signatures: a parameter typed with one of these
dataclasses becomes a group of flat options (``--model``, ``--seqlen``, ...) shared by every command
that takes it, so an LM option has one name and one meaning everywhere. The two TypedDicts type
the dictionaries passed on to Lightning: ``--trainer '{max_epochs: 3, accelerator: gpu}'`` and
``--data '{root: /data/UTKFace}'``; an unknown key is an error, not a silent no-op.

This module imports nothing heavy: ``prune.py --help`` reads it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from fairprune.errors import UserError
from fairprune.pruning.options import LMOptions


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


@dataclass(frozen=True)
class VisionCompareOptions:
    """A vision compare's settings (compare --ckpt).

    Every method at every sparsity (and granularity), once per seed; each field is the option of
    ``prune.py compare`` of that name (its help says ``vision:``, as the command lists it beside an
    LM compare's options).

    Args:
        methods: the methods compared.
        sparsities: the target sparsities (fractions).
        pruning: vision: IterativePruning settings shared by every method (keep_per_iter, retrain_epochs, ...).
        trainer: vision: Trainer arguments.
        data: vision: data overrides (root, batch_size, num_workers, max_samples).
        seed: the global seed (of the one run per cell without ``seeds``).
        seeds: vision: run every cell once per seed (e.g. [0, 1, 2]); the table gives mean ± sd and n.
        dense_per_seed: vision: train the dense model afresh per seed (the checkpoint's settings and epochs).
        reference: vision: what degradation is measured against: continued (the dense model trained on for as many epochs as the pruning schedule retrains, without pruning; cached) or dense (the checkpoint as it is).
        baseline: the method every other is paired with (default: the first).
        granularities: vision: run every method at each of these granularities, e.g. [weight, channel] (default: pruning.granularity, weight); with channel the table gets a granularity column.
        deploy: vision: measure each network's size, MACs and CPU latency (PyTorch, ONNX Runtime) beside the dense one's (columns params (M), MB, MMACs, ms/img ...; a few seconds per cell).
    """

    methods: list[str]
    sparsities: list[float]
    pruning: dict | None = None
    trainer: TrainerOptions | None = None
    data: DataOptions | None = None
    seed: int = 0
    seeds: list[int] | None = None
    dense_per_seed: bool = False
    reference: str = "continued"
    baseline: str | None = None
    granularities: list[str] | None = None
    deploy: bool = True

    @property
    def every_seed(self) -> list[int]:
        """The seeds every cell runs with: ``seeds``, else ``[seed]``."""
        return list(self.seeds) if self.seeds else [self.seed]
