"""Grouped collectives for one ``fully_shard`` group: one all-gather, one gradient reduction.

Both use the same rank-major layout: a ``(shard_size, N)`` buffer whose row ``r`` is what
rank ``r`` holds, ``N`` being the sum of the group's ``padded_numel``. The all-gather input is
this rank's row; the reduction input is every row (each rank's whole unsharded gradient),
and rank ``r`` keeps row ``r`` of the sum.

[Note: reduction on gloo] gloo has no native reduce-scatter (torch emulates it with an
all-reduce plus copies) and no ``PREMUL_SUM``. Measured on this project's CPU machine, an
all-reduce of the whole buffer followed by taking our row is the faster route, so that is
what runs on gloo; NCCL gets a real reduce-scatter. Averaging is a ``SUM`` and a divide.
Both are reported to ``dtensor.debug`` as one ``reduce_scatter``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dtensor import debug

# torch 2.13 prefers the *_single names; older releases (2.11 on the GPU hosts) only have
# the *_tensor ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_gloo(group) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def _dim_label(mesh, mesh_dim: int | None):
    if mesh_dim is None:
        return None
    names = mesh.mesh_dim_names
    return names[mesh_dim] if names else mesh_dim


class Collective:
    """An issued (possibly still running) collective; ``wait()`` returns its result once."""

    __slots__ = ("_work", "_finish", "_done", "_result")

    def __init__(self, work, finish: Callable[[], object]) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._finish = None
            self._done = True
        return self._result


def all_gather_rows(
    row: torch.Tensor, group, group_size: int, *, label=None, mesh=None
) -> Collective:
    """All-gather one flat row per rank into ``(group_size, row.numel())`` (async)."""
    out = torch.empty(group_size * row.numel(), dtype=row.dtype, device=row.device)
    debug.record(
        "all_gather", _dim_label(mesh, label), group_size, row.numel() * row.element_size()
    )
    work = _all_gather_flat(out, row, group=group, async_op=True)
    return Collective(work, lambda: out.view(group_size, row.numel()))


def reduce_rows(rows: torch.Tensor, rank: int, group, *, label=None, mesh=None) -> Collective:
    """Sum ``rows`` (``(group_size, N)``) over the group; the result is our row ``rank``.

    The returned collective's result is a fresh ``(N,)`` tensor that owns its memory, so
    the gradient shards viewed from it do not keep the whole buffer alive.
    """
    k = rows.size(0)
    debug.record("reduce_scatter", _dim_label(mesh, label), k, rows.numel() * rows.element_size())
    if k == 1:
        return Collective(None, lambda: rows[0])
    if _is_gloo(group):
        work = dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return Collective(work, lambda: rows[rank].clone())
    out = torch.empty(rows.size(1), dtype=rows.dtype, device=rows.device)
    work = _reduce_scatter_flat(out, rows, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Collective(work, lambda: out)


def all_reduce_sum(t: torch.Tensor, group, *, label=None, mesh=None) -> None:
    """In-place synchronous sum over ``group`` (HSDP: across replicas)."""
    debug.record(
        "all_reduce",
        _dim_label(mesh, label),
        dist.get_world_size(group),
        t.numel() * t.element_size(),
    )
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
