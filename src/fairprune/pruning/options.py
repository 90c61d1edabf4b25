"""Option types of the pruning methods, shared by the commands (``prune.py``), the callbacks and the
library: one name, one default and one check per option wherever it is set.

``CalibrationOptions``: what a post-training LM run calibrates and measures with (``prune.py``'s
LM commands take them inside ``LMOptions``; the ``PostTrainingPruning`` callback takes them as they
are). ``SolverOptions``: SparseGPT's solver. ``HeadOptions``: FASP and its baselines.

This module imports nothing heavy: ``prune.py --help`` reads it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairprune.errors import UserError


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
class SolverOptions:
    """SparseGPT's solver settings.

    Args:
        percdamp: damping added to diag(H), as a fraction of its mean.
        blocksize: columns solved per block.
    """

    percdamp: float = 0.01
    blocksize: int = 128

    def __post_init__(self) -> None:
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
