"""Reductions: sums, means, products, extrema (with and without their indices), norms,
variances, ``logsumexp``, ``trace``, ``dist``, selections along a dim (``kthvalue``,
``median``, ``mode``) and the ``_foreach_norm`` / ``_foreach_max`` of tensor lists.

A shard of a dim that is not reduced passes through (moved down by the reduced dims before
it unless ``keepdim``): each rank reduces whole slices. A shard of a reduced dim leaves each
rank with a piece of the answer, and how the pieces combine decides the rule:

- linear and idempotent combines stay lazy as a ``Partial``: ``Partial("sum")`` for sums,
  means (the local sum divided by the global count, so uneven shards weigh by their true
  sizes) and ``trace`` (each rank sums the part of the global diagonal in its block);
  ``Partial("product")`` for ``prod``; ``Partial("max"/"min")`` for ``amax``/``amin``,
  ``aminmax`` and ``_foreach_max``; ``NormPartial(p)`` for p-norms and ``dist``.
- combines that need values of other ranks run their collectives inside the op, over the
  mesh dims that shard a reduced dim, and the result comes out replicated there:
  ``var``/``std`` (``_mean``) all-reduce the sums, then the squared deviations from the
  global mean (the two-pass formula, exact for any split); ``logsumexp`` all-reduces the
  maximum of the local results, then the sum of their exponentials shifted by it;
  ``max``/``min`` with a dim and ``argmax``/``argmin`` all-gather each rank's best
  (value, global index) and pick as the kernel does: the larger (smaller) value, NaN above
  all, the smaller index on a tie.
- selections with no cheap combine (``kthvalue``, ``median``, ``mode``) gather the reduced
  dim (only on the mesh dims that shard it).

An empty local block gives the combine's identity (0 for sums and norms of p >= 0, inf for
negative p, -inf / +inf for max / min, an index past the end that never wins a tie), never
an error from a kernel that refuses empty input.
"""

from __future__ import annotations

import math

import torch

from dtensor import _collectives as _eager
from dtensor import _collectives_traced as _traced
from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    register,
    register_per_mesh_dim,
    register_replicated,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import (
    NormPartial,
    Partial,
    Replicate,
    Shard,
    is_shard_like,
    local_shape_and_offset,
)

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


def _combined_placements(spec: DTensorSpec, reduced: set[int], keepdim: bool):
    """For reductions combined by collectives inside the op: (output placements, input
    placements, the mesh dims that shard a reduced dim). Those mesh dims keep their shard
    and come out replicated; partial inputs are reduced first."""
    out, need = _reduce_placements(spec, reduced, keepdim, None, lambda p: False)
    combine = [m for m, p in enumerate(out) if p is None]
    return tuple(Replicate() if p is None else p for p in out), need, combine


def _identity(dtype: torch.dtype, kind: str):
    """The value every other beats in a ``kind`` ("max" or "min") reduction of ``dtype``."""
    if dtype == torch.bool:
        return kind == "min"
    if dtype.is_floating_point:
        return float("-inf") if kind == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def _norm_identity(p: float) -> float:
    """The p-norm of nothing, as the norm combine needs it: 0, or inf for p < 0 (whose
    combine sums ``|x|^p``, where only an infinite value adds nothing)."""
    return math.inf if p < 0 else 0.0


def _with_identity(func, identity, reduced: set[int], keepdim: bool, dtype=None):
    """Run ``func`` locally; an empty local input yields ``identity`` in the output's shape.

    The shape follows from the reduced dims, not from running ``func`` (on meta or not):
    max, min and the inf-norm have no identity, so their kernels refuse empty inputs.
    """

    def local(x, *args, **kwargs):
        if x.numel() == 0:
            shape = _reduced_shape(x.shape, reduced, keepdim)
            out_dtype = kwargs.get("dtype") or dtype or x.dtype
            return torch.full(shape, identity, dtype=out_dtype, device=x.device)
        return func(x, *args, **kwargs)

    return local


