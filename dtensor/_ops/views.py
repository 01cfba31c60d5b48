"""View and shape ops: t, transpose, permute, view/reshape, unsqueeze/squeeze, expand,
slice/select/split, diagonal/diag_embed, and the like, with their ``*_copy`` forms (the same
layouts, a fresh tensor) and the backward ops of the slicing views (``slice_backward``,
``select_backward``, ``diagonal_backward``: the gradient scattered into zeros of the
input's shape, each rank building its own block).

A shard survives a view when every rank's local block maps onto the same block of the
output. For ``view`` that is checked exactly: the chunk sizes of the first input dim of a
merged/split group, times the rest of the group, must equal those of the first output dim
times its rest, for every rank (``(B, T, C) -> (B*T, C)`` sharded on ``B`` works when ``B``
divides evenly, and is gathered first when it does not). Local shape arguments are
recomputed from the output's global shape and placements.
"""

from __future__ import annotations

import math

import torch

from dtensor._ops._common import OpSchema, OutputSharding, register
from dtensor.placement import Replicate, Shard, chunk_sizes, is_shard_like, local_shape_and_offset

aten = torch.ops.aten


def _per_dim(schema: OpSchema, spec, dim_map, *, gather_dims=(), extra_local=None):
    """Placements through a dim mapping ``dim_map[in_dim] -> out_dim | None``."""
    out, need = [], []
    for p in spec.placements:
        if is_shard_like(p) and (p.dim in gather_dims or dim_map.get(p.dim) is None):
            out.append(Replicate())
            need.append(Replicate())
        elif is_shard_like(p):
            out.append(Shard(dim_map[p.dim]))
            need.append(p)
        else:
            out.append(p)
            need.append(p)
    return tuple(out), tuple(need)


def _simple(schema, dim_map, gather_dims=(), n_out=1):
    spec = schema.args[0]
    out, need = _per_dim(schema, spec, dim_map, gather_dims=gather_dims)
    return OutputSharding([out] * n_out, {schema.leaf_index(spec): need})


@register(aten.t.default, aten.t_copy.default)
def t_rule(schema):
    nd = schema.args[0].ndim
    return _simple(schema, {0: 1, 1: 0} if nd == 2 else {0: 0})


@register(aten.transpose.int, aten.transpose_copy.int)
def transpose_rule(schema):
    spec, d0, d1 = schema.args[0], schema.args[1], schema.args[2]
    nd = max(spec.ndim, 1)
    d0, d1 = d0 % nd, d1 % nd
    m = {d: d for d in range(spec.ndim)}
    m[d0], m[d1] = d1, d0
    return _simple(schema, m)


@register(aten.permute.default, aten.permute_copy.default)
def permute_rule(schema):
    spec, dims = schema.args[0], schema.args[1]
    nd = max(spec.ndim, 1)
    return _simple(schema, {d % nd: i for i, d in enumerate(dims)})


