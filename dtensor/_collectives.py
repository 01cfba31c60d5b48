"""Collectives over one mesh dim, with the padding that uneven ``torch.chunk`` shards need.

Each function takes the local tensor, the mesh and the mesh dim, and returns a ``Pending``:
the collective may still be running (``async_op=True``); ``Pending.wait()`` finishes it and
returns the result. Every call is reported to ``dtensor.debug``.

[Note: padding] gloo and NCCL need every rank to contribute the same number of elements.
A shard is padded along its tensor dim up to ``padded_chunk_size``; after an all-gather, each
rank's block is cut back to its real ``chunk_sizes`` entry.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor import debug
from dtensor.placement import NormPartial, Partial, chunk_sizes, padded_chunk_size

# torch 2.13 prefers the *_single names; older releases only have *_tensor.


def _first_available(*names: str):
    """The first of ``names`` that this torch's ``torch.distributed`` has: collective
    functions were renamed across releases (the GPU machines run 2.11, this one 2.13)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}; this torch is too old.")


_all_gather_flat = _first_available(
    "all_gather_single", "all_gather_into_tensor", "_all_gather_base"
)
_reduce_scatter_flat = _first_available(
    "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"
)


class Pending:
    """A collective result that may not be ready; ``wait()`` returns the finished tensor."""

    __slots__ = ("_work", "_finish", "_result")

    def __init__(self, work, finish: Callable[[], torch.Tensor]) -> None:
        self._work = work
        self._finish = finish
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._finish = None
        return self._result

    @staticmethod
    def ready(t: torch.Tensor) -> Pending:
        return Pending(None, lambda: t)


def _backend_is_gloo(group) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


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
    x = _pad_dim0(local.movedim(tensor_dim, 0), pad)  # (pad, ...)
    out = x.new_empty((k * pad, *x.shape[1:]))
    debug.record("all_gather", _dim_label(mesh, mesh_dim), k, x.numel() * x.element_size())
    work = _all_gather_flat(out, x, group=group, async_op=async_op)
    sizes = chunk_sizes(full_size, k)

    def finish():
        if all(s == pad for s in sizes):
            full = out
        else:
            full = torch.cat([out[i * pad : i * pad + s] for i, s in enumerate(sizes)])
        return full.movedim(0, tensor_dim).contiguous()

    return Pending(work, finish) if async_op else Pending.ready(finish())


def all_reduce(local, mesh, mesh_dim: int, partial: Partial, *, async_op=False) -> Pending:
    """Reduce partial values over the mesh dim; every rank gets the result."""
    group = mesh.get_group(mesh_dim)
    k = mesh.size(mesh_dim)
    x, op, finish_fn = _prepare_reduce(local, partial, k)
    debug.record("all_reduce", _dim_label(mesh, mesh_dim), k, x.numel() * x.element_size())
    work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
    if async_op:
        return Pending(work, lambda: finish_fn(x))
    return Pending.ready(finish_fn(x))


