"""Grouped collectives for one ``fully_shard`` group: one all-gather, one gradient reduction.

Both use the same rank-major layout: row ``r`` of a ``(shard_size, N)`` layout is what rank
``r`` holds, ``N`` being the sum of the group's ``padded_numel``; within it, each parameter's
slot holds that rank's block of the parameter.

[Note: collectives on gloo] On gloo with host memory (the CPU machine this project is
measured on) a group whose parameters average at least ``DIRECT_MIN_BYTES_PER_PARAM`` runs
both collectives as point-to-point messages, one per parameter and peer
(``gather_blocks`` / ``reduce_blocks``): a shard goes straight from the sharded parameter
into every rank's unsharded parameter, and a gradient block straight from the unsharded
gradient to the rank that keeps it. Nothing is staged except the blocks a reduction receives.
Smaller groups keep the staged route below, where one message per peer costs less than the
copies it needs.
Measured on this project's 2-core machine for a 28 MB transformer block at 2 ranks, with the
copies each route needs: 6.8-8.0 ms per all-gather this way; 12.8-14.3 ms as an all-to-all of
the row replicated per rank (our previous route, itself twice as fast as gloo's ring
all-gather); and it drops two block-sized buffers per collective. gloo has no native
reduce-scatter (torch emulates it with an all-reduce plus copies) and no ``PREMUL_SUM``:
averaging is a sum in rank order and a divide. Elsewhere (NCCL) the grouped collectives are a
real all-gather and reduce-scatter over staged rows (``all_gather_rows`` / ``reduce_rows``),
which also serve ``reshard_after_forward=int``'s gather from the kept rows on any backend.
``dtensor.debug`` records every route by meaning: one ``all_gather``, one ``reduce_scatter``.
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

    Every block of a transformer has the same parameter sizes, so its collective buffers
    have (nearly) the same size: reusing them saves a fresh allocation and the page faults of
    first touch per block per pass. On gloo these are the rows a reduction receives; on the
    staged route, the all-gather buffers and the gradient rows too. A kept buffer serves any
    request it holds without wasting more than an eighth of itself (or one huge page), so
    buffers a few elements wider (gradient rows carry flags) share one set. At most ``keep``
    buffers are held, so memory stays bounded.

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


# The point-to-point route costs a fixed amount per message (a syscall and a wake-up on each
# side) and saves copies in proportion to bytes. Measured on this project's 2-core machine at
# 2 ranks, training GPTs whose blocks hold 12 parameters: 28 MB blocks (2.3 MB a parameter)
# were faster point to point; 7 MB blocks (0.6 MB a parameter) 1-2% slower and 1.8 MB
# blocks 4-10% slower (tokens/s, back to back). Groups below this mean stay staged.
DIRECT_MIN_BYTES_PER_PARAM = 1 << 20


def exchanges_blocks(group, device, nbytes: int, n_params: int) -> bool:
    """Whether a group of ``n_params`` parameters, ``nbytes`` unsharded, takes the
    point-to-point route (``gather_blocks`` / ``reduce_blocks``): gloo, host memory, and
    parameters large enough on average that copies cost more than messages."""
    return (
        torch.device(device).type == "cpu"
        and _is_gloo(group)
        and nbytes >= DIRECT_MIN_BYTES_PER_PARAM * n_params
    )


# Message tags: a parameter's index within its group, offset so that an all-gather and a
# reduction in flight at once never share one. Within each, gloo matches the messages of
# one tag between two ranks in the order they were posted.
_GATHER_TAG = 0
_REDUCE_TAG = 1 << 24


class _Exchange:
    """The messages of one point-to-point collective; ``wait()`` returns once all are done."""

    __slots__ = ("_works", "_keep")

    def __init__(self, works: list, keep: list) -> None:
        self._works = works
        self._keep = keep  # send sources that are temporaries (a cast or a layout change)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = self._keep = []


def gather_blocks(
    pieces: list[tuple[torch.Tensor, torch.Tensor, list[int]]],
    group,
    rank: int,
    *,
    row_bytes: int,
    label=None,
    mesh=None,
) -> _Exchange:
    """All-gather by point-to-point messages, one per parameter and peer, sent straight
    from each shard and received straight into each unsharded parameter.

    ``pieces`` holds, per parameter, ``(send, blocks, counts)``: this rank's shard as one
    contiguous run, the unsharded parameter viewed as ``(group_size, padded)`` rank blocks,
    and the element count of every rank's block. Rank ``j``'s shard lands in
    ``blocks[j, :counts[j]]``; this rank's own block is the caller's to copy. Nothing is
    staged: no input row, no output rows, no copy-out (see [Note: collectives on gloo]; at
    4 ranks 20.5-21.1 ms against 22.5-23.1 ms). Every rank must call it for the same
    parameters in the same order: gloo matches the messages of one tag in posting order.
    """
    size = group.size()
    debug.record("all_gather", _dim_label(mesh, label), size, row_bytes)
    works = []
    for tag, (_, blocks, counts) in enumerate(pieces):
        for step in range(1, size):
            src = (rank - step) % size
            if counts[src]:
                works.append(group.recv([blocks[src, : counts[src]]], src, _GATHER_TAG + tag))
    for tag, (send, _, counts) in enumerate(pieces):
        if counts[rank]:
            for step in range(1, size):
                works.append(group.send([send], (rank + step) % size, _GATHER_TAG + tag))
    return _Exchange(works, [send for send, _, _ in pieces])


def reduce_blocks(
    pieces: list[tuple[torch.Tensor, int, list[int], int]],
    flags: torch.Tensor,
    group,
    rank: int,
    *,
    width: int,
    divide_by: float,
    label=None,
    mesh=None,
    pool=POOL,
) -> Pending:
    """Gradient reduction by point-to-point messages, the counterpart of ``gather_blocks``:
    rank ``j``'s block of every gradient goes straight from the gradient to rank ``j``.

    ``pieces`` holds, per parameter, ``(grad, padded, counts, slot)``: the whole gradient as
    one contiguous 1-D run in the rank-major layout (rank ``j``'s block starts at
    ``j * padded`` and has ``counts[j]`` elements) and where this parameter's block sits in
    the reduced row. ``flags`` (one per parameter, 1.0 where this rank has a gradient) ride
    along at the row's end. The result is this rank's row of ``width`` elements, summed in
    rank order and divided by ``divide_by``; its padding is zero. Only the blocks other
    ranks send are staged (one row per peer); there is no rank-major input buffer.
    """
    size = group.size()
    debug.record("reduce_scatter", _dim_label(mesh, label), size, size * width * flags.itemsize)
    # Row i of ``recv`` holds what the i-th other rank, in rank order, sends us.
    others = [r for r in range(size) if r != rank]
    recv = pool.get((size - 1, width), flags.dtype, flags.device)
    n_values = width - flags.numel()
    works = []
    flags_tag = _REDUCE_TAG + len(pieces)
    for i, src in enumerate(others):
        for tag, (_, _, counts, slot) in enumerate(pieces):
            if counts[rank]:
                into = recv[i, slot : slot + counts[rank]]
                works.append(group.recv([into], src, _REDUCE_TAG + tag))
        works.append(group.recv([recv[i, n_values:]], src, flags_tag))
    for dst in others:
        for tag, (grad, padded, counts, _) in enumerate(pieces):
            if counts[dst]:
                block = grad[dst * padded : dst * padded + counts[dst]]
                works.append(group.send([block], dst, _REDUCE_TAG + tag))
        works.append(group.send([flags], dst, flags_tag))

    def in_rank_order(own: torch.Tensor, received: torch.Tensor) -> list[torch.Tensor]:
        return [*received[:rank], own, *received[rank:]]

    def finish() -> torch.Tensor:
        total = torch.empty(width, dtype=flags.dtype, device=flags.device)
        for grad, padded, counts, slot in pieces:
            n = counts[rank]
            own = grad[rank * padded : rank * padded + n]
            _sum_into(total[slot : slot + n], in_rank_order(own, recv[:, slot : slot + n]))
            if n < padded:
                total[slot + n : slot + padded].zero_()
        _sum_into(total[n_values:], in_rank_order(flags, recv[:, n_values:]))
        pool.put(recv)
        if divide_by != 1:
            total.div_(divide_by)
        return total

    return Pending(_Exchange(works, [p[0] for p in pieces] + [flags]), finish)


def _sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """``out`` = the sum of ``parts``, added in the order given."""
    if len(parts) == 1:
        return out.copy_(parts[0])
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
    return out


def _combine(recv: torch.Tensor, divide_by: float) -> torch.Tensor:
    """Sum the received rows in rank order, divided by ``divide_by`` (one pass when it is
    the row count: ``mean`` measured 3x faster than ``sum(0)`` + ``div_`` here)."""
    if divide_by == recv.size(0):
        return recv.mean(0)
    total = _sum_into(torch.empty_like(recv[0]), list(recv))
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
