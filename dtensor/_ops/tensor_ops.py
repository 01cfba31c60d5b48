"""Structural ops on whole tensors: stack and cat, ``new_*`` factories, and ops that need
the whole tensor (QR).

Stacking and concatenating act elementwise on every input, so any ``Partial`` shared by all
inputs survives; a shard survives unless it lies on the concatenated dim. Stacking also keeps
a ``Partial`` that some inputs have and the others are replicated for (they become that
partial locally). ``x.new_empty(size)``
and its siblings follow ``x``'s placements when ``size`` is ``x``'s shape (a like-shaped
buffer stays sharded) and are replicated otherwise.
"""

from __future__ import annotations

import torch

from dtensor import _torch_dcp
from dtensor._ops._common import OpSchema, OutputSharding, register, replicate_all, with_dim
from dtensor.placement import Partial, Replicate, is_shard_like, local_shape_and_offset

aten = torch.ops.aten


def _common(specs, cat_dim: int | None, *, keep_partial: bool = False):
    """Per mesh dim: the first input's placement if all can take it, else Replicate.

    With ``keep_partial``, a ``Partial`` that every input either has or is replicated for is
    the target: replicated inputs become that partial locally, so no input needs a
    collective, and one reduction of the result replaces one per partial input."""
    target = []
    for i in range(specs[0].mesh.ndim):
        ps = [s.placements[i] for s in specs]
        partials = {x for x in ps if isinstance(x, Partial)}
        if keep_partial and len(partials) == 1:
            if all(isinstance(x, (Partial, Replicate)) for x in ps):
                target.append(partials.pop())
                continue
        p = ps[0]
        if is_shard_like(p) and cat_dim is not None and p.dim == cat_dim:
            p = Replicate()
        if isinstance(p, Partial) and any(x != p for x in ps):
            p = Replicate()
        target.append(p)
    return tuple(target)


@register(aten.stack.default)
def stack_rule(schema: OpSchema) -> OutputSharding:
    specs = list(schema.args[0])
    ndim = specs[0].ndim + 1
    dim = (schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", 0)) % ndim
    # stacking per-tensor partial results (clip_grad_norm_'s per-gradient norms) keeps them
    # partial: one reduction of the stack later instead of one per tensor now
    need = _common(specs, None, keep_partial=True)
    out = tuple(with_dim(p, p.dim + (p.dim >= dim)) if is_shard_like(p) else p for p in need)
    return OutputSharding([out], {schema.leaf_index(s): need for s in specs})


@register(aten.cat.default)
def cat_rule(schema: OpSchema) -> OutputSharding:
    specs = list(schema.args[0])
    ndim = max(s.ndim for s in specs)
    dim = (schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", 0)) % ndim
    need = _common(specs, dim)
    return OutputSharding([need], {schema.leaf_index(s): need for s in specs})


@register(
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)
def new_factory_rule(schema: OpSchema) -> OutputSharding:
    spec = schema.args[0]
    size = tuple(schema.args[1])
    same = size == tuple(spec.shape) and not any(isinstance(p, Partial) for p in spec.placements)
    out = spec.placements if same else (Replicate(),) * spec.mesh.ndim
    mesh = spec.mesh
    local_size, _ = local_shape_and_offset(size, mesh.shape, mesh.get_coordinate(), out)
    func = schema.func

    def local_fn(x, size, *args, **kwargs):
        if func is aten.new_empty_strided.default:
            args = (_contiguous_stride(local_size), *args[1:])
        return func(x, list(local_size), *args, **kwargs)

    return OutputSharding([out], {}, local_fn)


def _contiguous_stride(shape) -> list[int]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return list(reversed(stride))


@register(aten.linalg_qr.default)
def whole_tensor_rule(schema: OpSchema) -> OutputSharding:
    """Factorizations need the whole matrix: gather, factor, replicated results."""
    return replicate_all(schema)


@register(aten.is_pinned.default)
def local_memory_rule(schema: OpSchema) -> OutputSharding:
    """``is_pinned``: a property of where this rank's piece lives, not of the values, so
    each rank answers for its local tensor whatever the placements (PyTorch's checkpoint
    code asks it of every tensor it saves)."""
    return OutputSharding([None])


# PyTorch's checkpoint code takes our DTensors once dtensor is imported (its state-dict
# helpers, torch.load(weights_only=True)); installed here, below dtensor.tensor, which it
# builds on: see dtensor/_torch_dcp.py.
_torch_dcp.install()
