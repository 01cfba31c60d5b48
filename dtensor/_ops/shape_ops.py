"""Ops that move or fill elements without computing on them: constant padding, flip, roll,
rot90, repeat (``tile``), tril/triu, pixel shuffle/unshuffle and channel shuffle.

Each of them acts on some dims of the input ("touched" dims) and copies every other dim
through unchanged, index for index. A shard of an untouched dim is therefore a shard of
the output with the very same blocks, uneven or empty ones included, and the op can run on
the local block as it is. A touched dim is gathered first: a local flip or roll of one block
is not the block of the flipped or rolled tensor (flipping reverses the order of the
blocks), a block of a padded or repeated dim is not a block of the result, and the
shuffles interleave elements of different blocks.

tril/triu keep every shard, even on the two matrix dims: whether an element is kept
depends only on its global (row, column), so each rank zeroes its block with the diagonal
shifted by the block's row offset minus its column offset.

A ``Partial`` input stays partial when the op is the same on each rank's partial value and
on their reduction: moving elements commutes with every reduction, and so do fills with
zero (a zero on every rank reduces to zero for sum, avg, max, min and product). Padding with
another value does not (a sum would add it once per rank), so such a partial is reduced
first.
"""

from __future__ import annotations

import torch

from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    register,
    register_per_mesh_dim,
)
from dtensor.placement import Partial, Shard, is_shard_like, local_shape_and_offset

aten = torch.ops.aten


def _arg(schema: OpSchema, pos: int, name: str, default=None):
    """Argument ``name`` of the op, given at position ``pos`` or by keyword."""
    return schema.args[pos] if len(schema.args) > pos else schema.kwargs.get(name, default)


def _as_list(x) -> list:
    return [x] if isinstance(x, int) else list(x)


def _options(schema: OpSchema, dim_map: dict, *, partial_ok: bool = True) -> list:
    """One-mesh-dim options of an op on one tensor: a shard of input dim ``i`` in
    ``dim_map`` becomes a shard of output dim ``dim_map[i]``; with ``partial_ok``, each
    partial the input has passes through. Dims not in ``dim_map`` are gathered (the
    all-replicated option is always there)."""
    spec = schema.args[0]
    opts = [Option((Shard(o),), (Shard(i),)) for i, o in dim_map.items()]
    if partial_ok:
        seen = []
        for p in spec.placements:
            if isinstance(p, Partial) and p not in seen:
                seen.append(p)
                opts.append(Option((p,), (p,)))
    return opts


def _untouched(ndim: int, touched) -> dict:
    return {d: d for d in range(ndim) if d not in touched}


@register_per_mesh_dim(aten.constant_pad_nd.default)
def constant_pad_options(schema: OpSchema) -> list:
    """``pad`` lists (before, after) pairs from the last dim backwards; a dim whose pair is
    (0, 0) is untouched. Negative pads crop, which touches the dim as well."""
    x = schema.args[0]
    pad = list(_arg(schema, 1, "pad"))
    value = _arg(schema, 2, "value", 0)
    touched = {
        x.ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] != 0 or pad[2 * i + 1] != 0
    }
    zero_fill = value is None or value == 0
    return _options(schema, _untouched(x.ndim, touched), partial_ok=zero_fill)


@register_per_mesh_dim(aten.flip.default)
def flip_options(schema: OpSchema) -> list:
    """Flipped dims are gathered (a dim of size 0 or 1 flips to itself)."""
    x = schema.args[0]
    nd = max(x.ndim, 1)
    touched = {d % nd for d in _as_list(_arg(schema, 1, "dims")) if x.shape[d % nd] > 1}
    return _options(schema, _untouched(x.ndim, touched))