def reduce_scatter(
    local, mesh, mesh_dim: int, tensor_dim: int, partial: Partial, *, async_op=False
) -> Pending:
    """Reduce partial values and keep this rank's ``torch.chunk`` shard of ``tensor_dim``.

    On gloo, ``reduce_scatter`` is itself emulated with an all-reduce, and measured slower
    than an all-reduce followed by a local slice, so that is what we do there.
    """
    group = mesh.get_group(mesh_dim)
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    full = local.size(tensor_dim)
    sizes = chunk_sizes(full, k)
    start = sum(sizes[:idx])
    if _backend_is_gloo(group):
        x, op, finish_fn = _prepare_reduce(local, partial, k)
        debug.record("reduce_scatter", _dim_label(mesh, mesh_dim), k, x.numel() * x.element_size())
        work = dist.all_reduce(x, op=op, group=group, async_op=async_op)

        def finish():
            return finish_fn(x).narrow(tensor_dim, start, sizes[idx]).clone()

        return Pending(work, finish) if async_op else Pending.ready(finish())
    pad = padded_chunk_size(full, k)
    moved = local.movedim(tensor_dim, 0)
    blocks = [_pad_dim0(moved.narrow(0, sum(sizes[:i]), s), pad) for i, s in enumerate(sizes)]
    x, op, finish_fn = _prepare_reduce(torch.cat(blocks), partial, k)
    out = x.new_empty((pad, *x.shape[1:]))
    debug.record("reduce_scatter", _dim_label(mesh, mesh_dim), k, x.numel() * x.element_size())
    work = _reduce_scatter_flat(out, x, op=op, group=group, async_op=async_op)

    def finish_nccl():
        return finish_fn(out)[: sizes[idx]].movedim(0, tensor_dim).contiguous()

    return Pending(work, finish_nccl) if async_op else Pending.ready(finish_nccl())


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
    (size ``full_to``). Both dims are padded so every block has the same size.
    """
    group = mesh.get_group(mesh_dim)
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    pad_from, pad_to = padded_chunk_size(full_from, k), padded_chunk_size(full_to, k)
    to_sizes, from_sizes = chunk_sizes(full_to, k), chunk_sizes(full_from, k)
    # (to, from, rest...) with both dims padded: block j along dim 0 goes to rank j.
    x = local.movedim((to_dim, from_dim), (0, 1))
    blocks = []
    offset = 0
    for s in to_sizes:
        blk = _pad_dim0(x.narrow(0, offset, s), pad_to)
        blk = _pad_dim0(blk.transpose(0, 1), pad_from).transpose(0, 1)
        blocks.append(blk)
        offset += s
    send = torch.cat(blocks).contiguous()  # (k * pad_to, pad_from, rest...)
    recv = torch.empty_like(send)
    debug.record("all_to_all", _dim_label(mesh, mesh_dim), k, send.numel() * send.element_size())
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)

    def finish():
        r = recv.view(k, pad_to, pad_from, *send.shape[2:])[:, : to_sizes[idx]]
        parts = [r[i, :, : from_sizes[i]] for i in range(k)]  # from rank i: its from-chunk
        out = torch.cat(parts, dim=1)  # (to_chunk, full_from, rest...)
        return out.movedim((0, 1), (to_dim, from_dim)).contiguous()

    return Pending(work, finish) if async_op else Pending.ready(finish())


def broadcast(t: torch.Tensor, mesh, mesh_dim: int, src_local_rank: int) -> torch.Tensor:
    """Broadcast ``t`` (in place) from the mesh-dim-local rank ``src_local_rank``."""
    group = mesh.get_group(mesh_dim)
    src = mesh.ranks_along(mesh_dim)[src_local_rank]
    t = t.contiguous()
    debug.record(
        "broadcast", _dim_label(mesh, mesh_dim), mesh.size(mesh_dim), t.numel() * t.element_size()
    )
    dist.broadcast(t, src=src, group=group)
    return t


def _prepare_reduce(local: torch.Tensor, partial: Partial, k: int):
    """Buffer, ReduceOp and post-processing for reducing ``partial`` values over ``k`` ranks."""
    x = local.contiguous().clone()
    if isinstance(partial, NormPartial):
        p = partial.norm_type
        if p == float("inf"):
            return x, dist.ReduceOp.MAX, lambda y: y
        if p == float("-inf"):
            return x, dist.ReduceOp.MIN, lambda y: y
        if p == 0:
            return x, dist.ReduceOp.SUM, lambda y: y
        return x.pow_(p), dist.ReduceOp.SUM, lambda y: y.pow_(1.0 / p)
    op = partial.reduce_op
    if op == "sum":
        return x, dist.ReduceOp.SUM, lambda y: y
    if op == "avg":  # gloo has no AVG: sum, then divide
        return x, dist.ReduceOp.SUM, lambda y: y.div_(k)
    if op == "max":
        return x, dist.ReduceOp.MAX, lambda y: y
    return x, dist.ReduceOp.MIN, lambda y: y


def _dim_label(mesh, mesh_dim: int):
    names = mesh.mesh_dim_names
    return names[mesh_dim] if names else mesh_dim
