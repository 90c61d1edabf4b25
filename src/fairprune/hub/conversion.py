"""transformers' own checkpoint conversion, applied to parts of a model.

transformers 5 renames and fuses checkpoint tensors when it loads a model and undoes it when it
saves one: Mixtral's files hold ``block_sparse_moe.experts.<e>.w1.weight`` (one 2-D tensor per
expert), its module the fused 3-D ``mlp.experts.gate_up_proj``; GPT-NeoX's file holds ``embed_out``,
its module ``lm_head``. A streamed model reads and writes one block at a time, so it applies the
same conversion to one block's tensors: :func:`to_model` (checkpoint → module, the transforms
``from_pretrained`` applies) and :func:`to_checkpoint` (module → checkpoint,
``revert_weight_conversion``, what ``save_pretrained`` applies), and :func:`checkpoint_names`
(the checkpoint names of module parameters, found by the reverse conversion on meta tensors).
The transforms are the library's (``get_model_conversion_mapping``), never a copy of its tables.
"""

from __future__ import annotations

from copy import deepcopy

import torch


def _transforms(model) -> tuple[list, list]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    # A model built from its config, as revert_weight_conversion treats it: no prefix changes (the
    # reader adds or drops the base-model prefix itself).
    found = [t for t in get_model_conversion_mapping(model) if not isinstance(t, PrefixChange)]
    return ([t for t in found if isinstance(t, WeightRenaming)], [t for t in found if isinstance(t, WeightConverter)])


def to_model(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (all the sources of each conversion they take part in: one block's)
    as the model's parameters, by module name, converted as ``from_pretrained`` converts them."""
    from transformers.core_model_loading import WeightRenaming, dot_natural_key, rename_source_key

    renamings, converters = _transforms(model)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    pending: dict[str, object] = {}
    for key, tensor in sorted(tensors.items(), key=lambda item: dot_natural_key(item[0])):
        renamed, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None:
            transform = pending.setdefault(renamed, deepcopy(by_pattern[pattern]))
        else:
            transform, pattern = pending.setdefault(renamed, WeightRenaming(key, renamed)), key
        transform.add_tensor(renamed, key, pattern, tensor)
    out = {}
    for first, transform in pending.items():
        for name, value in transform.convert(first, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def to_checkpoint(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module tensors (one block's, or any set holding whole conversions) under the names and in
    the layout ``save_pretrained`` writes."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers writes module names as they are
        return tensors
    return revert_weight_conversion(model, tensors)


def checkpoint_names(model, shapes: dict[str, torch.Size]) -> dict[str, list[str]]:
    """For each module parameter name, the checkpoint names ``save_pretrained`` writes it under
    (the reverse conversion run on a meta tensor of its shape; the name itself where none applies)."""
    out = {}
    for name, shape in shapes.items():
        try:
            written = to_checkpoint(model, {name: torch.empty(shape, device="meta")})
            out[name] = list(written) or [name]
        except Exception:  # noqa: BLE001 - a conversion that needs its siblings: the name as it is
            out[name] = [name]
    return out
