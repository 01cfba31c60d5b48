"""Collectives over one mesh dim, with the padding that uneven ``torch.chunk`` shards need.

Each function takes the local tensor, the mesh and the mesh dim, and returns a ``Pending``:
the collective may still be running (``async_op=True``); ``Pending.wait()`` finishes it and
returns the result. Every call is reported to ``dtensor.debug``.

[Note: padding] gloo and NCCL need every rank to contribute the same number of elements.
A shard is padded along its tensor dim up to ``padded_chunk_size``; after an all-gather, each
rank's block is cut back to its real ``chunk_sizes`` entry.

The padded row collectives and the point-to-point ``exchange`` they share with fsdp2 live
one layer down, in ``dtensor.comm`` ([Note: row collectives on gloo] there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor import _workspace, debug
from dtensor.comm import (
    Pending,
    all_gather_rows,
    backend_is_gloo,
    combine_rows,
    exchange,
    reduce_rows,
    reduces_rows_by_all_to_all,
    reduction_of,
    reserve_message_tags,
    sum_into,
)
from dtensor.comm import mesh_dim_label as _dim_label
from dtensor.placement import Partial, chunk_offsets, chunk_sizes, padded_chunk_size

__all__ = [  # names other modules read here; the row collectives are dtensor.comm's
    "Pending",
    "all_gather_rows",
    "backend_is_gloo",
    "combine_rows",
    "reduce_rows",
    "reduces_rows_by_all_to_all",
    "sum_into",
]


# [Note: one wire form per collective] A redistribution runs eagerly (this module) or inside
# a compiled graph (``dtensor._collectives_traced``), and each rank decides for itself: one
# rank can fall back to eager (a graph break, dynamo's recompile limit) while its peers run
# the graph. Both must then exchange the same messages - the same operations in the same
# order, with the same sizes and tags - or they wait on each other until the process group
# times out. So the transport of each collective is chosen here, once, by the five
# functions below; both modules pack their buffers with the same helpers (``_pad_dim0``,
# ``_stack_blocks``, ``_all_to_all_send``, ``_prepare_reduce``, ``_row_reduction``) and
# unpack with the same ones; only how the transport is issued differs (a call here, a
# functional collective or one of the ``fsdp2_lite`` ops in a graph).
def gathers_blocks(group) -> bool:
    """Whether a redistribution's all-gather over ``group`` exchanges each rank's block point
    to point ([Note: DTensor's collectives on gloo]) instead of all-gathering padded rows."""
    return backend_is_gloo(group)


def reduce_scatters_blocks(group, partial: Partial) -> bool:
    """Whether a redistribution's reduce-scatter of ``partial`` over ``group`` exchanges
    blocks point to point (gloo, sum and average) instead of reducing padded rows."""
    return (
        backend_is_gloo(group) and type(partial) is Partial and partial.reduce_op in ("sum", "avg")
    )


def moves_shards_by_blocks(group) -> bool:
    """Whether a redistribution's all-to-all (Shard(a) -> Shard(b)) over ``group`` sends
    each peer its block point to point ([Note: all-to-all on gloo]) instead of running an
    all-to-all of blocks padded on both dims."""
    return backend_is_gloo(group)


# [Note: all-reduce on gloo] A large sum / average all-reduce over three ranks or more is a
# reduce-scatter of the flattened tensor's ``torch.chunk`` blocks followed by an all-gather
# of the reduced blocks, both point to point ([Note: DTensor's collectives on gloo]): each
# element is summed once, on one rank, in rank order, and every rank receives the same bits.
# On the benchmark's 8 MiB tensor it took 0.76-0.82x gloo's all-reduce at 4 ranks. At 2
# ranks gloo's all-reduce is already an exchange of halves, and ours was 1.1-1.2x its time,
# so two ranks keep it; at 1 MiB and below the two round trips cost more than they save, so
# smaller tensors keep it too. docs/dtensor.md has the runs.
ALL_REDUCE_BLOCKS_MIN_BYTES = 4 << 20


def all_reduces_blocks(group, partial: Partial, local: torch.Tensor, k: int) -> bool:
    """Whether a redistribution's all-reduce of ``partial`` over ``group`` (``k`` ranks) is a
    point-to-point reduce-scatter plus all-gather ([Note: all-reduce on gloo]): gloo, three
    ranks or more, a sum or average, at least ``ALL_REDUCE_BLOCKS_MIN_BYTES``, not booleans."""
    return (
        k > 2
        and reduce_scatters_blocks(group, partial)
        and local.dtype != torch.bool
        and local.numel() * local.element_size() >= ALL_REDUCE_BLOCKS_MIN_BYTES
    )


def _pad_dim0(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.size(0) == size:
        return t.contiguous()
    pad = [0, 0] * (t.ndim - 1) + [0, size - t.size(0)]
    return F.pad(t, pad).contiguous()


def all_gather(
    local, mesh, mesh_dim: int, tensor_dim: int, full_size: int, *, async_op=False
) -> Pending:
    """Gather shards of a tensor dim of global size ``full_size`` into the full dim."""
    group = mesh.get_group(mesh_dim)
    k = mesh.size(mesh_dim)
    pad = padded_chunk_size(full_size, k)
    sizes = chunk_sizes(full_size, k)
    if gathers_blocks(group):
        row_bytes = pad * (local.numel() // max(local.size(tensor_dim), 1)) * local.element_size()
        debug.record("all_gather", _dim_label(mesh, mesh_dim), k, row_bytes, group=group)
        ws = _workspace.workspace_for_group(mesh, group)
        done = _gather_blocks(local, group, mesh.get_local_rank(mesh_dim), tensor_dim, sizes, ws)
        return done if async_op else Pending.ready(done.wait())
    x = _pad_dim0(local.movedim(tensor_dim, 0), pad)  # (pad, ...)
    gathered = all_gather_rows(x.reshape(1, -1), group, k, label=mesh_dim, mesh=mesh)

    def finish():
        return _unpad_gathered(gathered.wait().view(k * pad, *x.shape[1:]), sizes, tensor_dim)

    return Pending(None, finish) if async_op else Pending.ready(finish())


def _unpad_gathered(out: torch.Tensor, sizes: list[int], tensor_dim: int) -> torch.Tensor:
    """The gathered padded blocks ``(k * pad, ...)`` cut back to ``sizes``, the gathered dim
    moved back to ``tensor_dim``."""
    pad = out.size(0) // len(sizes)
    if any(s != pad for s in sizes):
        out = torch.cat([out[i * pad : i * pad + s] for i, s in enumerate(sizes)])
    return out.movedim(0, tensor_dim).contiguous()


def all_reduce(local, mesh, mesh_dim: int, partial: Partial, *, async_op=False) -> Pending:
    """Reduce partial values over the mesh dim; every rank gets the result."""
    group = mesh.get_group(mesh_dim)
    k = mesh.size(mesh_dim)
    if _is_product(partial):
        return _product_all_reduce(local, mesh, mesh_dim, async_op=async_op)
    ws = _workspace.workspace_for_group(mesh, group)
    if all_reduces_blocks(group, partial, local, k):
        nbytes = local.numel() * local.element_size()
        debug.record("all_reduce", _dim_label(mesh, mesh_dim), k, nbytes, group=group)
        flat, sizes, divide_by = _all_reduce_blocks_args(local, partial, k)
        idx = mesh.get_local_rank(mesh_dim)
        mine = _reduce_blocks(flat, group, idx, 0, sizes, divide_by, ws).wait()
        gathered = _gather_blocks(mine, group, idx, 0, sizes, ws)
        done = Pending(None, lambda: gathered.wait().view(local.shape))
        return done if async_op else Pending.ready(done.wait())
    x, reduction, finish_fn = _prepare_reduce(local, partial, k, ws)
    nbytes = x.numel() * x.element_size()
    debug.record("all_reduce", _dim_label(mesh, mesh_dim), k, nbytes, group=group)
    with debug.annotate_failures():
        work = dist.all_reduce(x, op=reduction.reduce_op, group=group, async_op=True)
    done = Pending(work, lambda: finish_fn(x))
    return done if async_op else Pending.ready(done.wait())


def _is_product(partial: Partial) -> bool:
    return type(partial) is Partial and partial.reduce_op == "product"


def _product_all_reduce(local, mesh, mesh_dim: int, *, async_op: bool) -> Pending:
    """``Partial("product")`` reduced: one all-reduce with ``ReduceOp.PRODUCT`` (gloo and
    NCCL both have it)."""
    group = mesh.get_group(mesh_dim)
    x = local.clone()
    nbytes = x.numel() * x.element_size()
    debug.record("all_reduce", _dim_label(mesh, mesh_dim), mesh.size(mesh_dim), nbytes, group=group)
    with debug.annotate_failures():
        work = dist.all_reduce(x, op=dist.ReduceOp.PRODUCT, group=group, async_op=True)
    done = Pending(work, lambda: x)
    return done if async_op else Pending.ready(done.wait())


def _all_reduce_blocks_args(local: torch.Tensor, partial: Partial, k: int):
    """(flat tensor, block sizes, divisor) for the block all-reduce."""
    flat = local.reshape(-1)
    divide_by = float(k) if partial.reduce_op == "avg" else 1.0
    return flat, chunk_sizes(flat.numel(), k), divide_by


def reduce_scatter(
    local, mesh, mesh_dim: int, tensor_dim: int, partial: Partial, *, async_op=False
) -> Pending:
    """Reduce partial values and keep this rank's ``torch.chunk`` shard of ``tensor_dim``:
    the blocks are padded into one row per rank and reduced with ``reduce_rows``."""
    group = mesh.get_group(mesh_dim)
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    full = local.size(tensor_dim)
    sizes = chunk_sizes(full, k)
    pad = padded_chunk_size(full, k)
    if _is_product(partial):  # rare: the whole product, then this rank's chunk
        reduced = _product_all_reduce(local, mesh, mesh_dim, async_op=async_op)
        start = chunk_offsets(full, k)[idx]

        def chunk():
            return reduced.wait().narrow(tensor_dim, start, sizes[idx]).contiguous()

        return Pending(None, chunk) if async_op else Pending.ready(chunk())
    if reduce_scatters_blocks(group, partial):
        nbytes = k * pad * (local.numel() // max(full, 1)) * local.element_size()
        debug.record("reduce_scatter", _dim_label(mesh, mesh_dim), k, nbytes, group=group)
        divide_by = reduction_of(partial, k).divide_by
        ws = _workspace.workspace_for_group(mesh, group)
        done = _reduce_blocks(local, group, idx, tensor_dim, sizes, divide_by, ws)
        return done if async_op else Pending.ready(done.wait())
    stacked = _stack_blocks(local, tensor_dim, sizes, pad)  # (k * pad, rest...)
    x, op, divide_by, post = _row_reduction(stacked.reshape(k, -1), partial, k)
    reduced = reduce_rows(x, idx, group, divide_by=divide_by, op=op, label=mesh_dim, mesh=mesh)

    def finish():
        out = post(reduced.wait()).view(pad, *stacked.shape[1:])
        return out[: sizes[idx]].movedim(0, tensor_dim).contiguous()

    return Pending(None, finish) if async_op else Pending.ready(finish())


def _stack_blocks(local: torch.Tensor, tensor_dim: int, sizes: list[int], pad: int):
    """The ``torch.chunk`` blocks of ``tensor_dim``, each padded to ``pad``, stacked along a
    leading dim: ``(k * pad, rest...)``, rank ``j``'s block at rows ``j * pad``."""
    moved = local.movedim(tensor_dim, 0)
    offsets = chunk_offsets(moved.size(0), len(sizes))
    return torch.cat([_pad_dim0(moved.narrow(0, o, s), pad) for o, s in zip(offsets, sizes)])


# --------------------------------------------------------------------------- gloo: blocks
# [Note: DTensor's collectives on gloo] A redistribution's all-gather and sum reduce-scatter
# exchange each rank's block point to point, in the tensor's own layout: no padding, no
# repeated rows, and the long-lived result is allocated before the buffers that die with the
# call (so freeing them leaves no hole under it; activations go through here every step).
# The reduction adds the ranks' blocks in rank order, as ``combine_rows`` does. The messages
# carry the tags of the "dtensor.redistribute" range reserved here ([Note: message tags]).
_TAGS = reserve_message_tags("dtensor.redistribute", 1)  # one block per peer


def _exchange(group, idx: int, k: int, send_to, recv_from) -> list:
    """Post one message per peer of the ``k`` ranks: ``send_to(j)`` goes to rank ``j``, and
    rank ``j``'s lands in ``recv_from(j)``. Blocks with no elements are not sent."""
    return exchange(group, idx, [(send_to, recv_from)], _TAGS)


def _buffer(ws, shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized buffer of ``shape`` with ``like``'s dtype and device: from the
    workspace ``ws`` when there is one ([Note: collective workspace]), else ``new_empty``."""
    if ws is None:
        return like.new_empty(shape)
    return ws.empty(shape, like.dtype, like.device)


def _block_shape(local: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(local.shape)
    shape[dim] = size
    return shape


def _gather_blocks(local, group, idx: int, dim: int, sizes: list[int], ws=None) -> Pending:
    """All-gather of the ``torch.chunk`` blocks of ``dim`` (``local`` is block ``idx``).
    Buffers come from ``ws`` (a ``Workspace``) when given ([Note: collective workspace])."""
    send = local if local.is_contiguous() else _buffer(ws, local.shape, local).copy_(local)
    full = _buffer(ws, _block_shape(local, dim, sum(sizes)), local)
    if dim == 0:  # each block is a contiguous run of the result: receive in place
        blocks = list(full.split(sizes, 0))
        blocks[idx].copy_(send)
    else:
        blocks = [
            send if j == idx else _buffer(ws, _block_shape(local, dim, s), local)
            for j, s in enumerate(sizes)
        ]
    works = _exchange(group, idx, len(sizes), lambda j: send, lambda j: blocks[j])

    def finish() -> torch.Tensor:
        for work in works:
            debug.wait_collective(work, point_to_point=True)
        if dim != 0:
            torch.cat(blocks, dim=dim, out=full)
        return full

    return Pending(None, finish)


def _reduce_blocks(local, group, idx: int, dim: int, sizes: list[int], divide_by: float, ws=None):
    """Sum reduce-scatter: rank ``j`` gets the rank-ordered sum of every rank's block ``j``
    of ``dim``, divided by ``divide_by``. Buffers come from ``ws`` when given."""
    offsets = chunk_offsets(sum(sizes), len(sizes))
    shape = _block_shape(local, dim, sizes[idx])
    out = _buffer(ws, shape, local)
    recv = [None if j == idx else _buffer(ws, shape, local) for j in range(len(sizes))]
    blocks = [local.narrow(dim, o, s) for o, s in zip(offsets, sizes)]
    sends = [
        b if j == idx or b.is_contiguous() else _buffer(ws, b.shape, b).copy_(b)
        for j, b in enumerate(blocks)
    ]
    works = _exchange(group, idx, len(sizes), lambda j: sends[j], lambda j: recv[j])

    def finish() -> torch.Tensor:
        for work in works:
            debug.wait_collective(work, point_to_point=True)
        parts = [sends[idx] if j == idx else recv[j] for j in range(len(sizes))]
        sum_into(out, parts)
        return out.div_(divide_by) if divide_by != 1 else out

    return Pending(None, finish)


def _row_reduction(rows: torch.Tensor, partial: Partial, k: int):
    """(rows to send, combine op, divisor, post-processing) for ``reduce_rows``."""
    r = reduction_of(partial, k)
    return r.before(rows), r.op, r.divide_by, lambda y: r.after(y, divide=False)


def all_to_all(
    local,
    mesh,
    mesh_dim: int,
    from_dim: int,
    to_dim: int,
    full_from: int,
    full_to: int,
    *,
    async_op=False,
) -> Pending:
    """Shard(from_dim) -> Shard(to_dim): every rank sends each peer that peer's ``to_dim`` chunk.

    ``local`` is sharded on ``from_dim`` (global size ``full_from``) and full on ``to_dim``
    (size ``full_to``). On gloo the blocks go point to point, unpadded ([Note: all-to-all on
    gloo]); elsewhere both dims are padded so every block has the same size.
    """
    group = mesh.get_group(mesh_dim)
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    if moves_shards_by_blocks(group):
        from_sizes, to_sizes = chunk_sizes(full_from, k), chunk_sizes(full_to, k)
        nbytes = local.numel() * local.element_size()
        debug.record("all_to_all", _dim_label(mesh, mesh_dim), k, nbytes, group=group)
        ws = _workspace.workspace_for_group(mesh, group)
        done = _all_to_all_blocks(local, group, idx, from_dim, to_dim, from_sizes, to_sizes, ws)
        return done if async_op else Pending.ready(done.wait())
    send = _all_to_all_send(local, k, from_dim, to_dim, full_from, full_to)
    recv = torch.empty_like(send)
    nbytes = send.numel() * send.element_size()
    debug.record("all_to_all", _dim_label(mesh, mesh_dim), k, nbytes, group=group)
    with debug.annotate_failures():
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def finish():
        return _all_to_all_unpack(recv, k, idx, from_dim, to_dim, full_from, full_to)

    done = Pending(work, finish)
    return done if async_op else Pending.ready(done.wait())


def _all_to_all_send(local, k: int, from_dim: int, to_dim: int, full_from: int, full_to: int):
    """The all-to-all's send buffer ``(k * pad_to, pad_from, rest...)``: ``local`` with
    ``to_dim`` first and ``from_dim`` second, both padded with zeros; block ``j`` along dim 0
    goes to rank ``j``. Each element is copied once, into its place in the buffer."""
    pad_from, pad_to = padded_chunk_size(full_from, k), padded_chunk_size(full_to, k)
    x = local.movedim((to_dim, from_dim), (0, 1))
    to_sizes = chunk_sizes(full_to, k)
    shape = (k, pad_to, pad_from, *x.shape[2:])
    padded = x.size(1) != pad_from or any(s != pad_to for s in to_sizes)
    send = x.new_zeros(shape) if padded else x.new_empty(shape)
    for j, (o, s) in enumerate(zip(chunk_offsets(full_to, k), to_sizes)):
        send[j, :s, : x.size(1)].copy_(x.narrow(0, o, s))
    return send.view(k * pad_to, *shape[2:])


def _all_to_all_unpack(recv, k: int, idx: int, from_dim, to_dim, full_from: int, full_to: int):
    """This rank's ``Shard(to_dim)`` piece out of the all-to-all's received buffer."""
    pad_from, pad_to = padded_chunk_size(full_from, k), padded_chunk_size(full_to, k)
    to_sizes, from_sizes = chunk_sizes(full_to, k), chunk_sizes(full_from, k)
    r = recv.view(k, pad_to, pad_from, *recv.shape[2:])[:, : to_sizes[idx]]
    parts = [r[i, :, : from_sizes[i]] for i in range(k)]  # from rank i: its from-chunk
    out = torch.cat(parts, dim=1)  # (to_chunk, full_from, rest...)
    return out.movedim((0, 1), (to_dim, from_dim)).contiguous()


# [Note: all-to-all on gloo] Shard(a) -> Shard(b) sends rank ``j`` the ``torch.chunk`` block
# ``j`` of dim ``b`` of the local shard, point to point ([Note: DTensor's collectives on
# gloo]), unpadded and in the tensor's own layout. The send blocks are the only copy when the
# output's blocks along ``a`` are contiguous runs of it (``a`` is the outermost dim of more
# than one element, e.g. Shard(0) -> Shard(1)): the received blocks land in place and this
# rank's own block is copied across. Otherwise they land in buffers and one ``cat`` builds the
# output. The padded all-to-all before it (padding both dims, through a transposed copy,
# then unpacking) took 5-8x as long on the benchmark's (2049, 1024) tensor; docs/dtensor.md.
def _all_to_all_blocks(
    local, group, idx: int, from_dim: int, to_dim: int, from_sizes, to_sizes, ws=None
) -> Pending:
    """Shard(from_dim) -> Shard(to_dim) by point-to-point blocks: ``local`` is block ``idx``
    of ``from_dim`` (``from_sizes``) and whole on ``to_dim`` (split as ``to_sizes``)."""
    shape = _block_shape(local, from_dim, sum(from_sizes))
    shape[to_dim] = to_sizes[idx]
    out = _buffer(ws, shape, local)  # the long-lived result first
    pieces = list(local.split(to_sizes, to_dim))  # piece j goes to rank j
    sends = [
        p if j == idx or p.is_contiguous() else _buffer(ws, p.shape, p).copy_(p)
        for j, p in enumerate(pieces)
    ]
    targets = list(out.split(from_sizes, from_dim))
    in_place = all(t.is_contiguous() for t in targets)
    if in_place:
        recv = targets
        recv[idx].copy_(pieces[idx])
    else:
        recv = [None if j == idx else _buffer(ws, t.shape, local) for j, t in enumerate(targets)]
    works = _exchange(group, idx, len(to_sizes), lambda j: sends[j], lambda j: recv[j])

    def finish() -> torch.Tensor:
        for work in works:
            debug.wait_collective(work, point_to_point=True)
        if not in_place:
            parts = [pieces[idx] if j == idx else r for j, r in enumerate(recv)]
            torch.cat(parts, dim=from_dim, out=out)
        return out

    return Pending(None, finish)


def broadcast(t: torch.Tensor, mesh, mesh_dim: int, src_local_rank: int) -> torch.Tensor:
    """Broadcast ``t`` (in place) from the mesh-dim-local rank ``src_local_rank``."""
    group = mesh.get_group(mesh_dim)
    src = mesh.ranks_along(mesh_dim)[src_local_rank]
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    debug.record("broadcast", _dim_label(mesh, mesh_dim), mesh.size(mesh_dim), nbytes, group=group)
    with debug.annotate_failures():
        debug.wait_collective(dist.broadcast(t, src=src, group=group, async_op=True))
    return t


def _prepare_reduce(local: torch.Tensor, partial: Partial, k: int, ws=None):
    """Buffer (from ``ws`` when given), ``Reduction`` and post-processing for reducing
    ``partial`` values over ``k`` ranks. Booleans (``any``/``all`` partials) travel as
    bytes: not every backend reduces bools."""
    if local.dtype == torch.bool:
        x, r, finish = _prepare_reduce(local.to(torch.uint8), partial, k)
        return x, r, lambda y: finish(y).to(torch.bool)
    r = reduction_of(partial, k)
    if r.op in ("max", "min") and local.is_floating_point():
        keys, back = _ordered_keys(local, r.op)
        x, r, finish = _prepare_reduce(keys, partial, k, ws)
        return x, r, lambda y: back(finish(y))
    x = r.before(_buffer(ws, local.shape, local).copy_(local), inplace=True)
    return x, r, r.after


# [Note: NaN in a max or min all-reduce] torch.amax / amin return NaN where any value is NaN;
# gloo's MAX and MIN compare with < and keep a NaN only in some operand orders, so a
# Partial("max") holding NaN on one rank came out NaN on some elements and a number on
# others. Floats therefore travel as integers ordered as the floats are (the sign-magnitude
# bits of a negative float reversed), a NaN as the integer above (max) or below (min) every
# other, and come back exactly; one collective of the same size, eager or traced.
_KEY_DTYPES = {torch.float64: torch.int64, torch.float32: torch.int32}


def _ordered_keys(x: torch.Tensor, op: str):
    """(integer keys of ``x`` whose max / min is that of ``x`` with NaN winning, function
    that turns reduced keys back into values of ``x``'s dtype)."""
    dtype = x.dtype
    wide = x if dtype in _KEY_DTYPES else x.float()  # halves widen exactly
    kind = _KEY_DTYPES[wide.dtype]
    info = torch.iinfo(kind)
    shift = info.bits - 1

    def flip(bits):  # an involution: float bits <-> ordered keys
        return bits ^ ((bits >> shift) & info.max)

    keys = flip(wide.contiguous().view(kind))
    keys = keys.masked_fill(torch.isnan(wide), info.max if op == "max" else info.min)
    return keys, lambda y: flip(y).view(wide.dtype).to(dtype)
