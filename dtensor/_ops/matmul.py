"""Matrix products: mm, addmm, bmm (``linear`` and ``matmul`` decompose into these).

Per mesh dim, with ``a`` of shape (.., m, k) and ``b`` of shape (.., k, n):

    a        b        out                 a        b        out
    S(m)     R        S(m)                R        S(n)     S(n)
    S(k)     S(k)     P(sum)              R        R        R
    P        R        P                   R        P        P
    S(batch) S(batch) S(batch)            (anything else: the cheapest of these is requested)

``_foreach_mm`` applies that rule at each list position. Vector products (``matmul`` on 1-D
operands decomposes into these), per mesh dim, a linear Partial (sum, avg) of one operand
passing through when the other is whole:

    dot / vdot (x, y):    S(0), S(0) -> P(sum)
    mv (mat, vec):        S(0), R -> S(0);   S(1), S(0) -> P(sum)
    addr (self, v1, v2):  v1 S(0) -> rows S(0);   v2 S(0) -> columns S(1)

``addmv`` / ``addr`` add ``beta * self`` to the product: ``self`` takes the output's placement
(broadcast dims whole; a Partial output gets ``self`` as that Partial, for a sum held by one
rank), so the sum comes out in the same placement.
"""

from __future__ import annotations

import math

import torch

from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    map_to,
    register,
    register_per_mesh_dim,
)
from dtensor._spec import DTensorSpec
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


# --------------------------------------------------------------------------- vector products
# Options for one mesh dim (see the note [rules for one mesh dim] in _common.py). A product is
# linear in each operand, so a linear Partial of one operand passes through when the other is
# whole; a contraction over a dim both operands shard leaves each rank a partial sum.

_LINEAR = (Partial("sum"), Partial("avg"))


@register_per_mesh_dim(aten.dot.default, aten.vdot.default)
def dot_options(schema: OpSchema) -> list:
    """``dot(x, y)`` / ``vdot(x, y)`` (conjugate-linear in ``x``, which a real-valued sum or
    mean of partial values respects): sharing a shard of the one dim sums partial products."""
    opts = [Option((Partial(),), (Shard(0), Shard(0)))]
    for p in _LINEAR:
        opts += [Option((p,), (p, Replicate())), Option((p,), (Replicate(), p))]
    return opts


@register_per_mesh_dim(aten.mv.default)
def mv_options(schema: OpSchema) -> list:
    """``mv(mat (m, k), vec (k,))``: rows of ``mat`` give rows of the result; a shared shard
    of ``k`` gives partial sums."""
    opts = [
        Option((Shard(0),), (Shard(0), Replicate())),
        Option((Partial(),), (Shard(1), Shard(0))),
    ]
    for p in _LINEAR:
        opts += [Option((p,), (p, Replicate())), Option((p,), (Replicate(), p))]
    return opts


def _bias_for(schema: OpSchema, bias, p_out):
    """What the added tensor (``self`` of addmv / addr, broadcast to the output) needs for
    the output to come out as ``p_out``."""
    out_shape = tuple(schema.out_meta[0].shape)
    return map_to(p_out, len(out_shape), tuple(bias.shape), out_shape)


def _scaled_sum_options(schema: OpSchema, product_opts: list) -> list:
    """``beta * self + alpha * product``: each option of the product, with what ``self``
    needs for the same output placement (a Partial output takes ``self`` as a Partial too,
    held by one rank for a sum)."""
    bias = schema.args[0]
    if not isinstance(bias, DTensorSpec):  # only a non-DTensor ``self``: no placement to give
        return product_opts
    return [
        Option(o.outputs, (_bias_for(schema, bias, o.outputs[0]), *o.inputs)) for o in product_opts
    ]


def addmv_options(schema: OpSchema) -> list:
    """``beta * self + alpha * mv(mat, vec)``: the options of ``mv``."""
    return _scaled_sum_options(schema, mv_options(schema))


@register(aten.addmv.default)
def addmv_rule(schema: OpSchema) -> OutputSharding:
    sharding = expand_per_mesh_dim(schema, addmv_options(schema))
    if math.prod(schema.args[1].shape) != 0:
        sharding.local_fn = _addmv_local
    return sharding


addmv_rule.options = addmv_options


def _addmv_local(self, mat, vec, *, beta=1, alpha=1):
    """``addmv`` on one rank's blocks. Given a matrix without entries (a rank's empty block of
    its rows, or of the contracted dim) torch's kernel returns ``beta * self`` in the shape of
    ``self``, not broadcast to the rows of ``mat``; built here from ``mv`` instead (its zeros
    have the right shape), with ``self`` ignored for ``beta == 0`` as the kernel does."""
    if mat.numel() != 0:
        return aten.addmv.default(self, mat, vec, beta=beta, alpha=alpha)
    out = aten.mv.default(mat, vec)
    return out + beta * self if beta != 0 else out


@register_per_mesh_dim(aten.addr.default)
def addr_options(schema: OpSchema) -> list:
    """``beta * self + alpha * outer(vec1 (m,), vec2 (n,))``: a shard of ``vec1`` gives rows
    of the result, one of ``vec2`` columns; a linear Partial of either passes through."""
    opts = [
        Option((Shard(0),), (Shard(0), Replicate())),
        Option((Shard(1),), (Replicate(), Shard(0))),
    ]
    for p in _LINEAR:
        opts += [Option((p,), (p, Replicate())), Option((p,), (Replicate(), p))]
    return _scaled_sum_options(schema, opts)


# --------------------------------------------------------------------------- _foreach_mm
def foreach_mm_rule(schema: OpSchema) -> OutputSharding:
    """``_foreach_mm(as, bs)``: the ``mm`` rule at each list position (positions may sit on
    different meshes). The pointwise ``_foreach_`` rule would keep both operands' shards,
    which multiplies blocks that do not fit."""
    lhs, rhs = schema.args[0], schema.args[1]
    outs, meshes, inputs = [], [], {}
    for j, (a, b) in enumerate(zip(lhs, rhs, strict=True)):
        if not (isinstance(a, DTensorSpec) and isinstance(b, DTensorSpec)):
            raise NotImplementedError(
                f"_foreach_mm: list position {j} mixes a DTensor with a plain tensor; "
                "distribute both operands."
            )
        if a.mesh != b.mesh:
            raise ValueError(
                f"_foreach_mm: list position {j} mixes meshes {a.mesh!r} and {b.mesh!r}."
            )
        out, na, nb = _mm_like(schema, a, b, 0)
        inputs[schema.leaf_index(a)] = na
        inputs[schema.leaf_index(b)] = nb
        outs.append(out)
        meshes.append(a.mesh)
    return OutputSharding(outs, inputs, output_meshes=meshes)


# aten._foreach_mm arrived after PyTorch 2.11 (which we support): register where it exists.
if hasattr(aten, "_foreach_mm"):
    register(aten._foreach_mm.default)(foreach_mm_rule)
