"""Structural ops on whole tensors: stack and cat.

Stacking and concatenating act elementwise on every input, so any ``Partial`` shared by all
inputs survives; a shard survives unless it lies on the concatenated dim.
"""

from __future__ import annotations

import torch

from dtensor._ops._common import OpSchema, OutputSharding, register
from dtensor.placement import Partial, Replicate, Shard

aten = torch.ops.aten


def _common(specs, cat_dim: int | None):
    """Per mesh dim: the first input's placement if all can take it, else Replicate."""
    mesh_ndim = specs[0].mesh.ndim
    target = []
    for i in range(mesh_ndim):
        p = specs[0].placements[i]
        if isinstance(p, Shard) and cat_dim is not None and p.dim == cat_dim:
            p = Replicate()
        if isinstance(p, Partial) and any(s.placements[i] != p for s in specs):
            p = Replicate()
        target.append(p)
    return tuple(target)


@register(aten.stack.default)
def stack_rule(schema: OpSchema) -> OutputSharding:
    specs = list(schema.args[0])
    ndim = specs[0].ndim + 1
    dim = (schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", 0)) % ndim
    need = _common(specs, None)
    out = tuple(Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in need)
    return OutputSharding([out], {schema.leaf_index(s): need for s in specs})


@register(aten.cat.default)
def cat_rule(schema: OpSchema) -> OutputSharding:
    specs = list(schema.args[0])
    ndim = max(s.ndim for s in specs)
    dim = (schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", 0)) % ndim
    need = _common(specs, dim)
    return OutputSharding([need], {schema.leaf_index(s): need for s in specs})