def _reduced_shape(shape, reduced: set[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if d in reduced else s for d, s in enumerate(shape)]
    return [s for d, s in enumerate(shape) if d not in reduced]


def _args(schema, names_defaults):
    """Positional-or-keyword arguments of the op, by name, after ``self``."""
    vals = list(schema.args[1:])
    out = {}
    for i, (name, default) in enumerate(names_defaults):
        out[name] = vals[i] if i < len(vals) else schema.kwargs.get(name, default)
    return out


def _collectives(t: torch.Tensor):
    """The collectives module for ``t``: graph ops while torch.compile traces, else eager."""
    return _traced if _traced.tracing(t) else _eager


def _all_reduce(t: torch.Tensor, mesh, mesh_dims, op: str) -> torch.Tensor:
    C = _collectives(t)
    for m in mesh_dims:
        t = C.all_reduce(t, mesh, m, Partial(op)).wait()
    return t


def _gather_stack(t: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
    """Every rank's ``t`` along ``mesh_dim``, stacked in rank order on a new dim 0."""
    k = mesh.size(mesh_dim)
    return _collectives(t).all_gather(t.unsqueeze(0), mesh, mesh_dim, 0, k).wait()


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


@register(aten.prod.default, aten.prod.dim_int)
def prod_rule(schema: OpSchema) -> OutputSharding:
    """A product over a sharded dim is the product of the local products: an empty block's
    is 1, as the kernel gives it. A ``Partial("product")`` input stays one."""
    spec = schema.args[0]
    if schema.func is aten.prod.default:
        a = {"dim": None, "keepdim": False}
    else:
        a = _args(schema, [("dim", None), ("keepdim", False)])
    partial = Partial("product")
    out, need = _reduce_placements(
        spec, _reduced_dims(a["dim"], spec.ndim), a["keepdim"], partial, lambda p: p == partial
    )
    return OutputSharding([out], {schema.leaf_index(spec): need})


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
    identity = _identity(spec.meta.dtype, kind)
    local_fn = _with_identity(schema.func, identity, reduced, a["keepdim"])
    return OutputSharding([out], {schema.leaf_index(spec): need}, local_fn)


@register(aten.aminmax.default)
def aminmax_rule(schema: OpSchema) -> OutputSharding:
    """``aminmax``: ``amin`` and ``amax`` at once; over a sharded dim the minimum is a
    ``Partial("min")`` and the maximum a ``Partial("max")``."""
    spec = schema.args[0]
    dim, keepdim = schema.kwargs.get("dim"), schema.kwargs.get("keepdim", False)
    reduced = _reduced_dims(dim, spec.ndim)
    low, need = _reduce_placements(spec, reduced, keepdim, Partial("min"), lambda p: False)
    high = tuple(Partial("max") if p == Partial("min") else p for p in low)
    dtype = spec.meta.dtype
    lo_id, hi_id = _identity(dtype, "min"), _identity(dtype, "max")

    def local_fn(x, *args, **kwargs):
        if x.numel() == 0:
            shape = _reduced_shape(x.shape, reduced, keepdim)
            return (
                torch.full(shape, lo_id, dtype=x.dtype, device=x.device),
                torch.full(shape, hi_id, dtype=x.dtype, device=x.device),
            )
        return schema.func(x, *args, **kwargs)

    return OutputSharding([low, high], {schema.leaf_index(spec): need}, local_fn)


# --------------------------------------------------------------------------- extrema and indices
def _pick(kind: str, v1, i1, v2, i2):
    """Elementwise, of candidates ``(v1, i1)`` and ``(v2, i2)``: the larger (``kind`` "max")
    or smaller value, NaN above every number, the smaller index between equals (and between
    NaNs): the first occurrence, as the kernels answer."""
    better = v2 > v1 if kind == "max" else v2 < v1
    same = v1 == v2
    if v1.is_floating_point():
        nan1, nan2 = torch.isnan(v1), torch.isnan(v2)
        better = (better & ~nan1) | (nan2 & ~nan1)
        same = same | (nan1 & nan2)
    take = better | (same & (i2 < i1))
    return torch.where(take, v2, v1), torch.where(take, i2, i1)


def _best_over_ranks(kind: str, v, i, mesh, mesh_dims):
    """Each rank's candidate ``(v, i)`` (global indices) replaced by the best over the
    ranks of ``mesh_dims``, one mesh dim after the other."""
    for m in mesh_dims:
        vs, idx = _gather_stack(v, mesh, m), _gather_stack(i, mesh, m)
        v, i = vs[0], idx[0]
        for r in range(1, vs.shape[0]):
            v, i = _pick(kind, v, i, vs[r], idx[r])
    return v, i


@register(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def extremum_with_index_rule(schema: OpSchema) -> OutputSharding:
    """``max``/``min`` along a dim (values and indices) and ``argmax``/``argmin``. Over a
    sharded dim each rank finds its best with the global index (its block's offset added),
    the ranks exchange those and keep the best: no rank sees more than one candidate per
    output element from each peer."""
    spec = schema.args[0]
    kind = "max" if schema.name in ("max", "argmax") else "min"
    with_values = schema.name in ("max", "min")
    a = _args(schema, [("dim", None), ("keepdim", False)])
    dim, keepdim = a["dim"], a["keepdim"]
    reduced = _reduced_dims(dim, spec.ndim)
    out, need, combine = _combined_placements(spec, reduced, keepdim)
    outs = [out, out] if with_values else [out]
    inputs = {schema.leaf_index(spec): need}
    if not combine:
        return OutputSharding(outs, inputs)
    mesh = spec.mesh
    _, offsets = local_shape_and_offset(spec.shape, mesh.shape, mesh.get_coordinate(), need)
    identity = _identity(spec.meta.dtype, kind)
    best = torch.max if kind == "max" else torch.min
    out_shape = list(schema.out_meta[-1].shape)

    if dim is None:  # argmax / argmin of the flattened tensor: a flat global index
        strides = [math.prod(spec.shape[d + 1 :]) for d in range(spec.ndim)]
        past_end = math.prod(spec.shape)

        def candidate(x):
            if x.numel() == 0:
                v = torch.full((), identity, dtype=x.dtype, device=x.device)
                return v, torch.full((), past_end, dtype=torch.long, device=x.device)
            v, flat = best(x.reshape(-1), 0)
            coords = torch.unravel_index(flat, x.shape)
            i = sum((c + o) * s for c, o, s in zip(coords, offsets, strides))
            return v, i

    else:
        d = dim % max(spec.ndim, 1)
        past_end = spec.shape[d]

        def candidate(x):
            if x.size(d) == 0:
                shape = _reduced_shape(x.shape, {d}, True)
                v = torch.full(shape, identity, dtype=x.dtype, device=x.device)
                return v, torch.full(shape, past_end, dtype=torch.long, device=x.device)
            v, i = best(x, d, keepdim=True)
            return v, i + offsets[d]

    def local_fn(x, *args, **kwargs):
        v, i = _best_over_ranks(kind, *candidate(x), mesh, combine)
        shape = out_shape if dim is None else _reduced_shape(v.shape, {d}, keepdim)
        v, i = v.reshape(shape), i.reshape(shape)
        return (v, i) if with_values else i

    return OutputSharding(outs, inputs, local_fn)


# --------------------------------------------------------------------------- variance, logsumexp
@register(
    aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction
)
def var_std_rule(schema: OpSchema) -> OutputSharding:
    """Variance and standard deviation (and with the mean). Over a sharded dim: the global
    mean from all-reduced sums and the true count, then the all-reduced sum of squared
    deviations from it, divided by ``max(count - correction, 0)`` as the kernel does."""
    spec = schema.args[0]
    dim = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim")
    correction = schema.kwargs.get("correction")
    correction = 1 if correction is None else correction
    keepdim = schema.kwargs.get("keepdim", False)
    reduced = _reduced_dims(dim, spec.ndim)
    out, need, combine = _combined_placements(spec, reduced, keepdim)
    with_mean = schema.name.endswith("_mean")
    outs = [out, out] if with_mean else [out]
    inputs = {schema.leaf_index(spec): need}
    if not combine:
        return OutputSharding(outs, inputs)
    mesh = spec.mesh
    dims = sorted(reduced)
    count = math.prod(spec.shape[d] for d in dims)
    divisor = max(count - correction, 0)
    is_std = schema.name.startswith("std")
    out_dtypes = [m.dtype for m in schema.out_meta]

    def local_fn(x, *args, **kwargs):
        # half precision accumulates in float32, as the kernels do
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        total = _all_reduce(work.sum(dims, keepdim=True), mesh, combine, "sum")
        mean = total / count
        dev = work - mean
        sq = (dev * dev.conj()).real if dev.is_complex() else dev * dev
        var = _all_reduce(sq.sum(dims, keepdim=True), mesh, combine, "sum") / divisor
        res = var.sqrt() if is_std else var
        if not keepdim:
            res, mean = res.squeeze(dims), mean.squeeze(dims)
        res = res.to(out_dtypes[0])
        return (res, mean.to(out_dtypes[1])) if with_mean else res

    return OutputSharding(outs, inputs, local_fn)


@register(aten.logsumexp.default)
def logsumexp_rule(schema: OpSchema) -> OutputSharding:
    """``logsumexp`` over a sharded dim: each rank's local result, shifted by their
    all-reduced maximum (0 where that is infinite, so -inf and inf come out as the kernel
    gives them), exponentiated, all-reduced, and back."""
    spec = schema.args[0]
    a = _args(schema, [("dim", None), ("keepdim", False)])
    reduced = _reduced_dims(a["dim"], spec.ndim)
    keepdim = a["keepdim"]
    out, need, combine = _combined_placements(spec, reduced, keepdim)
    inputs = {schema.leaf_index(spec): need}
    if not combine:
        return OutputSharding([out], inputs)
    mesh = spec.mesh
    dims = sorted(reduced)

    def local_fn(x, *args, **kwargs):
        mine = torch.logsumexp(x, dims, keepdim=True)
        top = _all_reduce(mine, mesh, combine, "max")
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        total = _all_reduce(torch.exp(mine - shift), mesh, combine, "sum")
        res = torch.log(total) + shift
        return res if keepdim else res.squeeze(dims)

    return OutputSharding([out], inputs, local_fn)


# --------------------------------------------------------------------------- trace, dist
@register(aten.trace.default)
def trace_rule(schema: OpSchema) -> OutputSharding:
    """``trace`` of a matrix sharded on either dim or both: the global diagonal crosses a
    block at the offset ``row start - column start``; each rank sums its part of it and the
    result is a ``Partial("sum")``. Linear partial inputs stay partial."""
    spec = schema.args[0]
    out, need = [], []
    for p in spec.placements:
        if is_shard_like(p):
            out.append(Partial("sum"))
            need.append(p)
        elif isinstance(p, Partial) and p.is_linear:
            out.append(p)
            need.append(p)
        else:
            out.append(Replicate())
            need.append(Replicate())
    mesh = spec.mesh
    _, (row, col) = local_shape_and_offset(spec.shape, mesh.shape, mesh.get_coordinate(), need)
    local_fn = None
    if row != col:

        def local_fn(x, *args, **kwargs):
            return torch.diagonal(x, row - col).sum()

    return OutputSharding([tuple(out)], {schema.leaf_index(spec): tuple(need)}, local_fn)


def _dist_options(schema: OpSchema) -> list[Option]:
    a, b = schema.args[0], schema.args[1]
    p = float(schema.args[2] if len(schema.args) > 2 else schema.kwargs.get("p", 2))
    shape = torch.broadcast_shapes(a.shape, b.shape)
    options = []
    for d in range(len(shape)):
        ins = []
        for s in (a, b):
            td = d - (len(shape) - s.ndim)
            ins.append(Shard(td) if td >= 0 and s.shape[td] == shape[d] else Replicate())
        options.append(Option((NormPartial(p),), tuple(ins)))
    return options


@register(aten.dist.default)
def dist_rule(schema: OpSchema) -> OutputSharding:
    """``dist(a, b, p)``, the p-norm of ``a - b``: inputs sharded alike on a dim of the
    broadcast difference (an input broadcast along it is replicated) give each rank the norm
    of its block, a ``NormPartial(p)``; an empty block's is the norm identity."""
    sharding = expand_per_mesh_dim(schema, _dist_options(schema))
    p = float(schema.args[2] if len(schema.args) > 2 else schema.kwargs.get("p", 2))
    identity, dtype = _norm_identity(p), schema.out_meta[0].dtype

    def local_fn(a, b, *args, **kwargs):
        if torch.broadcast_shapes(a.shape, b.shape).numel() == 0:
            return torch.full((), identity, dtype=dtype, device=a.device)
        return aten.dist.default(a, b, *args, **kwargs)

    sharding.local_fn = local_fn
    return sharding


# --------------------------------------------------------------------------- norms
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
    local_fn = _with_identity(
        schema.func, _norm_identity(p), reduced, a["keepdim"], a["dtype"] or real
    )
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
    # ``dtype`` arrives positionally or by name: the outputs' metas have it either way
    dtypes = [m.dtype for m in schema.out_meta]
    identity = _norm_identity(p)

    def local_fn(tensors, *args, **kwargs):
        # an empty block's norm is the identity of the combine, in the output's dtype (every
        # rank must send the same bytes)
        nonempty = [t for t in tensors if t.numel()]
        norms = iter(torch._foreach_norm(nonempty, *args, **kwargs) if nonempty else ())
        return [
            next(norms) if t.numel() else torch.full((), identity, dtype=dt, device=t.device)
            for t, dt in zip(tensors, dtypes, strict=True)
        ]

    return OutputSharding(outs, inputs, local_fn, output_meshes=meshes)


@register(aten._foreach_max.default)
def foreach_max_rule(schema: OpSchema) -> OutputSharding:
    """The maximum of each tensor of a list: a ``Partial("max")`` where it is sharded (each
    position on its own mesh); an empty block gives the dtype's lowest value."""
    tensors = schema.args[0]
    partial = Partial("max")
    outs, inputs, meshes, identities = [], {}, [], []
    for spec in tensors:
        out, need = _reduce_placements(
            spec, set(range(spec.ndim)), False, partial, lambda q: q == partial
        )
        outs.append(out)
        meshes.append(spec.mesh)
        inputs[schema.leaf_index(spec)] = need
        identities.append(_identity(spec.meta.dtype, "max"))

    def local_fn(tensors, *args, **kwargs):
        nonempty = [t for t in tensors if t.numel()]
        maxima = iter(torch._foreach_max(nonempty) if nonempty else ())
        return [
            next(maxima) if t.numel() else torch.full((), ident, dtype=t.dtype, device=t.device)
            for t, ident in zip(tensors, identities, strict=True)
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


# --------------------------------------------------------------------------- selections
@register_per_mesh_dim(
    aten.kthvalue.default, aten.mode.default, aten.median.dim, aten.nanmedian.dim
)
def selection_options(schema: OpSchema) -> list[Option]:
    """The k-th smallest value, the median and the mode along ``dim``, with their indices:
    no cheap combine over a sharded ``dim``, so only the other dims keep their shards."""
    x = schema.args[0]
    if schema.name == "kthvalue":
        a = _args(schema, [("k", None), ("dim", -1), ("keepdim", False)])
    else:
        a = _args(schema, [("dim", -1), ("keepdim", False)])
    dim, keepdim = a["dim"] % max(x.ndim, 1), a["keepdim"]
    options = []
    for d in range(x.ndim):
        if d != dim:
            out = Shard(d if keepdim or d < dim else d - 1)
            options.append(Option((out, out), (Shard(d),)))
    return options


# the median of the whole tensor: no cheap combine either
register_replicated(aten.median.default, aten.nanmedian.default)
