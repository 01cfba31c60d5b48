"""A DTensor's layout and local tensor, for libraries built on DTensor (fsdp2).

``DTensor.from_local`` / ``to_local`` are the user-facing way in and out of a DTensor; both
are differentiable, check their arguments against the mesh, and may redistribute. A library
that keeps DTensors of its own (fsdp2's sharded parameters, the tensor-parallel views of its
unsharded ones) needs the plain operations underneath, and uses these names for them:

* ``DTensorSpec`` / ``TensorMeta``: where a DTensor lives, how it is laid out, its global
  shape, stride and dtype (``spec_of`` reads a DTensor's);
* ``from_spec``: a DTensor over a local tensor, no autograd edge and no collective;
* ``local_of`` / ``set_local``: read or replace the local tensor of a DTensor in place (a
  pinned copy of a CPU shard), checked to keep the spec's local shape and dtype.

The implementation of the spec is ``dtensor._spec``; only the names here are public.

Example::

    >>> spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32))
    >>> dt = from_spec(torch.zeros(4, 4), spec)       # rank 0 of 2: rows 0-3
    >>> spec_of(dt) == spec, local_of(dt).shape
    (True, torch.Size([4, 4]))
"""

from __future__ import annotations

import torch

from dtensor._spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.tensor import DTensor

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "contiguous_stride",
    "from_spec",
    "local_of",
    "set_local",
    "spec_of",
]


def spec_of(dt: DTensor) -> DTensorSpec:
    """``dt``'s ``DTensorSpec`` (mesh, placements, global meta).

    Example::

        >>> spec_of(distribute_tensor(torch.ones(4), mesh, [Shard(0)])).placements
        (Shard(dim=0),)
    """
    return dt._spec


def from_spec(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
    """A DTensor laid out as ``spec`` over ``local`` (which it does not copy): no autograd
    edge to ``local`` and no collective. ``local`` must be this rank's piece of ``spec``.

    Example::

        >>> dt = from_spec(torch.zeros(4, 4), spec)
        >>> dt.shape
        torch.Size([8, 4])
    """
    return DTensor(local, spec, requires_grad=requires_grad)


def local_of(dt: DTensor) -> torch.Tensor:
    """The local tensor of ``dt`` itself (not a view, no autograd edge), once any async
    redistribution that produces it has finished.

    Example::

        >>> local_of(dt).data_ptr() == local.data_ptr()
        True
    """
    return dt._local()


def set_local(dt: DTensor, local: torch.Tensor) -> None:
    """Make ``local`` the local tensor of ``dt`` (e.g. a pinned copy of a CPU shard). It
    must have the current local tensor's shape, dtype and device type.

    Raises:
        ValueError: ``local`` differs in shape, dtype or device type.

    Example::

        >>> set_local(dt, local_of(dt).pin_memory())
    """
    current = dt._local()
    if (local.shape, local.dtype, local.device.type) != (
        current.shape,
        current.dtype,
        current.device.type,
    ):
        raise ValueError(
            "set_local: the new local tensor must match the current one, which is "
            f"{tuple(current.shape)} {current.dtype} on {current.device.type}; got "
            f"{tuple(local.shape)} {local.dtype} on {local.device.type}."
        )
    dt._local_tensor = local
