"""Reductions: sum, mean, amax/amin, max/min, vector norms and ``_foreach_norm``.

Reducing over a sharded tensor dim leaves each rank with a partial result: ``Partial("sum")``
for sums and means (a mean over a sharded dim is computed as a local sum divided by the
global count, so uneven shards weigh correctly), ``Partial("max"/"min")`` for amax/amin, and
``NormPartial(p)`` for p-norms. Empty local shards produce the reduction's identity.
"""

from __future__ import annotations

import math

import torch

from dtensor._ops._common import OpSchema, OutputSharding, register
from dtensor._spec import DTensorSpec
from dtensor.placement import NormPartial, Partial, Replicate, Shard, is_shard_like

aten = torch.ops.aten


def _reduced_dims(dims, ndim: int) -> set[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return {d % max(ndim, 1) for d in dims}


def _reduce_placements(
    spec: DTensorSpec, reduced: set[int], keepdim: bool, partial_for_shard, partial_ok
):
    """Output placements and needed input placements for a reduction over ``reduced``."""
    out, need = [], []
    for p in spec.placements:
        if is_shard_like(p):
            if p.dim in reduced:
                out.append(partial_for_shard)
            else:
                shift = 0 if keepdim else sum(1 for d in reduced if d < p.dim)
                out.append(Shard(p.dim - shift))
            need.append(p)
        elif isinstance(p, Partial):
            if partial_ok(p):
                out.append(p)
                need.append(p)
            else:
                out.append(Replicate())
                need.append(Replicate())
        else:
            out.append(Replicate())
            need.append(Replicate())
    return tuple(out), tuple(need)


def _with_identity(func, identity, reduced: set[int], keepdim: bool, dtype=None):
    """Run ``func`` locally; an empty local input yields ``identity`` in the output's shape.

    The shape follows from the reduced dims, not from running ``func`` (on meta or not):
    max, min and the inf-norm have no identity, so their kernels refuse empty inputs.
    """

    def local(x, *args, **kwargs):
        if x.numel() == 0:
            shape = [1 if d in reduced else s for d, s in enumerate(x.shape)]
            if not keepdim:
                shape = [s for d, s in enumerate(shape) if d not in reduced]
            out_dtype = kwargs.get("dtype") or dtype or x.dtype
            return torch.full(shape, identity, dtype=out_dtype, device=x.device)
        return func(x, *args, **kwargs)

    return local


def _args(schema, names_defaults):
    """Positional-or-keyword arguments of the op, by name, after ``self``."""
    vals = list(schema.args[1:])
    out = {}
    for i, (name, default) in enumerate(names_defaults):
        out[name] = vals[i] if i < len(vals) else schema.kwargs.get(name, default)
    return out


@register(aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim)
def sum_mean_rule(schema: OpSchema) -> OutputSharding:
    spec = schema.args[0]
    is_mean = schema.name == "mean"
    if schema.func in (aten.sum.default, aten.mean.default):
        a = {"dim": None, "keepdim": False, "dtype": schema.kwargs.get("dtype")}
    else:
        a = _args(schema, [("dim", None), ("keepdim", False), ("dtype", None)])
    reduced = _reduced_dims(a["dim"], spec.ndim)
    out, need = _reduce_placements(
        spec, reduced, a["keepdim"], Partial("sum"), lambda p: p.is_linear
    )
    local_fn = None
    sharded_reduced = any(is_shard_like(p) and p.dim in reduced for p in need)
    if is_mean and sharded_reduced:
        count = math.prod(spec.shape[d] for d in reduced)
        dims = sorted(reduced)
        keepdim, dtype = a["keepdim"], a["dtype"]

        def local_fn(x, *args, **kwargs):
            return torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype) / count

    return OutputSharding([out], {schema.leaf_index(spec): need}, local_fn)


