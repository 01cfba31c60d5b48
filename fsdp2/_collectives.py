"""Grouped collectives for one ``fully_shard`` group: one all-gather, one gradient reduction.

Both use the same rank-major layout: a ``(shard_size, N)`` buffer whose row ``r`` is what
rank ``r`` holds, ``N`` being the sum of the group's ``padded_numel``. The all-gather input is
this rank's row; the reduction input is every row (each rank's whole unsharded gradient),
and rank ``r`` keeps row ``r`` of the sum.

[Note: collectives on gloo] gloo has no native reduce-scatter (torch emulates it with an
all-reduce plus copies) and no ``PREMUL_SUM``, and its all-gather runs a ring. Measured on
this project's 2-core machine with 2 ranks and a 28 MB transformer block (fp32): all-gather
22 ms vs an all-to-all of the replicated row 11.5 ms; reduce-scatter 27-29 ms, all-reduce +
slice 18.5 ms, all-to-all + local sum 13.2 ms. So on gloo both grouped collectives are
all-to-alls; NCCL gets a real all-gather and reduce-scatter. Averaging is a sum and a
divide. ``dtensor.debug`` records them by meaning: one ``all_gather``, one
``reduce_scatter``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dtensor import debug
from dtensor._collectives import Pending, _all_gather_flat, _dim_label, _reduce_scatter_flat
from dtensor._collectives import _backend_is_gloo as _is_gloo
from fsdp2 import _host_memory


def wants_replicated_input(group) -> bool:
    """Whether ``all_gather_rows`` needs the row once per rank (gloo's all-to-all route)."""
    return _is_gloo(group)


_HUGE_PAGE = _host_memory.HUGE_PAGE
_HEADROOM = 64 << 10  # room for a slightly wider request (gradient rows carry a few flags)


class BufferPool:
    """Keeps a few freed CPU collective buffers for reuse.

    Every block of a transformer has the same parameter sizes, so its all-gather and
    reduction buffers have (nearly) the same size: reusing them saves a fresh allocation and
    the page faults of first touch per block per pass. A kept buffer serves any request it
    holds without wasting more than an eighth of itself (or one huge page), so a block's
    all-gather buffers and its gradient rows, a few elements wider, share one set. At most
    ``keep`` buffers are held, so memory stays bounded.

    Example::

        >>> pool = BufferPool(keep=2)
        >>> a = pool.get((4, 1000), torch.float32, "cpu")
        >>> pool.put(a)
        >>> pool.get((4, 1000), torch.float32, "cpu").data_ptr() == a.data_ptr()
        True
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[torch.UntypedStorage] = []

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        need = math.prod(shape) * dtype.itemsize
        fits = [s for s in self._free if need <= s.nbytes() <= need + max(need // 8, _HUGE_PAGE)]
        if fits:
            storage = min(fits, key=lambda s: s.nbytes())
            self._free.remove(storage)
        elif self.keep:
            # Untouched bytes at the end of the headroom never become resident.
            capacity = -(-(need + _HEADROOM) // _HUGE_PAGE) * _HUGE_PAGE
            storage = _host_memory.empty((capacity,), torch.uint8, device).untyped_storage()
        else:
            return _host_memory.empty(tuple(shape), dtype, device)
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    def put(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or len(self._free) >= self.keep:
            # Dropped (its mapping goes back to the kernel, see [Note: host memory]). The
            # CUDA caching allocator already reuses memory, per stream; a pool that handed
            # a buffer from one stream to another would break that bookkeeping.
            return
        self._free.append(t.untyped_storage())

    def clear(self) -> None:
        self._free.clear()


# Enough for a gather (input and output) and a reduction (rows and receive buffer) in flight.
POOL = BufferPool(keep=4)
NO_POOL = BufferPool(keep=0)  # for a group whose buffer shapes no other group uses


def all_gather_rows(
    rows_in: torch.Tensor, group, group_size: int, *, label=None, mesh=None, pool=POOL
) -> Pending:
    """All-gather: every rank contributes ``rows_in[0]`` (``(group_size, N)``, see below);
    the result is ``(group_size, N)`` with row ``r`` from rank ``r``.

    On gloo, ``rows_in`` must hold the same row ``group_size`` times: the gather runs as an
    all-to-all, measured about twice as fast as gloo's all-gather on this project's CPU
    machine (pairwise exchange instead of a ring). Elsewhere only ``rows_in[0]`` is read.
    Both buffers come from ``pool``; the input goes back to it once the collective has
    finished.
    """
    n = rows_in.size(1)
    row_bytes = n * rows_in.element_size()
    debug.record("all_gather", _dim_label(mesh, label), group_size, row_bytes)
    out = pool.get((group_size, n), rows_in.dtype, rows_in.device)
    if wants_replicated_input(group):
        work = dist.all_to_all_single(out, rows_in, group=group, async_op=True)
    else:
        work = _all_gather_flat(out.view(-1), rows_in[0], group=group, async_op=True)

    def finish():
        pool.put(rows_in)
        return out

    return Pending(work, finish)


def _combine(recv: torch.Tensor, divide_by: float) -> torch.Tensor:
    """Sum the received rows in rank order, divided by ``divide_by`` (one pass when it is
    the row count: ``mean`` measured 3x faster than ``sum(0)`` + ``div_`` here)."""
    k = recv.size(0)
    if divide_by == k:
        return recv.mean(0)
    total = recv[0].clone() if k == 1 else torch.add(recv[0], recv[1])
    for j in range(2, k):
        total.add_(recv[j])
    if divide_by != 1:
        total.div_(divide_by)
    return total


def reduce_rows(
    rows: torch.Tensor,
    rank: int,
    group,
    *,
    divide_by: float = 1.0,
    label=None,
    mesh=None,
    pool=POOL,
) -> Pending:
    """Sum ``rows`` (``(group_size, N)``, row ``r`` destined for rank ``r``) over the group
    and divide by ``divide_by``.

    The result is this rank's reduced row, a fresh ``(N,)`` tensor that owns its memory (the
    gradient shards are views of it). On gloo this is an all-to-all followed by a local sum
    in rank order: measured faster than both gloo's reduce-scatter and an all-reduce of the
    whole buffer, and it moves (k-1)/k of the buffer per rank instead of twice that.
    """
    k = rows.size(0)
    debug.record("reduce_scatter", _dim_label(mesh, label), k, rows.numel() * rows.element_size())
    if k == 1:
        return Pending(None, lambda: _combine(rows, divide_by))
    if _is_gloo(group):
        recv = pool.get(tuple(rows.shape), rows.dtype, rows.device)
        work = dist.all_to_all_single(recv, rows, group=group, async_op=True)

        def finish():
            total = _combine(recv, divide_by)
            pool.put(rows)
            pool.put(recv)
            return total

        return Pending(work, finish)
    out = torch.empty(rows.size(1), dtype=rows.dtype, device=rows.device)
    work = _reduce_scatter_flat(
        out, rows.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True
    )

    def finish_rs():
        pool.put(rows)
        return out.div_(divide_by) if divide_by != 1 else out

    return Pending(work, finish_rs)


def all_reduce_sum(t: torch.Tensor, group, *, label=None, mesh=None) -> None:
    """In-place synchronous sum over ``group`` (HSDP: across replicas)."""
    debug.record(
        "all_reduce",
        _dim_label(mesh, label),
        dist.get_world_size(group),
        t.numel() * t.element_size(),
    )
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