@register_per_mesh_dim(aten.roll.default)
def roll_options(schema: OpSchema) -> list:
    """Rolled dims are gathered (a roll by a multiple of the size moves nothing). Without
    ``dims`` the roll runs over the flattened tensor: every dim is touched."""
    x = schema.args[0]
    shifts = _as_list(_arg(schema, 1, "shifts"))
    dims = _as_list(_arg(schema, 2, "dims", []))
    if not dims:
        return _options(schema, {})
    nd = max(x.ndim, 1)
    touched = {
        d % nd for d, s in zip(dims, shifts) if x.shape[d % nd] > 0 and s % x.shape[d % nd] != 0
    }
    return _options(schema, _untouched(x.ndim, touched))


@register_per_mesh_dim(aten.rot90.default)
def rot90_options(schema: OpSchema) -> list:
    """``rot90(x, k, (a, b))`` is, for ``k % 4``: 0 a copy; 2 a flip of ``a`` and ``b``;
    1 a flip of ``b`` then ``a`` and ``b`` swapped, so a shard of ``a`` (never flipped)
    becomes a shard of ``b``; 3 a flip of ``a`` then the swap, a shard of ``b`` becoming
    one of ``a``. Other dims are untouched."""
    x = schema.args[0]
    k = _arg(schema, 1, "k", 1) % 4
    nd = max(x.ndim, 1)
    a, b = (d % nd for d in _as_list(_arg(schema, 2, "dims", [0, 1])))
    dim_map = _untouched(x.ndim, (a, b))
    if k == 0:
        dim_map.update({a: a, b: b})
    elif k == 1:
        dim_map[a] = b
    elif k == 3:
        dim_map[b] = a
    return _options(schema, dim_map)


@register_per_mesh_dim(aten.repeat.default)
def repeat_options(schema: OpSchema) -> list:
    """Input dim ``d`` is output dim ``d + lead`` (``repeats`` may add leading dims); a dim
    repeated once is untouched, a dim repeated more is gathered (its copies follow each
    other, so the output's blocks are not the input's)."""
    x = schema.args[0]
    repeats = list(_arg(schema, 1, "repeats"))
    lead = len(repeats) - x.ndim
    dim_map = {d: d + lead for d in range(x.ndim) if repeats[d + lead] == 1}
    return _options(schema, dim_map)


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def pixel_shuffle_rule(schema: OpSchema) -> OutputSharding:
    """``(*, C, H, W)``: channels and the two spatial dims are interleaved; the batch dims
    before them are untouched. An empty local block (a batch dim with fewer entries than
    ranks) gets its output shape from the meta kernel: the CPU kernel of
    ``pixel_unshuffle`` returns an empty input's shape unchanged."""
    x = schema.args[0]
    sharding = expand_per_mesh_dim(schema, _options(schema, {d: d for d in range(x.ndim - 3)}))
    func = schema.func

    def local_fn(t, *args, **kwargs):
        if t.numel() == 0:
            return t.new_empty(func(t.to("meta"), *args, **kwargs).shape)
        return func(t, *args, **kwargs)

    sharding.local_fn = local_fn
    return sharding


@register_per_mesh_dim(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def channel_shuffle_options(schema: OpSchema) -> list:
    """``(N, C, *)``: only the channel dim is permuted."""
    x = schema.args[0]
    return _options(schema, _untouched(x.ndim, (1,)))


@register(aten.tril.default, aten.triu.default)
def triangle_rule(schema: OpSchema) -> OutputSharding:
    """Every shard is kept (see the module docstring); on a block at global offsets
    ``(r0, c0)`` of the matrix dims, the kept elements are those of the local triangle with
    diagonal ``diagonal + r0 - c0``."""
    x = schema.args[0]
    diagonal = _arg(schema, 1, "diagonal", 0)
    sharding = expand_per_mesh_dim(schema, _options(schema, _untouched(x.ndim, ())))
    out = sharding.output_placements[0]
    if any(is_shard_like(p) and p.dim >= x.ndim - 2 for p in out):
        mesh = x.mesh
        _, offset = local_shape_and_offset(x.shape, mesh.shape, mesh.get_coordinate(), out)
        local_diagonal = diagonal + offset[-2] - offset[-1]
        func = schema.func
        sharding.local_fn = lambda t, *args, **kwargs: func(t, local_diagonal)
    return sharding
