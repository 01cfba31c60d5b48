"""The redistribution collectives in a form ``torch.compile`` can put in a graph.

When AOTAutograd traces DTensor's dispatch (or dynamo runs it on fake tensors), the local
tensors have no data and ``torch.distributed``'s collectives cannot run on them. Graph ops
can: they return new tensors, so the tracer records them, and the compiled code runs them on
the real process groups. This module gives the same four functions as
``dtensor._collectives`` (same arguments, a ``Pending`` back) built on graph ops;
``dtensor._redistribute`` picks one module or the other per call (:func:`tracing`).

Each function puts on the wire exactly what its eager twin puts there ([Note: one wire form
per collective] in ``dtensor/_collectives.py``), so a rank running a compiled graph and a
rank that fell back to eager still meet:

* a collective the eager path issues as one ``torch.distributed`` call (all-reduce,
  and on NCCL all-to-all, all-gather and sum reduce-scatter) becomes the matching
  functional collective (``torch.distributed._functional_collectives``) on a buffer packed
  by the same helper;
* the point-to-point block exchanges of gloo (all-gather, sum / average reduce-scatter,
  all-to-all, and a large sum / average all-reduce as a reduce-scatter plus an all-gather;
  [Note: DTensor's collectives on gloo]) have no functional form: they become
  the custom ops ``fsdp2_lite::gather_blocks``, ``fsdp2_lite::reduce_blocks`` and
  ``fsdp2_lite::all_to_all_blocks``, whose kernels are the
  eager exchanges themselves. Graphs keep them even when their result is unused (marked as
  having side effects), as an eager rank still sends its blocks.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

from dtensor import _collectives as E
from dtensor import _flight
from dtensor._collectives import Pending
from dtensor.comm import reduction_of
from dtensor.placement import Partial, chunk_sizes, padded_chunk_size

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


# ------------------------------------------------------------- gloo's block exchanges as ops
@torch.library.custom_op("fsdp2_lite::gather_blocks", mutates_args=())
def gather_blocks(
    local: torch.Tensor, group_name: str, local_rank: int, tensor_dim: int, sizes: list[int]
) -> torch.Tensor:
    """The eager point-to-point all-gather of ``torch.chunk`` blocks (``sizes``) along
    ``tensor_dim``, as a graph op; ``local`` is block ``local_rank`` of the group."""
    group = _resolve_process_group(group_name)
    return E._gather_blocks(local, group, local_rank, tensor_dim, sizes).wait()


@gather_blocks.register_fake
def _gather_blocks_shape(local, group_name, local_rank, tensor_dim, sizes):
    shape = list(local.shape)
    shape[tensor_dim] = sum(sizes)
    return local.new_empty(shape)


@torch.library.custom_op("fsdp2_lite::reduce_blocks", mutates_args=())
def reduce_blocks(
    local: torch.Tensor,
    group_name: str,
    local_rank: int,
    tensor_dim: int,
    sizes: list[int],
    divide_by: float,
) -> torch.Tensor:
    """The eager point-to-point sum reduce-scatter of ``local``'s ``torch.chunk`` blocks
    along ``tensor_dim`` (divided by ``divide_by``), as a graph op."""
    group = _resolve_process_group(group_name)
    return E._reduce_blocks(local, group, local_rank, tensor_dim, sizes, divide_by).wait()


@reduce_blocks.register_fake
def _reduce_blocks_shape(local, group_name, local_rank, tensor_dim, sizes, divide_by):
    shape = list(local.shape)
    shape[tensor_dim] = sizes[local_rank]
    return local.new_empty(shape)


@torch.library.custom_op("fsdp2_lite::all_to_all_blocks", mutates_args=())
def all_to_all_blocks(
    local: torch.Tensor,
    group_name: str,
    local_rank: int,
    from_dim: int,
    to_dim: int,
    from_sizes: list[int],
    to_sizes: list[int],
) -> torch.Tensor:
    """The eager point-to-point Shard(from_dim) -> Shard(to_dim) ([Note: all-to-all on
    gloo]) as a graph op; ``local`` is block ``local_rank`` of ``from_dim``."""
    group = _resolve_process_group(group_name)
    return E._all_to_all_blocks(
        local, group, local_rank, from_dim, to_dim, from_sizes, to_sizes
    ).wait()


@all_to_all_blocks.register_fake
def _all_to_all_blocks_shape(local, group_name, local_rank, from_dim, to_dim, from_sizes, to_sizes):
    shape = list(local.shape)
    shape[from_dim] = sum(from_sizes)
    shape[to_dim] = to_sizes[local_rank]
    return local.new_empty(shape)


# Dead-code elimination must not drop an exchange whose result the graph does not use: the
# peers (eager or compiled) send and wait all the same.
for _op in (
    torch.ops.fsdp2_lite.gather_blocks,
    torch.ops.fsdp2_lite.reduce_blocks,
    torch.ops.fsdp2_lite.all_to_all_blocks,
):
    torch.fx.node.has_side_effect(_op.default)
del _op


# ------------------------------------------------------------------------ the four collectives
def all_gather(local, mesh, mesh_dim: int, tensor_dim: int, full_size: int, *, async_op=False):
    group = mesh.get_group(mesh_dim)
    _flight.untracked(group)  # compiled collectives are not recorded
    k = mesh.size(mesh_dim)
    sizes = chunk_sizes(full_size, k)
    if E.gathers_blocks(group):
        idx = mesh.get_local_rank(mesh_dim)
        return Pending.ready(gather_blocks(local, group.group_name, idx, tensor_dim, sizes))
    x = E._pad_dim0(local.movedim(tensor_dim, 0), padded_chunk_size(full_size, k))
    return Pending.ready(E._unpad_gathered(_gather(x, 0, group), sizes, tensor_dim))


def all_reduce(local, mesh, mesh_dim: int, partial: Partial, *, async_op=False):
    group, k = mesh.get_group(mesh_dim), mesh.size(mesh_dim)
    _flight.untracked(group)  # compiled collectives are not recorded
    if E.all_reduces_blocks(group, partial, local, k):
        flat, sizes, divide_by = E._all_reduce_blocks_args(local, partial, k)
        idx = mesh.get_local_rank(mesh_dim)
        mine = reduce_blocks(flat, group.group_name, idx, 0, sizes, divide_by)
        full = gather_blocks(mine, group.group_name, idx, 0, sizes)
        return Pending.ready(full.view(local.shape))
    x, reduction, finish = E._prepare_reduce(local, partial, k)
    return Pending.ready(finish(funcol.all_reduce(x, reduction.op, group)))


def reduce_scatter(
    local, mesh, mesh_dim: int, tensor_dim: int, partial: Partial, *, async_op=False
):
    group = mesh.get_group(mesh_dim)
    _flight.untracked(group)  # compiled collectives are not recorded
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    full = local.size(tensor_dim)
    sizes, pad = chunk_sizes(full, k), padded_chunk_size(full, k)
    if E.reduce_scatters_blocks(group, partial):
        divide_by = reduction_of(partial, k).divide_by
        return Pending.ready(
            reduce_blocks(local, group.group_name, idx, tensor_dim, sizes, divide_by)
        )
    stacked = E._stack_blocks(local, tensor_dim, sizes, pad)  # (k * pad, rest...)
    rows, op, divide_by, post = E._row_reduction(stacked.reshape(k, -1), partial, k)
    if k == 1:  # as reduce_rows: nothing to exchange
        mine = E.combine_rows(rows, divide_by, op)
    elif E.reduces_rows_by_all_to_all(group, op):
        recv = funcol.all_to_all_single(rows.contiguous(), None, None, group)
        mine = E.combine_rows(recv.view(rows.shape), divide_by, op)
    else:
        mine = _reduce_scatter(rows.reshape(-1), "sum", 0, group)
        mine = mine / divide_by if divide_by != 1 else mine
    out = post(mine).view(pad, *stacked.shape[1:])
    return Pending.ready(out[: sizes[idx]].movedim(0, tensor_dim).contiguous())


def all_to_all(
    local, mesh, mesh_dim, from_dim, to_dim, full_from: int, full_to: int, *, async_op=False
):
    group = mesh.get_group(mesh_dim)
    _flight.untracked(group)  # compiled collectives are not recorded
    k = mesh.size(mesh_dim)
    idx = mesh.get_local_rank(mesh_dim)
    if E.moves_shards_by_blocks(group):
        from_sizes, to_sizes = chunk_sizes(full_from, k), chunk_sizes(full_to, k)
        return Pending.ready(
            all_to_all_blocks(local, group.group_name, idx, from_dim, to_dim, from_sizes, to_sizes)
        )
    send = E._all_to_all_send(local, k, from_dim, to_dim, full_from, full_to)
    recv = funcol.all_to_all_single(send, None, None, group)
    return Pending.ready(E._all_to_all_unpack(recv, k, idx, from_dim, to_dim, full_from, full_to))
