"""Our DTensor inside PyTorch's own checkpoint code.

A program part-way through a port may keep ``torch.distributed.checkpoint`` (DCP), its
state-dict helpers (``torch.distributed.checkpoint.state_dict``) and ``torch.save`` /
``torch.load`` while its tensors are already ours. PyTorch's code asks three things of them:

- DCP's planners ask any tensor for ``__create_write_items__``, ``__create_chunk_list__``
  and ``__get_tensor_shard__`` (its checkpointable protocol): ``DTensor`` answers them
  itself (``dtensor/tensor.py``), one box of the global tensor per rank.
- ``torch.load(weights_only=True)`` unpickles only allowlisted classes: ``install`` adds
  ours (the mesh's own entries are ``device_mesh``'s to add).
- The state-dict helpers recognise a sharded tensor by ``isinstance(x, <PyTorch's
  DTensor>)`` only, and call nothing on any other tensor: ``install`` wraps them
  ([Note: PyTorch's state-dict helpers and our DTensor]).
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from dtensor._spec import DTensorSpec, TensorMeta
from dtensor.placement import (
    NormPartial,
    Partial,
    Replicate,
    Shard,
    _StridedShard,
)
from dtensor.tensor import DTensor

logger = logging.getLogger(__name__)

# [Note: PyTorch's state-dict helpers and our DTensor] PyTorch's get/set_model_state_dict,
# get/set_optimizer_state_dict and get/set_state_dict do their tensor work in a few helpers
# of ``torch.distributed._state_dict_utils``: ``_gather_state_dict`` (full_state_dict),
# ``_broadcast_state_dict`` (broadcast_from_rank0; its per-key ``_broadcast_tensors`` too, so
# one full tensor at a time is held), ``_distribute_state_dict`` (full state
# dict on every rank) and ``_create_cpu_state_dict`` (staging for async saves). Each picks
# its sharded path with ``isinstance(x, torch.distributed.tensor.DTensor)``; every other
# tensor is taken as a plain local tensor and, with full_state_dict, passes through the
# identity: no ``__torch_function__`` (ours is disabled, and would not be called anyway),
# no aten op, no ``full_tensor`` ever reaches our DTensor, so no hook on the tensor can
# notice that a gather was asked. What they returned was our sharded DTensor where full
# tensors were asked, or a full plain tensor where a shard was expected. ``install`` wraps
# exactly those helpers, in ``_state_dict_utils`` and in the PyTorch modules that imported
# them by name: a wrapper does our part for our DTensors (gather them to full tensors,
# shard a full tensor into the spec of the DTensor it replaces) and leaves the rest,
# PyTorch's own DTensors included, to the original. A state dict without our DTensors costs
# one walk over its containers and behaves exactly as before.

# PyTorch modules that bind the helpers by name (``from ... import _gather_state_dict``):
# those imported before ``install`` keep the originals unless rebound there too.
_IMPORTERS = (
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint.staging",
    "torch.distributed.fsdp._optim_utils",
)


# --------------------------------------------------------------------------- state dicts
def _map_ours(obj, fn, kind=DTensor):
    """``obj`` with ``fn(x)`` for each ``x`` of type ``kind`` (our DTensor) in its dicts,
    lists and tuples; the same object where it holds none."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        new = {k: _map_ours(v, fn, kind) for k, v in obj.items()}
        return obj if all(new[k] is obj[k] for k in obj) else new
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        new = [_map_ours(v, fn, kind) for v in obj]
        if all(a is b for a, b in zip(new, obj)):
            return obj
        return tuple(new) if isinstance(obj, tuple) else new
    return obj


class _Slot:
    """Where one of our DTensors was, while a PyTorch helper that would take it for a plain
    tensor walks the state dict (it deep-copies objects it does not know: this one stays)."""

    def __init__(self, dt: DTensor) -> None:
        self.dt = dt

    def __deepcopy__(self, memo):
        return self


def _full(dt: DTensor, *, cpu_offload: bool, keep: bool) -> torch.Tensor:
    """``dt`` gathered (every rank joins); ``keep=False``: a rank that gets nothing back."""
    device_type = dt.device_mesh.device_type
    if dt.device.type != device_type:  # offloaded shards: gather on the mesh's device
        dt = dt.to(device_type)
    with torch.no_grad():
        full = dt.full_tensor()
    if not keep:
        return full.new_empty(0)  # the original drops it on this rank
    return full.cpu() if cpu_offload else full


def _wrap_gather(original):
    @functools.wraps(original)
    def gather_state_dict(state_dict, *args, **kwargs):
        import torch.distributed as dist

        ranks_only = kwargs.get("ranks_only", ())
        keep = not ranks_only or dist.get_rank(kwargs.get("pg")) in ranks_only
        cpu_offload = kwargs.get("cpu_offload", False)
        state_dict = _map_ours(state_dict, lambda dt: _full(dt, cpu_offload=cpu_offload, keep=keep))
        return original(state_dict, *args, **kwargs)

    return gather_state_dict


