"""Grouped collectives for one ``fully_shard`` group: ``foreach_all_gather`` and
``foreach_reduce``. Each chooses its route itself; the parameter group only says what to move.

Both use the same rank-major layout: row ``r`` of a ``(shard_size, N)`` layout is what rank
``r`` holds, ``N`` being the sum of the group's ``padded_numel``; within it, each parameter's
slot holds that rank's block of the parameter.

[Note: collectives on gloo] Three routes:

* **direct** (gloo, host memory, parameters averaging at least
  ``DIRECT_MIN_BYTES_PER_PARAM``): point-to-point messages, one per parameter and peer
  (``gather_blocks`` / ``reduce_blocks``). A shard goes straight from the sharded parameter
  into every rank's unsharded parameter, and a gradient block straight from the unsharded
  gradient to the rank that keeps it; nothing is staged but the blocks a reduction receives.
* **staged**: the shards are copied into one row, gathered with the padded row collectives
  of ``dtensor.comm`` (``all_gather_rows`` / ``reduce_rows``: an all-to-all on gloo,
  a real all-gather / reduce-scatter on NCCL) and copied out. Smaller groups take it on
  gloo, where one message per peer costs more than the copies; every group on NCCL.
* **post-forward** (``reshard_after_forward=k``): the staged route over the smaller group,
  from the rows kept after forward.

docs/fsdp2.md ("Collectives on gloo") has the measurements behind the threshold and the
primitives. ``dtensor.debug`` records every route by meaning: one ``all_gather`` and one
``reduce_scatter`` per group, with the bytes each rank contributes.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from dtensor import debug
from dtensor.buffers import KeptBuffer, nbytes_of
from dtensor.comm import (
    Pending,
    all_gather_rows,
    backend_is_gloo,
    exchange,
    mesh_dim_label,
    reduce_rows,
    reserve_message_tags,
    sum_into,
    tree_sum_into,
)
from fsdp2 import _host_memory
from fsdp2._param import internal

_HUGE_PAGE = _host_memory.HUGE_PAGE
_HEADROOM = 64 << 10  # room for a slightly wider request (gradient rows carry a few flags)


class BufferPool:
    """Keeps a few freed CPU collective buffers for reuse (one pool per training root).

    Every block of a transformer has the same parameter sizes, so its collective buffers
    have (nearly) the same size: reusing them saves a fresh allocation and the page faults of
    first touch per block per pass. A kept buffer serves any request it holds without wasting
    more than an eighth of itself (or one huge page), so buffers a few elements wider
    (gradient rows carry flags) share one set. At most ``keep`` buffers are held. Off the
    CPU it allocates fresh: the CUDA caching allocator already reuses memory, per stream.

    Buffers come back with ``put`` once their collective finished; one is handed out again
    only when nothing else references it any more (``dtensor.buffers``' [Note: the buffer
    safety rule], which DTensor's collective workspace follows too), so a buffer given back
    while a view of it is still read is never written under that reader. Counters: ``hits``
    (served by a kept buffer) and ``busy`` (a kept buffer would have fit but was still
    referenced). ``storages()`` lists the live storages it handed out or keeps (for
    ``fsdp2.tools.MemoryTracker``).

    Example::

        >>> pool = BufferPool(keep=2)
        >>> a = pool.get((4, 1000), torch.float32, "cpu")
        >>> ptr = a.data_ptr()
        >>> pool.put(a)
        >>> del a                              # nothing references it any more
        >>> pool.get((4, 1000), torch.float32, "cpu").data_ptr() == ptr
        True
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[KeptBuffer] = []
        self._lent: weakref.WeakSet = weakref.WeakSet()  # storages handed out, while alive
        self.hits = self.busy = 0

    def storages(self) -> list[torch.UntypedStorage]:
        """The storages of the buffers this pool keeps or handed out that are still alive.

        Example::

            >>> pool = BufferPool(keep=2)
            >>> a = pool.get((4, 1000), torch.float32, "cpu")
            >>> any(s is a.untyped_storage() for s in pool.storages())
            True
        """
        return [*self._lent, *(b.storage for b in self._free)]

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        need = nbytes_of(shape, dtype)
        slack = max(need // 8, _HUGE_PAGE)
        sized = [b for b in self._free if need <= b.nbytes <= need + slack]
        fits = [b for b in sized if b.is_free()]
        self.busy += len(sized) > len(fits) and not fits
        if fits:
            buf = min(fits, key=lambda b: b.nbytes)
            self._free.remove(buf)
            self.hits += 1
        elif self.keep:
            # Untouched bytes at the end of the headroom never become resident.
            capacity = -(-(need + _HEADROOM) // _HUGE_PAGE) * _HUGE_PAGE
            buf = KeptBuffer.of(_host_memory.empty((capacity,), torch.uint8, device))
        else:
            fresh = _host_memory.empty(tuple(shape), dtype, device)
            self._lent.add(fresh.untyped_storage())
            return fresh
        self._lent.add(buf.storage)
        return buf.tensor(shape, dtype)

    def put(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or len(self._free) >= self.keep:
            return  # dropped: its mapping goes back to the kernel ([Note: host memory])
        self._free.append(KeptBuffer.of(t))

    def clear(self) -> None:
        self._free.clear()


# The point-to-point route costs a fixed amount per message (a syscall and a wake-up on each
# side) and saves copies in proportion to bytes; below this mean parameter size the staged
# route is faster (docs/fsdp2.md, "Collectives on gloo").
DIRECT_MIN_BYTES_PER_PARAM = 1 << 20


def exchanges_blocks(group, device, nbytes: int, n_params: int) -> bool:
    """Whether a group of ``n_params`` parameters, ``nbytes`` unsharded, takes the direct
    route: gloo, host memory, and parameters large enough on average that copies cost more
    than messages."""
    return (
        torch.device(device).type == "cpu"
        and backend_is_gloo(group)
        and nbytes >= DIRECT_MIN_BYTES_PER_PARAM * n_params
    )


@contextlib.contextmanager
def _versions_preserved(params):
    """Writes into the unsharded parameters inside this block leave their version counters
    alone: autograd checks them on saved tensors, and a refill is not a modification."""
    with contextlib.ExitStack() as stack, internal():
        for p in params:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(p.unsharded_param))
        yield


def _replicate_first_row(rows: torch.Tensor) -> None:
    if rows.size(0) > 1:
        rows[1:].copy_(rows[0].expand(rows.size(0) - 1, -1))


class RowLayout:
    """Where each parameter's slot sits in one rank's row of a grouped all-gather.

    When every parameter is gathered in one dtype (the usual case) the row is a tensor of
    that dtype and slot ``i`` is ``padded_numel`` elements wide. Parameters of different
    dtypes (a frozen bf16 base with fp32 LoRA adapters) travel in one row of bytes: slot
    ``i`` holds ``padded_numel * itemsize`` bytes, rounded up to the largest item size of
    the group (8 at least) so that every slot, and every row, starts where each of the
    group's dtypes may be viewed (complex128 needs 16).

    Example::

        >>> layout = RowLayout([6, 4], [torch.bfloat16, torch.float32])
        >>> layout.row_dtype, layout.widths, layout.width
        (torch.uint8, [16, 16], 32)
    """

    def __init__(self, numels: list[int], dtypes: list[torch.dtype]) -> None:
        self.numels = numels
        self.dtypes = dtypes
        self.mixed = len(set(dtypes)) > 1
        if self.mixed:
            align = max(8, *(d.itemsize for d in dtypes))
            self.row_dtype = torch.uint8
            self.widths = [-(-n * d.itemsize // align) * align for n, d in zip(numels, dtypes)]
        else:
            self.row_dtype = dtypes[0] if dtypes else torch.float32
            self.widths = list(numels)
        self.offsets = [sum(self.widths[:i]) for i in range(len(self.widths))]
        self.width = sum(self.widths)

    @property
    def row_bytes(self) -> int:
        return self.width * self.row_dtype.itemsize

    def slot(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot of ``rows`` (1-D or ``(k, width)``), in its own dtype."""
        piece = rows[..., self.offsets[i] : self.offsets[i] + self.widths[i]]
        if self.mixed:
            n_bytes = self.numels[i] * self.dtypes[i].itemsize
            piece = piece[..., :n_bytes].view(self.dtypes[i])
        return piece

    def copy_out(self, rows: torch.Tensor, params) -> None:
        """Copy gathered ``(shard_size, width)`` rows into the parameters' rank blocks."""
        if not self.mixed:
            torch.split_with_sizes_copy(
                rows, self.widths, dim=1, out=[p.unsharded_rank_blocks() for p in params]
            )
            return
        for i, p in enumerate(params):
            p.unsharded_rank_blocks().copy_(self.slot(rows, i))


# --------------------------------------------------------------------------- all-gather
class AllGather:
    """An all-gather in flight; ``wait()`` leaves every parameter's unsharded buffer full."""

    def __init__(self, params, pending: Pending, *, layout: RowLayout | None, keep=None) -> None:
        self._params = params
        self._pending = pending
        self._layout = layout  # None: the collective wrote into the parameters directly
        self._keep = keep  # a buffer the collective reads (post-forward rows)

    def wait(self) -> None:
        out = self._pending.wait()
        self._keep = None
        if self._layout is not None:
            params = self._params
            rows = out.view(params[0].mesh_info.shard_size, -1)
            for p in params:
                p.back_storage(filled_now=True)
            with _versions_preserved(params):
                self._layout.copy_out(rows, params)


def foreach_all_gather(
    params, *, layout: RowLayout, device, comm, pool, kept_rows=None, post_forward=None
) -> AllGather:
    """Start one all-gather of ``params``' shards into their unsharded buffers (which must
    exist: ``FSDPParam.ensure_unsharded``), each in its ``layout`` dtype. With ``kept_rows``
    (``reshard_after_forward=k``) it gathers the rows kept after forward over
    ``post_forward``'s smaller group instead.

    Every rank must call it for the same parameters in the same order.
    """
    info = params[0].mesh_info
    dtype = layout.row_dtype
    with comm.streams.gather(after=comm.take_post_optim_event()):
        if kept_rows is not None:
            flat = kept_rows.view(-1)
            rows = _input_rows(
                pool, post_forward.group, post_forward.size, flat.numel(), dtype, device
            )
            rows[0].copy_(flat)
            _replicate_first_row(rows)
            pending = all_gather_rows(
                rows,
                post_forward.group,
                post_forward.size,
                label=info.shard_mesh_dim,
                mesh=info.mesh,
                pool=pool,
            )
            return AllGather(params, pending, layout=layout, keep=kept_rows)
        group = info.shard_group
        if exchanges_blocks(group, device, layout.row_bytes * info.shard_size, len(params)):
            return AllGather(params, _gather_direct(params, layout, info), layout=None)
        rows = _input_rows(pool, group, info.shard_size, layout.width, dtype, device)
        for i, p in enumerate(params):
            p.copy_shard_into(layout.slot(rows[0], i))
        _replicate_first_row(rows)
        pending = all_gather_rows(
            rows, group, info.shard_size, label=info.shard_mesh_dim, mesh=info.mesh, pool=pool
        )
        return AllGather(params, pending, layout=layout)


def _input_rows(pool, group, k: int, n: int, dtype, device) -> torch.Tensor:
    """All-gather input: ``k`` copies of our row on gloo (all-to-all), one elsewhere."""
    copies = k if backend_is_gloo(group) else 1
    return pool.get((copies, n), dtype, device)


def _gather_direct(params, layout: RowLayout, info) -> Pending:
    """The direct route: this rank's own block is copied now; the storage the others land in
    is backed before any message is posted. Each parameter travels in its own dtype."""
    me = info.shard_rank
    pieces = []
    for p in params:  # before the version guards, which reference the parameters
        p.back_storage()
    with _versions_preserved(params):  # gloo's own writes bypass the counter anyway
        for p, dtype in zip(params, layout.dtypes, strict=True):
            send, blocks, counts = p.shard_run(dtype), p.unsharded_rank_blocks(), p.rank_numels()
            if counts[me]:
                blocks[me, : counts[me]].copy_(send)
            pieces.append((send, blocks, counts))
    exchange = gather_blocks(
        pieces,
        info.shard_group,
        me,
        row_bytes=sum(p.padded_numel * d.itemsize for p, d in zip(params, layout.dtypes)),
        label=info.shard_mesh_dim,
        mesh=info.mesh,
    )
    return Pending(exchange, lambda: None)


# --------------------------------------------------------------------------- reduction
class Reduction:
    """A gradient reduction in flight: ``wait()`` returns this rank's reduced row (values of
    every parameter's block, then one "had a gradient" flag per parameter)."""

    def __init__(self, pending: Pending, grads=None) -> None:
        self._pending = pending
        # The unsharded gradients a CUDA reduce stream reads: held until the compute stream
        # has waited for the reduction (see [Note: stream-safe frees] in _streams.py).
        self._grads = grads

    def wait(self) -> torch.Tensor:
        row = self._pending.wait()
        self._grads = None
        return row


def foreach_reduce(
    params,
    grads: list,
    *,
    dtype: torch.dtype,
    device,
    comm,
    pool,
    divide_by: float,
    tree: bool = False,
) -> Reduction:
    """Start one reduction of ``grads`` (one per parameter, ``None`` where this rank has
    none) in ``dtype`` over the shard group, summed in rank order and divided by
    ``divide_by``; with ``tree`` summed pairwise in rank order (``tree_sum_into``) on every
    backend. Every rank must call it for the same parameters in the same order."""
    info = params[0].mesh_info
    group = info.shard_group
    n = sum(p.padded_numel for p in params)
    if exchanges_blocks(group, device, n * info.shard_size * dtype.itemsize, len(params)):
        return Reduction(_reduce_direct(params, grads, dtype, info, pool, divide_by, tree))
    with comm.streams.reduce():
        rows = _gradient_rows(params, grads, dtype, device, pool)
        # The side stream may still read the gradients, so they are kept until the compute
        # stream has waited for it; on CPU they go now, before the receive buffer exists.
        keep = grads if comm.streams.enabled else None
        grads = None
        pending = reduce_rows(
            rows,
            info.shard_rank,
            group,
            divide_by=divide_by,
            label=info.shard_mesh_dim,
            mesh=info.mesh,
            pool=pool,
            tree=tree,
        )
    return Reduction(pending, keep)


def _reduce_direct(params, grads, dtype, info, pool, divide_by, tree) -> Pending:
    pieces, slot = [], 0
    for p, g in zip(params, grads, strict=True):
        pieces.append((p.grad_run(g, dtype), p.padded_numel, p.rank_numels(), slot))
        slot += p.padded_numel
    flags = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
    return reduce_blocks(
        pieces,
        flags,
        info.shard_group,
        info.shard_rank,
        width=slot + len(params),
        divide_by=divide_by,
        label=info.shard_mesh_dim,
        mesh=info.mesh,
        pool=pool,
        tree=tree,
    )


def _gradient_rows(params, grads, dtype, device, pool) -> torch.Tensor:
    """``(shard_size, N + len(params))`` rank-major gradients in ``dtype``, plus the flags.

    ``_chunk_cat`` wants one input dtype (it casts into the output), and a zero-element
    gradient contributes no column, so such pieces are left out.
    """
    ws = params[0].mesh_info.shard_size
    src_dtypes = {g.dtype for g in grads if g is not None}
    src = src_dtypes.pop() if len(src_dtypes) == 1 else dtype
    pieces = []
    for p, g in zip(params, grads, strict=True):
        if p.padded_numel == 0:
            continue
        if g is None:
            g = torch.zeros(p.moved_shape(p.rows), dtype=src, device=device)
        elif p.shard_dim:
            g = g.movedim(p.shard_dim, 0)
        pieces.append(g.to(src))
    flags = [1.0 if g is not None else 0.0 for g in grads]
    pieces.append(torch.tensor([flags], dtype=src, device=device).expand(ws, -1))
    width = sum(p.padded_numel for p in params) + len(params)
    rows = pool.get((ws, width), dtype, device)
    torch._chunk_cat(pieces, dim=0, num_chunks=ws, out=rows)
    return rows


# --------------------------------------------------------------------------- point to point
# Message tags: a parameter's index within its group, in a range reserved here for
# all-gathers and one for reductions (``dtensor.comm``'s [Note: message tags]), so that an
# all-gather and a reduction in flight at once never share one. Within each, gloo matches
# the messages of one tag between two ranks in the order they were posted.
_GATHER_TAGS = reserve_message_tags("fsdp2.all_gather", 1 << 24)  # one per parameter of a group
_REDUCE_TAGS = reserve_message_tags("fsdp2.reduce_scatter", 1 << 24)  # per parameter, the flags


class _Exchange:
    """The messages of one point-to-point collective; ``wait()`` returns once all are done."""

    __slots__ = ("_works", "_keep")

    def __init__(self, works: list, keep: list) -> None:
        self._works = works
        self._keep = keep  # send sources that are temporaries (a cast or a layout change)

    def wait(self) -> None:
        with debug.annotate_failures():
            for work in self._works:
                debug.wait_collective(work, point_to_point=True)
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
    ``blocks[j, :counts[j]]``; this rank's own block is the caller's to copy. Every rank
    must call it for the same parameters in the same order: gloo matches the messages of
    one tag in posting order.
    """
    debug.record("all_gather", mesh_dim_label(mesh, label), group.size(), row_bytes, group=group)
    messages = [
        (lambda j, send=send: send, lambda j, blocks=blocks, counts=counts: blocks[j, : counts[j]])
        for send, blocks, counts in pieces
    ]
    works = exchange(group, rank, messages, _GATHER_TAGS)
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
    pool=None,
    tree: bool = False,
) -> Pending:
    """Gradient reduction by point-to-point messages, the counterpart of ``gather_blocks``:
    rank ``j``'s block of every gradient goes straight from the gradient to rank ``j``.

    ``pieces`` holds, per parameter, ``(grad, padded, counts, slot)``: the whole gradient as
    one contiguous 1-D run in the rank-major layout (rank ``j``'s block starts at
    ``j * padded`` and has ``counts[j]`` elements) and where this parameter's block sits in
    the reduced row. ``flags`` (one per parameter, 1.0 where this rank has a gradient) ride
    along at the row's end. The result is this rank's row of ``width`` elements, summed in
    rank order (pairwise with ``tree``: ``tree_sum_into``) and divided by ``divide_by``;
    its padding is zero. Only the blocks other ranks send are staged (one row per peer).
    """
    size = group.size()
    nbytes = size * width * flags.itemsize
    debug.record("reduce_scatter", mesh_dim_label(mesh, label), size, nbytes, group=group)
    shape = (size - 1, width)  # row i: what the i-th other rank sent
    if pool is not None:
        recv = pool.get(shape, flags.dtype, flags.device)
    else:
        recv = torch.empty(shape, dtype=flags.dtype, device=flags.device)
    works = exchange(group, rank, _reduce_messages(pieces, flags, recv, rank), _REDUCE_TAGS)

    def finish() -> torch.Tensor:
        total = _sum_in_rank_order(pieces, flags, recv, rank, tree)
        if pool is not None:
            pool.put(recv)
        return total.div_(divide_by) if divide_by != 1 else total

    return Pending(_Exchange(works, [p[0] for p in pieces] + [flags]), finish)


def _reduce_messages(pieces, flags: torch.Tensor, recv: torch.Tensor, rank: int) -> list:
    """``exchange``'s messages for ``reduce_blocks``: per parameter, peer ``j``'s block of
    the gradient, received into its slot of ``recv``; then the flags."""

    def row(j: int) -> int:  # recv's row for peer j
        return j if j < rank else j - 1

    messages = []
    for grad, padded, counts, slot in pieces:
        n = counts[rank]
        messages.append(
            (
                lambda j, g=grad, pad=padded, c=counts: g[j * pad : j * pad + c[j]],
                lambda j, slot=slot, n=n: recv[row(j), slot : slot + n],
            )
        )
    n_values = recv.size(1) - flags.numel()
    messages.append((lambda j: flags, lambda j: recv[row(j), n_values:]))
    return messages


def _sum_in_rank_order(pieces, flags: torch.Tensor, recv: torch.Tensor, rank: int, tree=False):
    """This rank's reduced row: its own blocks and flags added to the received ones in rank
    order (pairwise with ``tree``, overwriting ``recv``), the padding after each parameter's
    block zeroed (not yet divided)."""
    scratch = [True] * rank + [False] + [True] * (recv.size(0) - rank)

    def in_rank_order(own: torch.Tensor, received: torch.Tensor) -> list[torch.Tensor]:
        return [*received[:rank], own, *received[rank:]]

    def sum_parts(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
        if tree:
            tree_sum_into(out, parts, scratch=scratch)
        else:
            sum_into(out, parts)

    width = recv.size(1)
    n_values = width - flags.numel()
    total = torch.empty(width, dtype=flags.dtype, device=flags.device)
    for grad, padded, counts, slot in pieces:
        n = counts[rank]
        own = grad[rank * padded : rank * padded + n]
        sum_parts(total[slot : slot + n], in_rank_order(own, recv[:, slot : slot + n]))
        if n < padded:
            total[slot + n : slot + padded].zero_()
    sum_parts(total[n_values:], in_rank_order(flags, recv[:, n_values:]))
    return total


def all_reduce_sum(t: torch.Tensor, group, *, label=None, mesh=None, tree=False) -> None:
    """In-place synchronous sum over ``group`` (HSDP: across replicas). With ``tree`` the
    ranks' tensors are all-gathered and summed pairwise in rank order (``tree_sum_into``)
    instead of in the backend's order: it holds ``group`` size copies of ``t`` meanwhile."""
    size = dist.get_world_size(group)
    nbytes = t.numel() * t.element_size()
    debug.record("all_reduce", mesh_dim_label(mesh, label), size, nbytes, group=group)
    with debug.annotate_failures():
        if not tree:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            return
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
    tree_sum_into(t, parts, scratch=[True] * size)