@register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def max_min_rule(schema: OpSchema) -> OutputSharding:
    spec = schema.args[0]
    kind = "max" if schema.name in ("amax", "max") else "min"
    if schema.func in (aten.max.default, aten.min.default):
        a = {"dim": None, "keepdim": False}
    else:
        a = _args(schema, [("dim", []), ("keepdim", False)])
    reduced = _reduced_dims(a["dim"], spec.ndim)
    partial = Partial(kind)
    out, need = _reduce_placements(spec, reduced, a["keepdim"], partial, lambda p: p == partial)
    identity = float("-inf") if kind == "max" else float("inf")
    if not spec.meta.dtype.is_floating_point:
        info = torch.iinfo(spec.meta.dtype)
        identity = info.min if kind == "max" else info.max
    local_fn = _with_identity(schema.func, identity, reduced, a["keepdim"])
    return OutputSharding([out], {schema.leaf_index(spec): need}, local_fn)


@register(aten.linalg_vector_norm.default)
def vector_norm_rule(schema: OpSchema) -> OutputSharding:
    spec = schema.args[0]
    a = _args(schema, [("ord", 2), ("dim", None), ("keepdim", False), ("dtype", None)])
    p = float(a["ord"])
    reduced = _reduced_dims(a["dim"], spec.ndim)
    partial = NormPartial(p)
    # A 0-d partial norm is its own norm's absolute value, whatever p: it stays partial.
    # Any other partial input is reduced first, so the norm of stacked partial norms (the
    # total that clip_grad_norm_ returns) comes out replicated, as PyTorch's does, after one
    # reduction of the whole stack; a rank can then read it alone (``.item()``).
    out, need = _reduce_placements(
        spec,
        reduced,
        a["keepdim"],
        partial,
        lambda q: isinstance(q, NormPartial) and spec.ndim == 0,
    )
    real = spec.meta.dtype.to_real() if spec.meta.dtype.is_complex else spec.meta.dtype
    local_fn = _with_identity(schema.func, 0.0, reduced, a["keepdim"], a["dtype"] or real)
    return OutputSharding([out], {schema.leaf_index(spec): need}, local_fn)


@register(aten._foreach_norm.Scalar)
def foreach_norm_rule(schema: OpSchema) -> OutputSharding:
    tensors = schema.args[0]
    p = float(schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("ord", 2))
    outs, inputs, meshes = [], {}, []
    for spec in tensors:
        reduced = set(range(spec.ndim))
        partial = NormPartial(p)
        out, need = _reduce_placements(
            spec, reduced, False, partial, lambda q: isinstance(q, NormPartial) and q.norm_type == p
        )
        outs.append(out)
        meshes.append(spec.mesh)
        inputs[schema.leaf_index(spec)] = need

    def local_fn(tensors, *args, **kwargs):
        # empty shards have norm 0 (the identity of every p-norm combination)
        nonempty = [t for t in tensors if t.numel()]
        norms = iter(torch._foreach_norm(nonempty, *args, **kwargs)) if nonempty else iter(())
        dtype = kwargs.get("dtype")
        return [
            next(norms) if t.numel() else t.new_zeros((), dtype=dtype or t.dtype) for t in tensors
        ]

    return OutputSharding(outs, inputs, local_fn, output_meshes=meshes)


@register(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim)
def any_all_rule(schema: OpSchema) -> OutputSharding:
    """``any`` over a sharded dim is the max of the local answers, ``all`` the min."""
    spec = schema.args[0]
    is_any = schema.name == "any"
    if schema.func in (aten.any.default, aten.all.default):
        a = {"dim": None, "keepdim": False}
    else:
        a = _args(schema, [("dim", None), ("keepdim", False)])
    reduced = _reduced_dims(a["dim"], spec.ndim)
    partial = Partial("max" if is_any else "min")
    out, need = _reduce_placements(spec, reduced, a["keepdim"], partial, lambda p: p == partial)
    local_fn = _with_identity(schema.func, not is_any, reduced, a["keepdim"], torch.bool)
    return OutputSharding([out], {schema.leaf_index(spec): need}, local_fn)
