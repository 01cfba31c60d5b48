"""The redistribution collectives in a form ``torch.compile`` can put in a graph.

When AOTAutograd traces DTensor's dispatch (or dynamo runs it on fake tensors), the local
tensors have no data and ``torch.distributed``'s collectives cannot run on them. The
functional collectives (``torch.distributed._functional_collectives``) can: they are ops
that return new tensors, so the tracer records them in the graph, and the compiled code
runs them on the real process groups. This module gives the same four functions as
``dtensor._collectives`` (same arguments, a ``Pending`` back) built on them;
``dtensor._redistribute`` picks one module or the other per call (:func:`tracing`).

The results equal the eager path's; padding follows the same [Note: padding] (uneven
``torch.chunk`` shards are padded to equal blocks and cut back after the exchange).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from dtensor._collectives import Pending, _pad_dim0
from dtensor.placement import NormPartial, Partial, chunk_sizes, padded_chunk_size

# torch 2.13 names them *_single; older releases only have *_tensor.
_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` is being traced by torch.compile (fake or functional, no data)."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def all_gather(local, mesh, mesh_dim: int, tensor_dim: int, full_size: int, *, async_op=False):
    k = mesh.size(mesh_dim)
    pad = padded_chunk_size(full_size, k)
    x = _pad_dim0(local.movedim(tensor_dim, 0), pad)
    out = _gather(x, 0, mesh.get_group(mesh_dim))
    sizes = chunk_sizes(full_size, k)
    if any(s != pad for s in sizes):
        out = torch.cat([out[i * pad : i * pad + s] for i, s in enumerate(sizes)])
    return Pending.ready(out.movedim(0, tensor_dim).contiguous())


def _reduce_args(local: torch.Tensor, partial: Partial, k: int):
    """The tensor to reduce, the functional collective's op name, and the finishing step."""
    if local.dtype == torch.bool:
        x, op, finish = _reduce_args(local.to(torch.uint8), partial, k)
        return x, op, lambda y: finish(y).to(torch.bool)
    if isinstance(partial, NormPartial):
        p = partial.norm_type
        if p in (float("inf"), float("-inf")):
            return local, "max" if p > 0 else "min", lambda y: y
        if p == 0:
            return local, "sum", lambda y: y
        return local.pow(p), "sum", lambda y: y.pow(1.0 / p)
    op = partial.reduce_op
    if op == "avg":  # gloo has no average: sum, then divide
        return local, "sum", lambda y: y / k
    return local, op, lambda y: y


def all_reduce(local, mesh, mesh_dim: int, partial: Partial, *, async_op=False):
    x, op, finish = _reduce_args(local, partial, mesh.size(mesh_dim))
    return Pending.ready(finish(funcol.all_reduce(x.contiguous(), op, mesh.get_group(mesh_dim))))


def reduce_scatter(
    local, mesh, mesh_dim: int, tensor_dim: int, partial: Partial, *, async_op=False
):
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    full = local.size(tensor_dim)
    sizes, pad = chunk_sizes(full, k), padded_chunk_size(full, k)
    moved = local.movedim(tensor_dim, 0)
    stacked = torch.cat(
        [_pad_dim0(moved.narrow(0, sum(sizes[:i]), s), pad) for i, s in enumerate(sizes)]
    )
    x, op, finish = _reduce_args(stacked, partial, k)
    mine = finish(_reduce_scatter(x.contiguous(), op, 0, mesh.get_group(mesh_dim)))
    return Pending.ready(mine[: sizes[idx]].movedim(0, tensor_dim).contiguous())


def all_to_all(
    local, mesh, mesh_dim, from_dim, to_dim, full_from: int, full_to: int, *, async_op=False
):
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    pad_from, pad_to = padded_chunk_size(full_from, k), padded_chunk_size(full_to, k)
    to_sizes, from_sizes = chunk_sizes(full_to, k), chunk_sizes(full_from, k)
    x = local.movedim((to_dim, from_dim), (0, 1))  # block j along dim 0 goes to rank j
    blocks, offset = [], 0
    for s in to_sizes:
        blk = _pad_dim0(x.narrow(0, offset, s), pad_to)
        blocks.append(_pad_dim0(blk.transpose(0, 1), pad_from).transpose(0, 1))
        offset += s
    send = torch.cat(blocks).contiguous()  # (k * pad_to, pad_from, rest...)
    recv = funcol.all_to_all_single(send, None, None, mesh.get_group(mesh_dim))
    r = recv.view(k, pad_to, pad_from, *send.shape[2:])[:, : to_sizes[idx]]
    out = torch.cat([r[i, :, : from_sizes[i]] for i in range(k)], dim=1)
    return Pending.ready(out.movedim((0, 1), (to_dim, from_dim)).contiguous())
