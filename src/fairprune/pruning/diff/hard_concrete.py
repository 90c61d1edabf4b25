"""Diff-Pruning's hard-concrete gates (Louizos et al., 2018) and the parametrization
``θ₀ ↦ θ₀ + z ⊙ δ`` (:class:`DiffGate`) that carries one gate per gated weight.

The gradient reaches ``δ`` once, through ``z ⊙ δ``: the "fine-tuned − detach(fine-tuned) + base"
formulation seen in some public code adds it twice.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from fairprune.errors import UserError


@dataclass
class GateConfig:
    """Settings shared by all gates of a model.

    ``beta`` is the temperature, ``(left, right)`` the stretch interval, ``lam`` the weight of
    the expected-L0 penalty and ``alpha_lr`` the learning rate of the ``log α`` parameter group.
    """

    beta: float = 1.0
    left: float = -1.5
    right: float = 1.5
    log_alpha_init: float = 5.0
    lam: float = 1.25e-7
    alpha_lr: float = 0.1
    structured: bool = False

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise UserError(f"lam (the L0 penalty weight) must be >= 0, got {self.lam}; Diff-Pruning uses 1.25e-7")
        if not (self.left < 0 < 1 < self.right) or self.beta <= 0:
            raise UserError(f"the stretch must satisfy left < 0 and right > 1 with beta > 0, got ({self.left}, {self.right}), beta {self.beta}")
        if self.alpha_lr <= 0:
            raise UserError(f"alpha_lr must be > 0, got {self.alpha_lr}")


def _stretched(s: torch.Tensor, cfg: GateConfig) -> torch.Tensor:
    return (s * (cfg.right - cfg.left) + cfg.left).clamp(0.0, 1.0)


def _concrete(log_alpha: torch.Tensor, u: torch.Tensor, beta: float) -> torch.Tensor:
    """``sigmoid((logit(u) + log α)/β)`` written as ``1 / (1 + ((1−u)/u)^(1/β)·e^(−log α/β))``:
    one exponential instead of two logarithms and a sigmoid, and finite at u = 0 or 1."""
    odds = (1 - u) / u
    if beta != 1.0:
        odds = odds.pow(1.0 / beta)
    # The clamp keeps 0·inf (u = 1, very negative log α) from giving NaN.
    return torch.reciprocal(1 + odds * torch.exp(-log_alpha / beta).clamp(max=1e30))


def sample_gate(log_alpha: torch.Tensor, cfg: GateConfig, u: torch.Tensor | None = None) -> torch.Tensor:
    """Train-time gate ``clamp(sigmoid((logit(u) + log α)/β)·(r − l) + l, 0, 1)``, u ~ U(0, 1)."""
    if u is None:
        u = torch.rand_like(log_alpha)
    return _stretched(_concrete(log_alpha, u, cfg.beta), cfg)


class _GatedSum(torch.autograd.Function):
    """``θ₀ + z ⊙ δ`` with a freshly sampled ``z``, in one pass with a hand-written backward.

    Autograd through the plain expression keeps a dozen weight-sized intermediates per tensor;
    here only ``s`` is kept, and the gradients are ``g·z`` for δ and
    ``g·δ·(r − l)·s·(1 − s)/β`` for log α (zero where the clamp is active).
    """

    @staticmethod
    def forward(ctx, base, delta, log_alpha, beta: float, left: float, right: float):
        s = _concrete(log_alpha, torch.rand_like(log_alpha), beta)
        ctx.save_for_backward(s, delta)
        ctx.consts = (beta, left, right)
        z = (s * (right - left) + left).clamp(0.0, 1.0)
        return base + (z * delta).to(base.dtype)

    @staticmethod
    def backward(ctx, grad):
        s, delta = ctx.saved_tensors
        beta, left, right = ctx.consts
        stretched = s * (right - left) + left
        z = stretched.clamp(0.0, 1.0)
        grad = grad.to(delta.dtype)
        grad_delta = grad * z if ctx.needs_input_grad[1] else None
        grad_alpha = None
        if ctx.needs_input_grad[2]:
            inside = (stretched > 0) & (stretched < 1)
            grad_alpha = torch.where(inside, grad * delta * s * (1 - s) * ((right - left) / beta), torch.zeros_like(s))
        return None, grad_delta, grad_alpha, None, None, None


def deterministic_gate(log_alpha: torch.Tensor, cfg: GateConfig) -> torch.Tensor:
    """Eval-time gate ``clamp(sigmoid(log α)·(r − l) + l, 0, 1)``."""
    return _stretched(torch.sigmoid(log_alpha), cfg)


def prob_nonzero(log_alpha: torch.Tensor, cfg: GateConfig) -> torch.Tensor:
    """``P(z > 0) = sigmoid(log α − β·log(−l/r))``, the expected L0 norm per entry."""
    return torch.sigmoid(log_alpha - cfg.beta * math.log(-cfg.left / cfg.right))


class DiffGate(nn.Module):
    """The parametrization ``θ₀ ↦ θ₀ + z ⊙ δ`` of one weight.

    In the gated stage ``z`` is a hard-concrete gate (sampled in training mode, deterministic in
    eval mode); once :meth:`fix` was called, ``z`` is a frozen binary ``mask``. The stage and the
    settings travel in the state dict (``extra_state``), so a checkpoint resumes in the same stage.
    """

    def __init__(self, shape: torch.Size, cfg: GateConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.fixed = False
        self.delta = nn.Parameter(torch.zeros(shape, device=device))
        self.log_alpha = nn.Parameter(torch.full(shape, float(cfg.log_alpha_init), device=device))
        init = torch.tensor(float(cfg.log_alpha_init), device=device)
        self.tensor_log_alpha = nn.Parameter(init) if cfg.structured else None
        self.register_buffer("mask", torch.ones(shape, dtype=torch.bool, device=device))

    def gate(self) -> torch.Tensor:
        """The current ``z``: sampled when training, deterministic in eval mode, the mask once fixed."""
        if self.fixed:
            return self.mask.to(self.delta.dtype)
        pick = sample_gate if self.training else (lambda a, c: deterministic_gate(a, c))
        z = pick(self.log_alpha, self.cfg)
        if self.tensor_log_alpha is not None:
            z = z * pick(self.tensor_log_alpha, self.cfg)
        return z

    def forward(self, base: torch.Tensor) -> torch.Tensor:
        if self.training and not self.fixed and self.tensor_log_alpha is None:
            return _GatedSum.apply(base, self.delta, self.log_alpha, self.cfg.beta, self.cfg.left, self.cfg.right)
        return base + (self.gate() * self.delta).to(base.dtype)

    def effective_delta(self) -> torch.Tensor:
        """The difference the model applies at evaluation: ``mask ⊙ δ`` or ``z_eval ⊙ δ``."""
        with torch.no_grad():
            if self.fixed:
                return torch.where(self.mask, self.delta, torch.zeros_like(self.delta))
            z = deterministic_gate(self.log_alpha, self.cfg)
            if self.tensor_log_alpha is not None:
                z = z * deterministic_gate(self.tensor_log_alpha, self.cfg)
            return z * self.delta

    def expected_l0(self) -> torch.Tensor:
        """Expected number of non-zero gates (differentiable); the mask's count once fixed."""
        if self.fixed:
            return self.mask.sum().to(self.delta.dtype)
        p = prob_nonzero(self.log_alpha, self.cfg).sum()
        if self.tensor_log_alpha is not None:
            # Entry and tensor gates are independent: P(z_i · z_t > 0) = P(z_i > 0)·P(z_t > 0).
            p = p * prob_nonzero(self.tensor_log_alpha, self.cfg)
        return p

    @torch.no_grad()
    def fix(self, keep: torch.Tensor) -> None:
        """Replace the gate by the binary ``keep`` mask; δ takes the gated value it had at eval."""
        keep = keep.to(device=self.delta.device, dtype=torch.bool)
        self.delta.copy_(torch.where(keep, self.effective_delta(), torch.zeros_like(self.delta)))
        self.mask.copy_(keep)
        self.fixed = True
        for p in self.alpha_parameters():
            p.requires_grad_(False)

    def alpha_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.log_alpha, self.tensor_log_alpha) if p is not None]

    def get_extra_state(self) -> dict[str, Any]:
        return {"fixed": self.fixed, **asdict(self.cfg)}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.fixed = bool(state.pop("fixed"))
        self.cfg = GateConfig(**state)
        for p in self.alpha_parameters():
            p.requires_grad_(not self.fixed)
