"""Scans and sorts along one dim: ``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax``,
``cummin``, ``sort`` (``argsort``, ``msort``) and ``topk``.

Each works on the 1-D slices along ``dim`` independently, so a shard of any other dim passes
through unchanged: every rank holds whole slices. A shard of ``dim`` itself splits the slices:

- ``cumsum``, ``cumprod`` and ``logcumsumexp`` keep it. Block ``r`` of the scan is the local
  scan of block ``r`` combined with the scan's total over the blocks before it (a sum, a
  product, a log-sum-exp), and that total comes from an all-gather of each block's last
  scanned slice: one slice per rank moves, not the tensor. An empty block contributes the
  combine's identity. This needs the blocks in rank order, so it is done when one mesh dim
  (a plain ``Shard``) splits ``dim`` and no input is partial; otherwise ``dim`` is gathered.
- ``cummax``/``cummin``, ``sort`` and ``topk`` gather ``dim`` (on the mesh dims sharding it).

Partial inputs stay partial where the scan is linear in them: ``cumsum`` of a
``Partial("sum")`` (or ``"avg"``), ``cumprod`` of a ``Partial("product")`` (the product of
the ranks' running products is the running product of the products). Any other partial is
reduced first.
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
from dtensor._ops.reductions import _gather_stack
from dtensor.placement import Partial, Shard

aten = torch.ops.aten


def _other_dims(ndim: int, dim: int, n_outputs: int) -> list[Option]:
    """Keep a shard of every dim but ``dim``, on the input and on each output."""
    return [Option((Shard(d),) * n_outputs, (Shard(d),)) for d in range(ndim) if d != dim]


# How a block's scan joins the total of the blocks before it: (partials the scan is linear
# in, an empty block's total, reduction of the earlier blocks' totals over dim 0, how the
# local scan takes it).
_SCANS = {
    "cumsum": (("sum", "avg"), 0, torch.sum, torch.add),
    "cumprod": (("product",), 1, torch.prod, torch.mul),
    "logcumsumexp": ((), float("-inf"), torch.logsumexp, torch.logaddexp),
}


@register(aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default)
def scan_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    dim = schema.args[1] % max(x.ndim, 1)
    linear_in, identity, earlier_total, join = _SCANS[schema.name]
    options = _other_dims(x.ndim, dim, 1)
    partials = [p for p in x.placements if isinstance(p, Partial)]
    options += [
        Option((p,), (p,))
        for p in dict.fromkeys(partials)
        if type(p) is Partial and p.reduce_op in linear_in
    ]
    along = [m for m, p in enumerate(x.placements) if getattr(p, "dim", None) == dim]
    split = len(along) == 1 and type(x.placements[along[0]]) is Shard and not partials
    if split:
        # chosen only where the input already has it: every other option costs nothing
        # on a sharded or replicated mesh dim, and no mesh dim is partial
        options.append(Option((Shard(dim),), (Shard(dim),)))
    sharding = expand_per_mesh_dim(schema, options)
    if split:
        mesh, mesh_dim, func = x.mesh, along[0], schema.func
        rank = mesh.get_local_rank(mesh_dim)

        def local_fn(t, *args, **kwargs):
            out = func(t, *args, **kwargs)
            n = out.size(dim)
            # this block's total: its last scanned slice
            last = out.narrow(dim, n - 1, 1) if n else out.new_full(_one(out.shape, dim), identity)
            lasts = _gather_stack(last, mesh, mesh_dim)
            return join(out, earlier_total(lasts[:rank], 0))

        sharding.local_fn = local_fn
    return sharding


def _one(shape, dim: int) -> list[int]:
    return [1 if d == dim else s for d, s in enumerate(shape)]


@register_per_mesh_dim(aten.cummax.default, aten.cummin.default)
def cumulative_extremum_options(schema: OpSchema) -> list[Option]:
    x = schema.args[0]
    return _other_dims(x.ndim, schema.args[1] % max(x.ndim, 1), 2)


@register_per_mesh_dim(aten.sort.default, aten.sort.stable, aten.topk.default)
def sort_options(schema: OpSchema) -> list[Option]:
    """Sorting, and the k largest or smallest, along ``dim`` (values and indices)."""
    x = schema.args[0]
    if schema.func is aten.sort.default:
        dim = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", -1)
    elif schema.func is aten.topk.default:
        dim = schema.args[2] if len(schema.args) > 2 else schema.kwargs.get("dim", -1)
    else:  # sort.stable: everything after self is keyword-only
        dim = schema.kwargs.get("dim", -1)
    return _other_dims(x.ndim, dim % max(x.ndim, 1), 2)