def _shard_like(full: torch.Tensor, dt: DTensor, key, helper: str) -> DTensor:
    """This rank's box of ``full`` as a DTensor laid out like ``dt`` (no communication)."""
    if tuple(full.shape) != tuple(dt.shape):
        raise ValueError(
            f"torch.distributed._state_dict_utils.{helper}: the full tensor for {key!r} has "
            f"shape {tuple(full.shape)}, but the model's DTensor (dtensor.DTensor) has "
            f"{tuple(dt.shape)}. Pass a state dict saved from this model."
        )
    sizes, offsets = dt._spec.local_shape_and_offset()
    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
    device = full.device if dt.is_meta else dt._local().device
    local = full.detach()[box].to(device=device, dtype=dt.dtype, copy=True)
    return DTensor.from_local(
        local, dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride()
    )


def _wrap_set(original, helper: str):
    """Wrap ``_broadcast_state_dict`` / ``_distribute_state_dict``: the original leaves a full
    plain tensor where the local state dict held our DTensor; we keep this rank's box."""

    @functools.wraps(original)
    def set_state_dict(full_state_dict, local_state_dict, *args, **kwargs):
        ours = {k: v for k, v in local_state_dict.items() if isinstance(v, DTensor)}
        original(full_state_dict, local_state_dict, *args, **kwargs)
        for key, dt in ours.items():
            value = local_state_dict.get(key)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                local_state_dict[key] = _shard_like(value, dt, key, helper)

    return set_state_dict


def _wrap_broadcast_tensors(original):
    """Wrap ``_broadcast_tensors``, which ``_broadcast_state_dict`` calls for one key at a
    time: each full tensor is cut to this rank's block as soon as it arrives, so one full
    tensor at a time is held, as PyTorch holds for its own DTensors."""

    @functools.wraps(original)
    def broadcast_tensors(full_state_dict, local_state_dict, keys, *args, **kwargs):
        ours = {
            k: local_state_dict[k] for k in keys if isinstance(local_state_dict.get(k), DTensor)
        }
        original(full_state_dict, local_state_dict, keys, *args, **kwargs)
        for key, dt in ours.items():
            value = local_state_dict.get(key)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                local_state_dict[key] = _shard_like(value, dt, key, "_broadcast_tensors")

    return broadcast_tensors


def _wrap_cpu_copy(original):
    """Wrap ``_create_cpu_state_dict``: our DTensor gets a CPU DTensor of its layout, whose
    local tensor is made as the original makes a plain tensor's (pinned, shared)."""

    @functools.wraps(original)
    def create_cpu_state_dict(state_dict, *args, **kwargs):
        def cpu_like(slot: _Slot) -> DTensor:
            dt = slot.dt
            local = original({"local": dt._local()}, *args, **kwargs)["local"]
            return DTensor(local, dt._spec, requires_grad=False)

        held = _map_ours(state_dict, _Slot)
        if held is state_dict:
            return original(state_dict, *args, **kwargs)
        return _map_ours(original(held, *args, **kwargs), cpu_like, _Slot)

    return create_cpu_state_dict


_WRAPPERS = {
    "_gather_state_dict": _wrap_gather,
    "_broadcast_tensors": _wrap_broadcast_tensors,
    "_broadcast_state_dict": lambda f: _wrap_set(f, "_broadcast_state_dict"),
    "_distribute_state_dict": lambda f: _wrap_set(f, "_distribute_state_dict"),
    "_create_cpu_state_dict": _wrap_cpu_copy,
}


def _install_helpers() -> None:
    """Wrap PyTorch's state-dict helpers once ([Note: PyTorch's state-dict helpers and our
    DTensor]); a helper this PyTorch lacks is logged and left."""
    import torch.distributed._state_dict_utils as utils

    for name, wrap in _WRAPPERS.items():
        original = getattr(utils, name, None)
        if original is None:
            logger.debug("torch.distributed._state_dict_utils has no %s: not wrapped", name)
            continue
        if getattr(original, "_dtensor_wrapped", False):
            continue
        wrapper = wrap(original)
        wrapper._dtensor_wrapped = True
        setattr(utils, name, wrapper)
        for module_name in _IMPORTERS:
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, wrapper)


def _allow_in_weights_only_load() -> None:
    """Let ``torch.load(weights_only=True)`` rebuild our DTensors, as PyTorch allows its own
    (the mesh inside is ``device_mesh``'s to allow)."""
    torch.serialization.add_safe_globals(
        [DTensor, DTensorSpec, TensorMeta, Shard, _StridedShard, Replicate, Partial, NormPartial]
    )


def install() -> None:
    """Make PyTorch's checkpoint code take our DTensors (``dtensor/_ops/tensor_ops.py``
    calls this when imported, so ``import dtensor`` does; calling it again does nothing).

    Example:
        >>> install()
        >>> get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    """
    _allow_in_weights_only_load()
    if torch.distributed.is_available():
        _install_helpers()
