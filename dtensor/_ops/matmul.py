"""Matrix products: mm, addmm, bmm (``linear`` and ``matmul`` decompose into these).

Per mesh dim, with ``a`` of shape (.., m, k) and ``b`` of shape (.., k, n):

    a        b        out                 a        b        out
    S(m)     R        S(m)                R        S(n)     S(n)
    S(k)     S(k)     P(sum)              R        R        R
    P        R        P                   R        P        P
    S(batch) S(batch) S(batch)            (anything else: the cheapest of these is requested)
"""

from __future__ import annotations

import torch

from dtensor._ops._common import OpSchema, OutputSharding, map_to, register
from dtensor.placement import Partial, Replicate, Shard, is_shard_like

aten = torch.ops.aten


def _mm_placement(pa, pb, batch: int):
    """(out, need_a, need_b) on one mesh dim; ``batch`` = number of leading batch dims."""
    m, k_a, k_b, n = batch, batch + 1, batch, batch + 1
    valid = {
        (Shard(m), Replicate()): Shard(m),
        (Replicate(), Shard(n)): Shard(n + 0),
        (Shard(k_a), Shard(k_b)): Partial(),
        (Replicate(), Replicate()): Replicate(),
    }
    for d in range(batch):
        valid[(Shard(d), Shard(d))] = Shard(d)
    if (pa, pb) in valid:
        return valid[(pa, pb)], pa, pb
    if isinstance(pa, Partial) and pa.is_linear and isinstance(pb, Replicate):
        return pa, pa, pb
    if isinstance(pb, Partial) and pb.is_linear and isinstance(pa, Replicate):
        return pb, pa, pb
    # not directly valid: keep the side that is already sharded, move the other
    if is_shard_like(pa):
        if pa.dim == m:
            return Shard(m), pa, Replicate()
        if pa.dim == k_a:
            return Partial(), pa, Shard(k_b)
        return Shard(pa.dim), pa, Shard(pa.dim)  # a batch dim
    if is_shard_like(pb):
        if pb.dim == n:
            return Shard(n), Replicate(), pb
        if pb.dim == k_b:
            return Partial(), Shard(k_a), pb
        return Shard(pb.dim), Shard(pb.dim), pb
    if isinstance(pa, Partial) and pa.is_linear:
        return pa, pa, Replicate()
    return Replicate(), Replicate(), Replicate()


def _mm_like(schema: OpSchema, a, b, batch: int):
    outs, need_a, need_b = [], [], []
    for pa, pb in zip(a.placements, b.placements):
        o, na, nb = _mm_placement(pa, pb, batch)
        outs.append(o)
        need_a.append(na)
        need_b.append(nb)
    return tuple(outs), tuple(need_a), tuple(need_b)


@register(aten.mm.default, aten.bmm.default)
def mm_rule(schema: OpSchema) -> OutputSharding:
    a, b = schema.args[0], schema.args[1]
    batch = 1 if schema.func is aten.bmm.default else 0
    out, na, nb = _mm_like(schema, a, b, batch)
    return OutputSharding([out], {schema.leaf_index(a): na, schema.leaf_index(b): nb})


@register(aten.addmm.default, aten.baddbmm.default)
def addmm_rule(schema: OpSchema) -> OutputSharding:
    bias, a, b = schema.args[0], schema.args[1], schema.args[2]
    batch = 1 if schema.func is aten.baddbmm.default else 0
    out, na, nb = _mm_like(schema, a, b, batch)
    out_shape = tuple(schema.out_meta[0].shape)
    nbias = tuple(map_to(p, len(out_shape), tuple(bias.shape), out_shape) for p in out)
    return OutputSharding(
        [out], {schema.leaf_index(bias): nbias, schema.leaf_index(a): na, schema.leaf_index(b): nb}
    )
