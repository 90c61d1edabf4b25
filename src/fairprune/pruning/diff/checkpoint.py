"""The diff-only checkpoint: ``diff.safetensors`` holds the non-zero entries of the difference
(flat indices + values) and the tensors trained in full (the classifier head); ``diff.json`` names
the base and hashes its gated weights. :func:`load_diff` rebuilds base + δ exactly and refuses
another base."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fairprune.errors import UserError
from fairprune.pruning.diff.attach import _is_gate_part, _plain_name, base_tensor, gated_total, gates

FORMAT = "fairprune-diff"


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