@register(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze_rule(schema):
    spec, dim = schema.args[0], schema.args[1]
    dim = dim % (spec.ndim + 1)
    return _simple(schema, {d: d + (d >= dim) for d in range(spec.ndim)})


@register(
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
    aten.squeeze_copy.default,
)
def squeeze_rule(schema):
    spec = schema.args[0]
    if schema.func._overloadname == "default":
        dims = [d for d in range(spec.ndim) if spec.shape[d] == 1]
    else:
        dims = schema.args[1]
        dims = [dims] if isinstance(dims, int) else list(dims)
        # a 0-d tensor has no dims to squeeze (its dim 0 / -1 is accepted and does nothing)
        dims = [d % spec.ndim for d in dims if spec.ndim and spec.shape[d % spec.ndim] == 1]
    m = {d: d - sum(1 for s in dims if s < d) for d in range(spec.ndim) if d not in dims}
    sharding = _simple(schema, m, gather_dims=dims)
    # Squeeze locally exactly the dims of global size 1: a shard whose local size happens to
    # be 1 (7 rows over 7 ranks, the last of 7 over 3) is not squeezed on its rank alone.
    local = aten.squeeze_copy.dims if schema.name == "squeeze_copy" else aten.squeeze.dims
    sharding.local_fn = lambda x, *args, **kwargs: local(x, dims)
    return sharding


def _local_shape_fn(func, out_shape, out_placements, mesh, arg_index=1):
    local_shape, _ = local_shape_and_offset(
        out_shape, mesh.shape, mesh.get_coordinate(), out_placements
    )

    def local_fn(x, *args, **kwargs):
        args = list(args)
        args[arg_index - 1] = list(local_shape)
        if func is aten.view.default and not x.is_contiguous():
            return x.reshape(local_shape)  # the local piece of a gathered dim may be strided
        return func(x, *args, **kwargs)

    return local_fn


@register(aten.expand.default, aten.expand_copy.default)
def expand_rule(schema):
    spec = schema.args[0]
    out_shape = tuple(schema.out_meta[0].shape)
    lead = len(out_shape) - spec.ndim
    m = {d: d + lead for d in range(spec.ndim) if spec.shape[d] == out_shape[d + lead]}
    out, need = _per_dim(schema, spec, m)
    fn = _local_shape_fn(schema.func, out_shape, out, spec.mesh)
    return OutputSharding([out], {schema.leaf_index(spec): need}, fn)


def reshape_groups(in_shape, out_shape):
    """Split two shapes of equal numel into groups of dims with equal products.

    Size-1 dims form groups of their own (with no partner). Pure.

    Example:
        >>> reshape_groups((2, 3, 4), (6, 4))
        [([0, 1], [0]), ([2], [1])]
    """
    ni, no = len(in_shape), len(out_shape)
    if 0 in in_shape or 0 in out_shape:
        # No products to match: equal leading and trailing dims pair up one to one (a view
        # to the same shape keeps every shard), the dims between form one group.
        lead = 0
        while lead < min(ni, no) and in_shape[lead] == out_shape[lead]:
            lead += 1
        trail = 0
        while trail < min(ni, no) - lead and in_shape[ni - 1 - trail] == out_shape[no - 1 - trail]:
            trail += 1
        groups = [([d], [d]) for d in range(lead)]
        if lead < ni - trail or lead < no - trail:
            groups.append((list(range(lead, ni - trail)), list(range(lead, no - trail))))
        groups += [([ni - trail + j], [no - trail + j]) for j in range(trail)]
        return groups
    groups, i, o = [], 0, 0
    while i < ni or o < no:
        if i < ni and o < no and in_shape[i] == 1 and out_shape[o] == 1:
            groups.append(([i], [o]))
            i, o = i + 1, o + 1
        elif i < ni and in_shape[i] == 1:
            groups.append(([i], []))
            i += 1
        elif o < no and out_shape[o] == 1:
            groups.append(([], [o]))
            o += 1
        else:
            gi, go, pi, po = [i], [o], in_shape[i], out_shape[o]
            i, o = i + 1, o + 1
            while pi != po:
                if pi < po:
                    pi *= in_shape[i]
                    gi.append(i)
                    i += 1
                else:
                    po *= out_shape[o]
                    go.append(o)
                    o += 1
            groups.append((gi, go))
    return groups


def view_placements(in_shape, out_shape, placements, mesh_shape):
    """(out placements, needed input placements) for a view/reshape. Pure."""
    groups = reshape_groups(tuple(in_shape), tuple(out_shape))
    group_of = {d: g for g in groups for d in g[0]}
    counts = {}
    for p in placements:
        if is_shard_like(p):
            counts[p.dim] = counts.get(p.dim, 0) + 1
    out, need = [], []
    for mesh_dim, p in enumerate(placements):
        if not is_shard_like(p):
            out.append(p)
            need.append(p)
            continue
        gi, go = group_of[p.dim]
        trivial = len(gi) == 1 and len(go) == 1
        ok = bool(go) and gi[0] == p.dim and (trivial or counts[p.dim] == 1)
        if ok and not trivial:
            k = mesh_shape[mesh_dim]
            rest_in = math.prod(in_shape[d] for d in gi[1:])
            rest_out = math.prod(out_shape[d] for d in go[1:])
            ok = [c * rest_in for c in chunk_sizes(in_shape[gi[0]], k)] == [
                c * rest_out for c in chunk_sizes(out_shape[go[0]], k)
            ]
        if ok:
            out.append(Shard(go[0]))
            need.append(p)
        else:
            out.append(Replicate())
            need.append(Replicate())
    return tuple(out), tuple(need)


@register(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.view_copy.default,
    aten._reshape_copy.default,
)
def view_rule(schema):
    spec = schema.args[0]
    out_shape = tuple(schema.out_meta[0].shape)
    out, need = view_placements(tuple(spec.shape), out_shape, spec.placements, spec.mesh.shape)
    fn = _local_shape_fn(schema.func, out_shape, out, spec.mesh)
    return OutputSharding([out], {schema.leaf_index(spec): need}, fn)


def _dim_arg(schema, pos, default=0):
    spec = schema.args[0]
    d = schema.args[pos] if len(schema.args) > pos else schema.kwargs.get("dim", default)
    return d % max(spec.ndim, 1)


@register(aten.slice.Tensor, aten.slice_copy.Tensor, aten.narrow_copy.default)
def slice_rule(schema):
    spec = schema.args[0]
    dim = _dim_arg(schema, 1)
    return _simple(schema, {d: d for d in range(spec.ndim)}, gather_dims=(dim,))


@register(aten.select.int, aten.select_copy.int)
def select_rule(schema):
    spec = schema.args[0]
    dim = _dim_arg(schema, 1)
    m = {d: d - (d > dim) for d in range(spec.ndim) if d != dim}
    return _simple(schema, m, gather_dims=(dim,))


def _arg(schema, pos, name, default=None):
    """Argument ``name`` of the op, given at position ``pos`` or by keyword."""
    return schema.args[pos] if len(schema.args) > pos else schema.kwargs.get(name, default)


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_rule(schema):
    """The output holds the dims other than ``dim1``/``dim2`` in order, then the diagonal:
    shards of those dims move along; the two dims the diagonal runs through are gathered."""
    spec = schema.args[0]
    nd = max(spec.ndim, 1)
    d1, d2 = _arg(schema, 2, "dim1", 0) % nd, _arg(schema, 3, "dim2", 1) % nd
    rest = [d for d in range(spec.ndim) if d not in (d1, d2)]
    return _simple(schema, {d: i for i, d in enumerate(rest)})


@register(aten.diag_embed.default)
def diag_embed_rule(schema):
    """The inverse layout of ``diagonal``: the input's leading dims become the output's dims
    other than ``dim1``/``dim2`` (shards move along); its last dim, the diagonal, is
    gathered. The zeros off the diagonal are zeros of every partial too."""
    spec = schema.args[0]
    nd = spec.ndim + 1
    d1, d2 = _arg(schema, 2, "dim1", -2) % nd, _arg(schema, 3, "dim2", -1) % nd
    rest = [d for d in range(nd) if d not in (d1, d2)]
    return _simple(schema, dict(enumerate(rest)))


def _with_local_sizes(sharding, func, local_sizes):
    """``sharding`` whose local op gets ``input_sizes`` (the global shape of the gradient
    to build) replaced by ``local_sizes(local_grad, global_sizes)``."""

    def local_fn(g, *args, **kwargs):
        if args:
            args = (local_sizes(g, list(args[0])), *args[1:])
        else:
            kwargs = {**kwargs, "input_sizes": local_sizes(g, list(kwargs["input_sizes"]))}
        return func(g, *args, **kwargs)

    sharding.local_fn = local_fn
    return sharding


# The backward ops of slicing views scatter the gradient into zeros of the input's shape.
# A shard of the gradient on a dim the view kept whole is a shard of the result with the
# same blocks (the dims have equal global sizes), so its local sizes are the gradient's;
# the sliced dim (and the diagonal) is gathered. Zeros are zeros of every partial, so a
# ``Partial`` gradient stays partial.


@register(aten.slice_backward.default)
def slice_backward_rule(schema):
    sizes = list(_arg(schema, 1, "input_sizes"))
    nd = len(sizes)
    dim = _arg(schema, 2, "dim") % max(nd, 1)
    sharding = _simple(schema, {d: d for d in range(nd) if d != dim})

    def local_sizes(g, full):
        return [full[d] if d == dim else g.shape[d] for d in range(nd)]

    return _with_local_sizes(sharding, schema.func, local_sizes)


@register(aten.select_backward.default)
def select_backward_rule(schema):
    sizes = list(_arg(schema, 1, "input_sizes"))
    nd = len(sizes)
    dim = _arg(schema, 2, "dim") % max(nd, 1)
    sharding = _simple(schema, {d: d + (d >= dim) for d in range(nd - 1)})

    def local_sizes(g, full):
        return [*g.shape[:dim], full[dim], *g.shape[dim:]]

    return _with_local_sizes(sharding, schema.func, local_sizes)


@register(aten.diagonal_backward.default)
def diagonal_backward_rule(schema):
    sizes = list(_arg(schema, 1, "input_sizes"))
    nd = max(len(sizes), 1)
    d1, d2 = _arg(schema, 3, "dim1") % nd, _arg(schema, 4, "dim2") % nd
    rest = [d for d in range(len(sizes)) if d not in (d1, d2)]
    sharding = _simple(schema, dict(enumerate(rest)))

    def local_sizes(g, full):
        for i, d in enumerate(rest):
            full[d] = g.shape[i]
        return full

    return _with_local_sizes(sharding, schema.func, local_sizes)


@register(
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.chunk.default,
    aten.split_copy.Tensor,
    aten.split_with_sizes_copy.default,
    aten.unbind_copy.int,
    aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default,
    aten.unsafe_chunk.default,
)
def split_rule(schema):
    spec = schema.args[0]
    unbind = schema.name in ("unbind", "unbind_copy")
    dim = _dim_arg(schema, 1 if unbind else 2)
    if unbind:
        m = {d: d - (d > dim) for d in range(spec.ndim) if d != dim}
    else:
        m = {d: d for d in range(spec.ndim)}
    return _simple(schema, m, gather_dims=(dim,), n_out=len(schema.out_meta))


@register(
    aten.alias.default,
    aten.alias_copy.default,
    aten.detach.default,
    aten.detach_copy.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
)
def identity_rule(schema):
    spec = schema.args[0]
    return OutputSharding([spec.placements], {})


@register(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def view_as_complex_rule(schema):
    """``(..., 2)`` real -> ``(...)`` complex (rotary embeddings): shards of the leading dims
    carry over; the last dim, real and imaginary parts, must be whole."""
    spec = schema.args[0]
    last = spec.ndim - 1
    return _simple(schema, {d: d for d in range(last)}, gather_dims=(last,))


@register(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real_rule(schema):
    """``(...)`` complex -> ``(..., 2)`` real: every shard carries over."""
    spec = schema.args[0]
    return _simple(schema, {d: d for d in range(spec.ndim)})
