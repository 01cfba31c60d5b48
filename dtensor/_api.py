"""Building DTensors from full tensors, modules and factories."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from device_mesh import as_device_mesh
from dtensor import _collectives as C
from dtensor import debug
from dtensor._redistribute import local_chunk, replicate_to_partial
from dtensor._spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.placement import (
    Partial,
    _StridedShard,
    chunk_sizes,
    is_shard_like,
    normalize_placements,
    padded_chunk_size,
)
from dtensor.tensor import DTensor, is_torch_dtensor, torch_dtensor_message


def distribute_tensor(
    tensor: torch.Tensor, device_mesh=None, placements=None, *, src_data_rank: int | None = 0
) -> DTensor:
    """Split a full tensor over ``device_mesh`` according to ``placements``.

    With ``src_data_rank=k`` (default 0) the data of the rank at index ``k`` of every mesh
    dim is sent out (scatter for shards, broadcast for replicas), so other ranks' ``tensor``
    contents do not matter, only its shape. With ``src_data_rank=None`` every rank slices
    its own ``tensor`` (no communication; all ranks must hold the same data).

    Returns a leaf DTensor with ``requires_grad`` copied from ``tensor``.

    Raises:
        ValueError: no mesh, wrong placements.

    Example:
        >>> dt = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])   # 2 ranks: 4 + 3 rows
    """
    api = "distribute_tensor"
    if device_mesh is None:
        raise ValueError(f"{api}: device_mesh is required, got None. Pass the mesh.")
    device_mesh = as_device_mesh(device_mesh, api=api, argument="device_mesh")
    if isinstance(tensor, DTensor):
        raise TypeError(f"{api}: tensor is already a DTensor; use tensor.redistribute(...).")
    if is_torch_dtensor(tensor):
        raise TypeError(torch_dtensor_message(api, "tensor", tensor))
    placements = normalize_placements(placements, device_mesh.ndim, tensor.ndim, api=api)
    if src_data_rank is not None and not 0 <= src_data_rank < min(device_mesh.shape):
        raise ValueError(
            f"{api}: src_data_rank must be in [0, {min(device_mesh.shape)}) or "
            f"None, got {src_data_rank!r}."
        )
    local = tensor.detach()
    # plain shards in mesh-dim order, then the strided ones that split inside them
    order = sorted(range(len(placements)), key=lambda i: isinstance(placements[i], _StridedShard))
    for mesh_dim in order:
        p = placements[mesh_dim]
        if src_data_rank is None or device_mesh.size(mesh_dim) == 1:
            if is_shard_like(p):
                local = local_chunk(
                    local, p.dim, device_mesh.size(mesh_dim), device_mesh.get_local_rank(mesh_dim)
                )
        elif is_shard_like(p):
            local = _scatter(local, device_mesh, mesh_dim, p.dim, src_data_rank)
        else:
            local = _broadcast(local, device_mesh, mesh_dim, src_data_rank)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            local = replicate_to_partial(local, p, device_mesh.get_local_rank(mesh_dim))
    local = local.contiguous() if local is not tensor else local.clone()
    spec = DTensorSpec(
        device_mesh,
        placements,
        TensorMeta(tensor.shape, contiguous_stride(tensor.shape), tensor.dtype),
    )
    return DTensor(local, spec, requires_grad=tensor.requires_grad)


def _broadcast(t, mesh, mesh_dim, src):
    t = t.contiguous().clone()
    group = mesh.get_group(mesh_dim)
    nbytes = t.numel() * t.element_size()
    debug.record("broadcast", mesh_dim, mesh.size(mesh_dim), nbytes, group=group)
    with debug.annotate_failures():
        dist.broadcast(t, src=mesh.ranks_along(mesh_dim)[src], group=group)
    return t


def _scatter(t, mesh, mesh_dim, tensor_dim, src):
    """Scatter ``torch.chunk`` pieces of ``t`` along ``tensor_dim`` from local rank ``src``."""
    k = mesh.size(mesh_dim)
    n = t.size(tensor_dim)
    pad = padded_chunk_size(n, k)
    sizes = chunk_sizes(n, k)
    moved = t.movedim(tensor_dim, 0)
    me = mesh.get_local_rank(mesh_dim)
    out = moved.new_empty((pad, *moved.shape[1:]))
    pieces = None
    if me == src:
        pieces, start = [], 0
        for s in sizes:
            piece = moved.narrow(0, start, s)
            pieces.append(F.pad(piece, [0, 0] * (piece.ndim - 1) + [0, pad - s]).contiguous())
            start += s
    group = mesh.get_group(mesh_dim)
    debug.record("scatter", mesh_dim, k, out.numel() * out.element_size(), group=group)
    with debug.annotate_failures():
        dist.scatter(out, pieces, src=mesh.ranks_along(mesh_dim)[src], group=group)
    return out[: sizes[me]].movedim(0, tensor_dim).contiguous()


def distribute_module(
    module: nn.Module, device_mesh=None, partition_fn=None, input_fn=None, output_fn=None
) -> nn.Module:
    """Turn a module's parameters and buffers into DTensors and hook its inputs/outputs.

    ``partition_fn(name, submodule, mesh)`` distributes each submodule's parameters as it
    likes; parameters and buffers it leaves as plain tensors are replicated.
    ``input_fn(module, inputs, mesh)`` and ``output_fn(module, outputs, mesh)`` become a
    forward pre-hook and a forward hook.

    Example:
        >>> distribute_module(model, mesh)   # every parameter becomes a replicated DTensor
    """
    if device_mesh is None:
        raise ValueError("distribute_module: device_mesh is required, got None.")
    device_mesh = as_device_mesh(device_mesh, api="distribute_module", argument="device_mesh")
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, device_mesh)
        for pname, p in list(sub.named_parameters(recurse=False)):
            if p is not None and not isinstance(p, DTensor):
                full = distribute_tensor(p.data, device_mesh, None)
                sub.register_parameter(pname, nn.Parameter(full, p.requires_grad))
        for bname, b in list(sub.named_buffers(recurse=False)):
            if b is not None and not isinstance(b, DTensor):
                sub._buffers[bname] = distribute_tensor(b, device_mesh, None)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda m, inputs: input_fn(m, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda m, inputs, out: output_fn(m, out, device_mesh))
    return module


def _factory(fill, size, device_mesh, placements, dtype, requires_grad, api):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    shape = torch.Size(size)
    if device_mesh is None:
        raise ValueError(f"{api}: device_mesh is required, got None.")
    device_mesh = as_device_mesh(device_mesh, api=api, argument="device_mesh")
    placements = normalize_placements(placements, device_mesh.ndim, len(shape), api=api)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            f"{api}: placements must be Shard or Replicate, got "
            f"{placements}. Factories build known values, not partials."
        )
    dtype = dtype or torch.get_default_dtype()
    spec = DTensorSpec(device_mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype))
    local_shape, _ = spec.local_shape_and_offset()
    local = fill(local_shape, dtype, spec, _mesh_device(device_mesh))
    return DTensor(local, spec, requires_grad=requires_grad)


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def zeros(*size, device_mesh=None, placements=None, dtype=None, requires_grad=False):
    """A DTensor of zeros, each rank allocating only its own block.

    Example:
        >>> z = zeros(7, 5, device_mesh=mesh, placements=[Shard(0)])   # mesh of 2 ranks
        >>> z.to_local().shape   # torch.chunk rows: 4 on rank 0, 3 on rank 1
        torch.Size([4, 5])
    """
    return _factory(
        lambda s, d, _, dev: torch.zeros(s, dtype=d, device=dev),
        size,
        device_mesh,
        placements,
        dtype,
        requires_grad,
        "dtensor.zeros",
    )


def ones(*size, device_mesh=None, placements=None, dtype=None, requires_grad=False):
    """A DTensor of ones (placements default to ``Replicate()`` on every mesh dim).

    Example:
        >>> ones(4, device_mesh=mesh).full_tensor()
        tensor([1., 1., 1., 1.])
    """
    return _factory(
        lambda s, d, _, dev: torch.ones(s, dtype=d, device=dev),
        size,
        device_mesh,
        placements,
        dtype,
        requires_grad,
        "dtensor.ones",
    )


def empty(*size, device_mesh=None, placements=None, dtype=None, requires_grad=False):
    """An uninitialized DTensor (fill it in place before reading it).

    Example:
        >>> e = empty(4, 4, device_mesh=mesh, placements=[Shard(1)])
        >>> e.fill_(0.5).full_tensor().sum()
        tensor(8.)
    """
    return _factory(
        lambda s, d, _, dev: torch.empty(s, dtype=d, device=dev),
        size,
        device_mesh,
        placements,
        dtype,
        requires_grad,
        "dtensor.empty",
    )


def full(size, fill_value, *, device_mesh=None, placements=None, dtype=None, requires_grad=False):
    """A DTensor filled with ``fill_value``; ``size`` is one tuple, as for ``torch.full``.

    Example:
        >>> full((2, 3), 7.0, device_mesh=mesh).full_tensor()[0]
        tensor([7., 7., 7.])
    """
    return _factory(
        lambda s, d, _, dev: torch.full(s, fill_value, dtype=d, device=dev),
        tuple(size),
        device_mesh,
        placements,
        dtype,
        requires_grad,
        "dtensor.full",
    )


def _random(draw):
    """Draw the full tensor from one RNG stream shared by the mesh and keep the local piece.

    The mesh's first rank's generator state is broadcast to every rank first (one small
    broadcast per mesh dim), so replicas hold equal values and shards are slices of one
    draw even when ranks were seeded differently; on the first rank the result equals
    ``torch.rand``/``torch.randn`` of the global shape, and afterwards every rank's
    generator is in the state the first rank's is in.
    """

    def fill(local_shape, dtype, spec, device):
        sync_rng_state(spec.mesh, device)
        full_t = draw(tuple(spec.shape), dtype=dtype, device=device)
        _, offset = spec.local_shape_and_offset()
        idx = tuple(slice(o, o + s) for o, s in zip(offset, local_shape))
        return full_t[idx].clone()

    return fill


def sync_rng_state(mesh, device: torch.device) -> None:
    """Give every rank of ``mesh`` the default generator state of its first rank.

    Example:
        >>> torch.manual_seed(dist.get_rank())   # ranks disagree...
        >>> sync_rng_state(mesh, torch.device("cpu"))
        >>> torch.rand(3)                         # ...and now draw the same values
    """
    if all(s == 1 for s in mesh.shape):
        return
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    wire = state.to(device) if cuda else state.clone()
    for mesh_dim in range(mesh.ndim):
        if mesh.size(mesh_dim) > 1:
            wire = C.broadcast(wire, mesh, mesh_dim, 0)
    if cuda:
        torch.cuda.set_rng_state(wire.cpu(), device)
    else:
        torch.set_rng_state(wire)


def rand(*size, device_mesh=None, placements=None, dtype=None, requires_grad=False):
    """Uniform [0, 1) values, equal to ``torch.rand(size)`` under the same seed.

    Example:
        >>> torch.manual_seed(0); r = rand(6, device_mesh=mesh, placements=[Shard(0)])
        >>> torch.manual_seed(0); torch.equal(r.full_tensor(), torch.rand(6))
        True
    """
    return _factory(
        _random(torch.rand), size, device_mesh, placements, dtype, requires_grad, "dtensor.rand"
    )


def randn(*size, device_mesh=None, placements=None, dtype=None, requires_grad=False):
    """Standard normal values, equal to ``torch.randn(size)`` under the same seed.

    Example:
        >>> torch.manual_seed(0); w = randn(8, 4, device_mesh=mesh, placements=[Shard(0)])
        >>> torch.manual_seed(0); torch.equal(w.full_tensor(), torch.randn(8, 4))
        True
    """
    return _factory(
        _random(torch.randn), size, device_mesh, placements, dtype, requires_grad, "dtensor.randn"
    )
