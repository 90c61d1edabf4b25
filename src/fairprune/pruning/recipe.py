"""``--recipe FILE``: a run's modifiers as a YAML list, in the order they change each block.

```yaml
- sparsegpt:
    sparsity: "2:4"
- quantize:
    scheme: w4a16-gptq
    group_size: 128
```

Each entry is a mapping of one modifier name (:func:`fairprune.pruning.modifiers.modifier_names`:
an LM pruning method, or ``quantize``) to its options. The file is read with ``yaml.safe_load``
(no object is ever built from it) and checked whole before any model is loaded; every mistake is
one line naming the entry. A run applies one pruning method first (the run's method and sparsity),
then its other modifiers: ``quantize`` once at most, and any registered with
:func:`fairprune.pruning.modifiers.register_modifier`. A pruning method then ``quantize`` is what
``prune.py <method> --sparsity S --quantize Q`` builds from its flags
(:func:`fairprune.pruning.modifiers.from_flags`), with the same result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fairprune.errors import UserError
from fairprune.pruning.modifiers import Modifier, Prune, Quantize, make_modifier


def read_recipe(path: str | Path, settings: dict[str, Any] | None = None) -> list[Modifier]:
    """The modifiers of the recipe at ``path`` (``settings``: the solver's block size and damping,
    for the methods and GPTQ)."""
    import yaml

    path = Path(path)
    try:
        entries = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UserError(f"--recipe '{path}': cannot read it ({err.strerror or type(err).__name__}); give a YAML file") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(f"--recipe '{path}' is not YAML ({' '.join(str(err).split())[:120]}); give a list such as "
                        "[{sparsegpt: {sparsity: '2:4'}}, {quantize: {scheme: w4a16-gptq}}]") from None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"--recipe '{path}' holds no list of modifiers; give a list such as "
                        "[{sparsegpt: {sparsity: '2:4'}}, {quantize: {scheme: w4a16-gptq}}]")
    modifiers = []
    for number, entry in enumerate(entries, 1):
        if not isinstance(entry, dict) or len(entry) != 1:
            raise UserError(f"--recipe '{path}': entry {number} is not one modifier name with its options "
                            "(e.g. {sparsegpt: {sparsity: 0.5}})")
        (name, options), = entry.items()
        if options is not None and not isinstance(options, dict):
            raise UserError(f"--recipe '{path}': entry {number} ({name}) gives {options!r}; its options are a mapping")
        modifiers.append(make_modifier(str(name), options or {}, dict(settings or {})))
    check_recipe(modifiers, str(path))
    return modifiers


def check_recipe(modifiers: list[Modifier], where: str = "the recipe") -> None:
    """One pruning method first (the run's method and sparsity), then any other modifiers, one
    ``quantize`` at most: anything else in one line."""
    names = " then ".join(m.name for m in modifiers) or "nothing"
    if not modifiers or not isinstance(modifiers[0], Prune) or any(isinstance(m, Prune) for m in modifiers[1:]):
        raise UserError(f"{where}: a run applies one pruning method, first, then its other modifiers; got {names}")
    if sum(isinstance(m, Quantize) for m in modifiers) > 1:
        raise UserError(f"{where}: a run quantizes once; got {names}")


def recipe_of(modifiers: list[Modifier]) -> list[dict[str, Any]]:
    """The recipe as written to a run's ``config.yaml``."""
    out: list[dict[str, Any]] = []
    for m in modifiers:
        if isinstance(m, Prune):
            out.append({m.name: {"sparsity": str(m.sparsity)}})
        elif isinstance(m, Quantize):
            out.append({"quantize": {"scheme": m.scheme, "group_size": m.group_size}})
        else:
            out.append({m.name: dict(getattr(m, "options", {}))})
    return out
