"""Diff-Pruning: fine-tune a sparse difference ``δ`` on top of a frozen base model.

Every gated weight becomes ``θ = θ₀ + z ⊙ δ`` through ``torch.nn.utils.parametrize``: the base
``θ₀`` is the parametrization's ``original`` (frozen), ``δ`` starts at 0 so the gated model starts
exactly as the base, and ``z`` is a hard-concrete gate (Louizos et al., 2018) with one ``log α``
per entry, optionally times one per-tensor gate. The expected number of non-zero entries of
``z`` is differentiable and, scaled by ``λ``, is added to the task loss.

After gated training, :func:`magnitude_prune` keeps exactly ``k = round(fraction · total)``
entries of ``|z ⊙ δ|`` over all gated tensors and freezes that binary mask in place of the gates
(fixed-mask fine-tuning). :func:`save_diff` writes only the non-zero entries of the difference
(flat indices + values, safetensors), the tensors trained in full (the classifier head) and a
JSON naming the base and hashing its gated weights; :func:`load_diff` rebuilds base + δ exactly
and refuses another base.

The gradient reaches ``δ`` once, through ``z ⊙ δ``: the "fine-tuned − detach(fine-tuned) + base"
formulation seen in some public code adds it twice.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from fairprune.errors import UserError, suggest

GATED_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)
FORMAT = "fairprune-diff"


# ----------------------------------------------------------------------------------------------
# Hard-concrete gates


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


# ----------------------------------------------------------------------------------------------
# Which weights to gate


def head_prefixes(root: nn.Module) -> list[str]:
    """Module names of the task head: trained in full, never gated.

    For a transformers model the head is every child outside the base model
    (``base_model_prefix``: ``bert``, ``roberta``, ...), e.g. ``classifier`` or ``score``;
    for any other model, the last Linear.
    """
    heads: list[str] = []
    for name, module in root.named_modules():
        prefix = getattr(module, "base_model_prefix", None)
        if prefix and isinstance(getattr(module, prefix, None), nn.Module):
            heads += [_join(name, child) for child, _ in module.named_children() if child != prefix]
    if heads:
        return heads
    linears = [n for n, m in root.named_modules() if isinstance(m, nn.Linear) and n]
    return linears[-1:]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _is_gate_part(name: str) -> bool:
    """A parameter or buffer that belongs to a parametrization (θ₀, δ, log α, mask)."""
    return name.startswith("parametrizations.") or ".parametrizations." in name


def _plain_name(name: str) -> str:
    """``a.parametrizations.weight.original`` → ``a.weight``."""
    return name.replace("parametrizations.", "").removesuffix(".original")


def _in_head(name: str, heads: list[str]) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def default_gate_names(root: nn.Module) -> list[str]:
    """Weights of every Linear and Embedding outside the head, each shared tensor once."""
    heads, seen, names = head_prefixes(root), set(), []
    for mname, module in root.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, GATED_TYPES) and isinstance(weight, nn.Parameter) and not _in_head(mname, heads):
            # A tied tensor (shared embeddings) is gated where it first appears.
            if id(weight) not in seen:
                seen.add(id(weight))
                names.append(_join(mname, "weight"))
    return names


def resolve_gate_names(root: nn.Module, names: list[str] | None) -> list[str]:
    """Parameter names to gate: the defaults, or exact names / glob patterns (``*.query.weight``)."""
    if names is None:
        return default_gate_names(root)
    available = [n for n, _ in root.named_parameters()]
    chosen: list[str] = []
    for pattern in names:
        found = fnmatch.filter(available, pattern) if any(c in pattern for c in "*?[") else [n for n in available if n == pattern]
        if not found:
            raise UserError(f"no parameter named '{pattern}' to gate{suggest(pattern, available)}; names are relative to the transformers model")
        chosen += [n for n in found if n not in chosen]
    return chosen


# ----------------------------------------------------------------------------------------------
# Attaching gates and reading them back


def gates(root: nn.Module) -> dict[str, DiffGate]:
    """``{gated parameter name: its gate}`` in registration order."""
    found: dict[str, DiffGate] = {}
    for mname, module in root.named_modules():
        if parametrize.is_parametrized(module):
            for pname, plist in module.parametrizations.items():
                for p in plist:
                    if isinstance(p, DiffGate):
                        found[_join(mname, pname)] = p
    return found


def base_tensor(root: nn.Module, name: str) -> torch.Tensor:
    """The frozen base weight ``θ₀`` of a gated parameter, or the parameter itself when not gated."""
    mname, _, pname = name.rpartition(".")
    module = root.get_submodule(mname)
    if parametrize.is_parametrized(module, pname):
        return module.parametrizations[pname].original
    return getattr(module, pname)


def attach_gates(root: nn.Module, names: list[str] | None = None, cfg: GateConfig | None = None,
                 train_ungated: bool = False) -> list[str]:
    """Gate ``names`` (default: Linear and Embedding weights outside the head); return the names.

    Afterwards the trainable parameters are the δ and log α of every gate, the head, and (with
    ``train_ungated``) the base's other parameters (biases, LayerNorm); the rest is frozen.
    """
    cfg = cfg or GateConfig()
    chosen = resolve_gate_names(root, names)
    heads = head_prefixes(root)
    for name in chosen:
        mname, _, pname = name.rpartition(".")
        module = root.get_submodule(mname)
        weight = getattr(module, pname)
        parametrize.register_parametrization(module, pname, DiffGate(weight.shape, cfg, weight.device))
    for name, param in root.named_parameters():
        if name.endswith(".original"):
            param.requires_grad_(False)
        elif not _is_gate_part(name) and not _in_head(name, heads):
            param.requires_grad_(train_ungated)
    return chosen


def attach_gates_for(root: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> int:
    """Attach gates wherever ``state_dict`` holds a gated weight, so a Diff-Pruning checkpoint loads
    strictly into a freshly built model. Returns how many gates were attached."""
    names = [_plain_name(k[len(prefix):]) for k in state_dict
             if k.startswith(prefix) and k.endswith(".original") and _is_gate_part(k[len(prefix):])]
    todo = [n for n in names if n not in gates(root)]
    if todo:
        attach_gates(root, todo)
    return len(todo)


def l0_penalty(root: nn.Module) -> torch.Tensor:
    """``λ Σ P(z > 0)`` over every gate still in the gated stage (0 when there is none)."""
    terms = [g.cfg.lam * g.expected_l0() for g in gates(root).values() if not g.fixed]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def gated_total(root: nn.Module) -> int:
    """Number of gated entries."""
    return sum(g.delta.numel() for g in gates(root).values())


def expected_l0_fraction(root: nn.Module) -> float:
    """Expected fraction of non-zero gates (the mask's density once fixed)."""
    with torch.no_grad():
        return float(sum(g.expected_l0() for g in gates(root).values())) / max(gated_total(root), 1)


def nonzero_fraction(root: nn.Module) -> float:
    """Fraction of gated entries the model changes at evaluation (non-zero effective δ)."""
    return sum(int(g.effective_delta().count_nonzero()) for g in gates(root).values()) / max(gated_total(root), 1)


def alpha_parameters(root: nn.Module) -> list[nn.Parameter]:
    return [p for g in gates(root).values() for p in g.alpha_parameters()]


def param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters for an optimizer, with the gates' log α in their own group
    (``lr = alpha_lr``, no weight decay); a model without gates gets one group."""
    alphas = [p for p in alpha_parameters(module) if p.requires_grad]
    alpha_ids = {id(p) for p in alphas}
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in alpha_ids]
    groups: list[dict[str, Any]] = [{"params": rest}]
    if alphas:
        lr = next(iter(gates(module).values())).cfg.alpha_lr
        groups.append({"params": alphas, "lr": lr, "weight_decay": 0.0})
    return groups


def separate_alpha_group(optimizer: torch.optim.Optimizer, root: nn.Module) -> bool:
    """Move log α out of the optimizer's other groups into their own; True when anything moved.

    For LightningModules whose ``configure_optimizers`` passes plain ``parameters()``.
    """
    alphas = [p for p in alpha_parameters(root) if p.requires_grad]
    alpha_ids = {id(p) for p in alphas}
    moved = False
    for group in optimizer.param_groups:
        if any(id(p) in alpha_ids for p in group["params"]) and len(group["params"]) > len(alpha_ids & {id(p) for p in group["params"]}):
            group["params"] = [p for p in group["params"] if id(p) not in alpha_ids]
            moved = True
    if moved:
        lr = next(iter(gates(root).values())).cfg.alpha_lr
        optimizer.add_param_group({"params": alphas, "lr": lr, "weight_decay": 0.0})
    return moved


# ----------------------------------------------------------------------------------------------
# Magnitude pruning of the difference


def check_fraction(target_fraction: float) -> None:
    if not 0.0 < target_fraction <= 1.0:
        raise UserError(f"target_fraction must be in (0, 1] (the share of gated weights that may change), got {target_fraction}")


def keep_count(total: int, target_fraction: float) -> int:
    """``round(fraction · total)``, at least one entry."""
    check_fraction(target_fraction)
    return max(1, round(target_fraction * total))


def top_k_masks(scores: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Boolean masks keeping exactly the ``k`` largest scores over all tensors together."""
    flat = torch.cat([s.detach().flatten().float() for s in scores.values()])
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    keep[torch.topk(flat, k, sorted=False).indices] = True
    chunks = torch.split(keep, [s.numel() for s in scores.values()])
    return {name: chunk.view(s.shape) for (name, s), chunk in zip(scores.items(), chunks)}


def magnitude_prune(root: nn.Module, target_fraction: float, score: str = "gated") -> int:
    """Keep the ``k = round(fraction · total)`` largest ``|z ⊙ δ|`` (``score="gated"``) or ``|δ|``
    (``score="delta"``) over all gates and freeze the mask; return ``k``."""
    if score not in ("gated", "delta"):
        raise UserError(f"score must be 'gated' (|z·δ|) or 'delta' (|δ|), got '{score}'")
    found = gates(root)
    if not found:
        raise UserError("the model has no Diff-Pruning gates; attach them first (DiffPruning callback or attach_gates)")
    k = keep_count(gated_total(root), target_fraction)
    scores = {n: (g.effective_delta() if score == "gated" else g.delta.detach()).abs() for n, g in found.items()}
    for name, keep in top_k_masks(scores, k).items():
        found[name].fix(keep)
    return k


@torch.no_grad()
def fix_difference(root: nn.Module, deltas: dict[str, torch.Tensor], target_fraction: float) -> int:
    """Set gated δ to the ``k`` largest entries of given differences and freeze that mask (the
    "fine-tune, then magnitude-prune the difference" baseline); return ``k``."""
    found = gates(root)
    k = keep_count(gated_total(root), target_fraction)
    for name, keep in top_k_masks({n: deltas[n].abs() for n in found}, k).items():
        gate = found[name]
        # An all-ones fixed mask first, so that fix() takes δ as given rather than gated.
        gate.mask.fill_(True)
        gate.fixed = True
        gate.delta.copy_(deltas[name])
        gate.fix(keep)
    return k


# ----------------------------------------------------------------------------------------------
# Diff-only checkpoint


def weights_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, shapes, dtypes and bytes of the tensors, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def base_sha256(root: nn.Module, names: list[str] | None = None) -> str:
    """Hash of the base weights of the gated tensors (``names``, default: the gates)."""
    names = list(gates(root)) if names is None else names
    return weights_sha256({n: base_tensor(root, n) for n in names})


def trained_in_full(root: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters that are not part of a gate (the head, and ungated base parameters
    when they were trained), by their plain names."""
    return {n: p.detach() for n, p in root.named_parameters() if p.requires_grad and not _is_gate_part(n)}


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def full_bytes(root: nn.Module) -> int:
    """Bytes of a full checkpoint of the merged model (every tensor of the plain state dict)."""
    plain: dict[str, torch.Tensor] = {}
    for name, t in root.state_dict().items():
        if _is_gate_part(name) and not name.endswith(".original"):
            continue
        plain[_plain_name(name)] = t
    return sum(t.numel() * t.element_size() for t in plain.values() if isinstance(t, torch.Tensor))


def save_diff(root: nn.Module, folder: str | Path, base: str, base_hash: str | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``diff.safetensors`` (sparse δ + full head) and ``diff.json`` into ``folder``.

    ``base`` is the base model's hub name or folder, ``base_hash`` its :func:`base_sha256`
    (computed from the gated model when not given). Returns the JSON written, which also
    gives ``stored_bytes`` (both files) and ``full_bytes`` (a full checkpoint of the model).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    nonzero = 0
    for name, gate in gates(root).items():
        flat = gate.effective_delta().flatten()
        idx = flat.nonzero().squeeze(1)
        tensors[f"delta.{name}.indices"] = idx.to(_index_dtype(flat.numel())).cpu().contiguous()
        tensors[f"delta.{name}.values"] = flat[idx].cpu().contiguous()
        shapes[name] = list(gate.delta.shape)
        nonzero += idx.numel()
    for name, t in trained_in_full(root).items():
        tensors[f"full.{name}"] = t.cpu().contiguous()
    save_file(tensors, str(folder / "diff.safetensors"))
    meta = {
        "format": FORMAT, "version": 1, "base": base,
        "base_sha256": base_hash or base_sha256(root), "gated": shapes,
        "nonzero": nonzero, "total": gated_total(root),
        "config": root.config.to_dict() if hasattr(root, "config") else None,
        **(extra or {}),
    }
    (folder / "diff.json").write_text(json.dumps(meta, indent=2) + "\n")
    meta["stored_bytes"] = sum((folder / f).stat().st_size for f in ("diff.safetensors", "diff.json"))
    meta["full_bytes"] = full_bytes(root)
    return meta


def read_diff(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON and the tensors of a diff checkpoint."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "diff.json").is_file() or not (folder / "diff.safetensors").is_file():
        raise UserError(f"'{folder}' is not a Diff-Pruning checkpoint: it needs diff.json and diff.safetensors")
    meta = json.loads((folder / "diff.json").read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"'{folder}/diff.json' is not a {FORMAT} file")
    return meta, load_file(str(folder / "diff.safetensors"))


def _load_base(meta: dict[str, Any]) -> nn.Module:
    """The base model named in the JSON, with the stored config (so the head has the right size)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    source = meta["base"]
    try:
        config = AutoConfig.for_model(**meta["config"]) if meta.get("config") else None
        return AutoModelForSequenceClassification.from_pretrained(source, config=config)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the base model '{source}' named in diff.json; pass base=<model or folder> ({' '.join(str(err).split())[:160]})") from err


@torch.no_grad()
def load_diff(folder: str | Path, base: nn.Module | str | None = None) -> nn.Module:
    """Rebuild the fine-tuned model: base + δ, head restored; returns a plain model in eval mode.

    ``base`` is a model (copied, not modified), a hub name / folder, or None for the one named in
    ``diff.json``. A base whose gated weights do not hash to the stored sha256 is refused.
    """
    meta, tensors = read_diff(folder)
    if base is None or isinstance(base, str):
        model = _load_base({**meta, "base": base or meta["base"]})
    else:
        model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    missing = [n for n in meta["gated"] if n not in params]
    if missing:
        raise UserError(f"the base model lacks the diff's weight '{missing[0]}'; give the base model the diff was trained from")
    found = weights_sha256({n: params[n] for n in meta["gated"]})
    if found != meta["base_sha256"]:
        raise UserError(f"the base weights do not match the diff (sha256 {found[:12]}… ≠ {meta['base_sha256'][:12]}…); "
                        f"give the base model it was trained from ({meta['base']})")
    for name in meta["gated"]:
        weight = params[name].view(-1)
        idx = tensors[f"delta.{name}.indices"].long().to(weight.device)
        # The same addition the gated model performs (θ₀ + δ), so logits match bit for bit.
        weight[idx] = weight[idx] + tensors[f"delta.{name}.values"].to(weight.device, weight.dtype)
    for key, value in tensors.items():
        if key.startswith("full."):
            params[key[len("full."):]].copy_(value)
    return model.eval()
