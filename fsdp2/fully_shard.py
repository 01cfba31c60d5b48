"""``fully_shard``: the entry point, and ``FSDPModule``, the class every sharded module joins.

``fully_shard(module)`` validates everything first (so every rank fails together, before any
collective), shards the parameters of ``module`` that no inner ``fully_shard`` call already
took, and swaps ``module.__class__`` for a subclass of both ``FSDPModule`` and the original
class: ``isinstance(module, FSDPModule)`` holds and every original method still works.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from device_mesh import DeviceMesh, init_device_mesh
from device_mesh._groups import backend_for
from dtensor import DTensor
from dtensor.placement import Shard
from fsdp2._param import FSDPParam, MeshInfo
from fsdp2._param_group import FSDPParamGroup, PostForwardMesh
from fsdp2._state import _MANAGED_ORIGINALS, FSDPState
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

_API = "fully_shard"


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather.

    Example:
        >>> handle = model.blocks[1].unshard(async_op=True)
        >>> ...                  # compute while the all-gather runs
        >>> handle.wait()        # the block now holds its full parameters
    """

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin every ``fully_shard`` module gains (through a swapped ``__class__``).

    Example:
        >>> fully_shard(model)
        >>> isinstance(model, FSDPModule)
        True
        >>> model.set_requires_gradient_sync(False)   # accumulate without communication
    """

    @property
    def _fsdp(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp]
        out, seen = [], set()
        for m in self.modules():
            s = m.__dict__.get("_fsdp_state")
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return out

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [s.group for s in self._states(recurse) if s.group is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters; with ``async_op`` return a handle to wait on.

        Example:
            >>> model.unshard()          # full parameters until reshard() or the next backward
        """
        state = self._fsdp
        state.init_from_root()
        group = state.group
        if group is not None:
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its shards again.

        Example:
            >>> model.reshard()
        """
        if self._fsdp.group is not None:
            self._fsdp.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse=True) -> None:
        """Turn gradient reduction off (gradient accumulation) or back on.

        Without sync, gradients accumulate unsharded on every rank; the next backward with
        sync reduces the sum.

        Example:
            >>> model.set_requires_gradient_sync(False)
            >>> loss(micro_batch_0).backward()
            >>> model.set_requires_gradient_sync(True)
            >>> loss(micro_batch_1).backward()     # reduces both micro-batches' gradients
        """
        for g in self._groups(recurse):
            g.requires_gradient_sync = _check_bool(requires_gradient_sync, "requires_gradient_sync")

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse=True) -> None:
        """HSDP: skip (False) or do (True) the all-reduce across replicas after the reduction.

        Example:
            >>> model.set_requires_all_reduce(False)
        """
        for g in self._groups(recurse):
            g.requires_all_reduce = _check_bool(requires_all_reduce, "requires_all_reduce")

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse=True) -> None:
        """Free (True) or keep (False) the unsharded parameters between forward and backward.

        Example:
            >>> model.set_reshard_after_forward(False)   # trade memory for one all-gather
        """
        flag = _check_bool(reshard_after_forward, "reshard_after_forward")
        for s in self._states(recurse):
            s.reshard_after_forward_arg = flag
            if s.group is not None:
                s.group.reshard_after_forward = flag
                s.group.post_forward = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse=True) -> None:
        """Free (True) or keep (False) the unsharded parameters after backward.

        Example:
            >>> model.set_reshard_after_backward(False)   # e.g. during gradient accumulation
        """
        for g in self._groups(recurse):
            g.reshard_after_backward = _check_bool(reshard_after_backward, "reshard_after_backward")

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters as soon as this module's forward starts.

        An empty list turns prefetching off for this module (the default prefetches the next
        module in the previous iteration's forward order).

        Example:
            >>> blocks[0].set_modules_to_forward_prefetch([blocks[1], blocks[2]])
        """
        self._fsdp.forward_prefetch = _prefetch_states(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters as soon as this module's backward starts.

        An empty list turns prefetching off (the default prefetches the module that ran
        before this one in forward).

        Example:
            >>> blocks[2].set_modules_to_backward_prefetch([blocks[1]])
        """
        self._fsdp.backward_prefetch = _prefetch_states(modules, "set_modules_to_backward_prefetch")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward ends the step (it then waits for every reduction).

        Example:
            >>> model.set_is_last_backward(False)   # micro-batches before the last one
        """
        state = self._fsdp
        state.init_from_root()
        state.ctx.is_last_backward = _check_bool(is_last_backward, "is_last_backward")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size.

        gloo has no pre-multiplied sum, so this is a sum followed by a division.

        Example:
            >>> model.set_gradient_divide_factor(1.0)   # sum gradients instead of averaging
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(
                f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}."
            )
        for g in self._groups(True):
            g.gradient_divide_factor = float(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Skip (False) the backward all-gather for a module whose parameters backward never
        reads (for example an embedding whose gradient is not needed).

        Example:
            >>> model.tok_emb.set_unshard_in_backward(False)
        """
        if self._fsdp.group is not None:
            self._fsdp.group.unshard_in_backward = _check_bool(
                unshard_in_backward, "unshard_in_backward"
            )

    def __deepcopy__(self, memo):
        raise RuntimeError(
            f"copy.deepcopy of a fully_shard module ({type(self).__name__}) is not supported: "
            "the copy would share this module's process groups, hooks and gathered buffers. "
            "Deepcopy the model before calling fully_shard, or build a second model, call "
            "fully_shard on it and load_state_dict(model.state_dict())."
        )


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return value


def _prefetch_states(modules, api: str) -> list[FSDPState]:
    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{api}: every module must have been passed to fully_shard; "
                f"{type(m).__name__} was not."
            )
    return [m._fsdp for m in modules]


_CLASS_CACHE: dict[type, type] = {}


def _swap_class(module: nn.Module) -> None:
    cls = module.__class__
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's forward hooks around another method, e.g. ``generate``.

    Without this, calling ``model.generate()`` directly would run with sharded parameters.
    Does nothing on a module that is not an ``FSDPModule``.

    Example:
        >>> fully_shard(model)
        >>> register_fsdp_forward_method(model, "generate")
        >>> model.generate(prompt)       # parameters gathered for the whole call
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}."
        )
    method = getattr(type(module), method_name)
    state = module._fsdp

    def wrapped(self, *args, **kwargs):
        hooked = state._pre_forward_hook(self, args, kwargs)
        if hooked is not None:
            args, kwargs = hooked
        out = method(self, *args, **kwargs)
        result = state._post_forward_hook(self, args, out)
        return out if result is None else result

    setattr(module, method_name, types.MethodType(wrapped, module))


# --------------------------------------------------------------------------------- fully_shard
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen, immutable)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen, immutable)
    ignored_params: set[nn.Parameter] | None = None,
):
    """Shard ``module``'s parameters over ``mesh`` and gather them only while it computes.

    Call it bottom-up: on each transformer block, then on the root. Every parameter of
    ``module`` not already taken by an inner call becomes an ``nn.Parameter`` holding a
    ``DTensor`` sharded ``(Shard(0),)`` over a 1-D mesh (``(Replicate(), Shard(0))`` over a
    2-D mesh: HSDP). Build the optimizer afterwards, on ``model.parameters()``.

    Args:
        module: a module, or a list of modules that share one all-gather.
        mesh: defaults to a 1-D mesh over all ranks of the default process group.
        reshard_after_forward: True frees the gathered parameters after forward (gather
            again in backward); False keeps them; None means True except for the root; an
            int ``k`` keeps a 1/k share after forward and re-gathers within groups of ``k``.
        shard_placement_fn: per parameter, ``Shard(dim)`` to shard another dim, or None.
        mp_policy: dtypes for compute, reduction and outputs.
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded state in host memory.
        ignored_params: parameters left alone (not sharded, no gradient reduction).

    Returns:
        ``module`` itself, now also an ``FSDPModule``.

    Raises:
        ValueError / TypeError: invalid arguments, naming the argument and value, raised on
        every rank before any collective.

    Example:
        >>> model = GPT(cfg)
        >>> for block in model.blocks:
        ...     fully_shard(block)
        >>> fully_shard(model)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    """
    modules = _as_modules(module)
    mesh = _default_mesh() if mesh is None else mesh
    info = _mesh_info(mesh)
    device = _compute_device(mesh)
    post_forward = _post_forward_mesh(reshard_after_forward, mesh, info)
    _check_policies(mp_policy, offload_policy)
    ignored = _ignored_ids(ignored_params)
    entries, names = _collect_params(modules, ignored)
    _check_params(entries, names, device)
    dims = [
        _shard_dim(shard_placement_fn, p, names[id(p)]) if owner is None else None
        for p, _, owner in entries
    ]
    shard_device, pin = _shard_storage(offload_policy, device)
    params: list[FSDPParam] = []  # nothing is modified before this point
    for (p, locations, owner), dim in zip(entries, dims, strict=True):
        if owner is not None:
            params.append(_take_over(owner, locations, info))
            continue
        fp = FSDPParam(p, locations, info, dim, shard_device, pin_memory=pin)
        _MANAGED_ORIGINALS[id(p)] = fp
        fp.to_sharded()
        params.append(fp)
    group = None
    if params:
        group = FSDPParamGroup(params, info, device, mp_policy, offload_policy, post_forward)
    rab = reshard_after_forward
    if isinstance(rab, int) and not isinstance(rab, bool):
        rab = rab != 1
    state = FSDPState(modules, group, mp_policy, rab)
    for m in modules:
        m.__dict__["_fsdp_state"] = state
        _swap_class(m)
    return module


def _as_modules(module) -> tuple[nn.Module, ...]:
    mods = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not mods:
        raise ValueError(f"{_API}: got an empty list of modules.")
    for m in mods:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{_API}: expected an nn.Module, got {type(m).__name__}.")
        if "_fsdp_state" in m.__dict__:
            raise ValueError(
                f"{_API}: {type(m).__name__} was already passed to fully_shard. Call "
                "fully_shard once per module (inner modules first, then the root)."
            )
    if len({id(m) for m in mods}) != len(mods):
        raise ValueError(f"{_API}: the same module appears twice in the list.")
    return mods


def _default_mesh() -> DeviceMesh:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        from device_mesh._groups import ensure_default_group

        ensure_default_group(device_type)
        world = dist.get_world_size()
    return init_device_mesh(device_type, (world,))


def _mesh_info(mesh) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{_API}: mesh must be a DeviceMesh, got {type(mesh).__name__}.")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"{_API}: mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got a "
            f"{mesh.ndim}-D mesh of shape {mesh.shape}. Slice it, e.g. mesh['dp']."
        )
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"{_API}: rank {dist.get_rank()} is not part of the mesh {mesh!r}.")
    for d in range(mesh.ndim):
        group_ranks = dist.get_process_group_ranks(mesh.get_group(d))
        mesh_ranks = mesh.ranks_along(d)
        if sorted(group_ranks) != sorted(mesh_ranks):
            raise ValueError(
                f"{_API}: mesh dim {d} holds ranks {mesh_ranks} but its process group holds "
                f"ranks {group_ranks}. Build the mesh with init_device_mesh after "
                "init_process_group, in the same process group."
            )
    shard_dim = mesh.ndim - 1
    return MeshInfo(
        mesh=mesh,
        shard_mesh_dim=shard_dim,
        replicate_mesh_dim=0 if mesh.ndim == 2 else None,
        shard_size=mesh.size(shard_dim),
        shard_rank=coord[shard_dim],
        replicate_size=mesh.size(0) if mesh.ndim == 2 else 1,
    )


def _shard_storage(offload_policy, device: torch.device) -> tuple[torch.device, bool]:
    """Where sharded parameters live: the host under CPU offload (on an accelerator), else
    the compute device; and whether host shards are page-locked."""
    if isinstance(offload_policy, CPUOffloadPolicy) and device.type != "cpu":
        return torch.device("cpu"), offload_policy.pin_memory
    return device, False


def _compute_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _post_forward_mesh(reshard_after_forward, mesh, info: MeshInfo) -> PostForwardMesh | None:
    value = reshard_after_forward
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, int):
        raise TypeError(
            f"{_API}: reshard_after_forward must be a bool, an int or None, got {value!r}."
        )
    ws = info.shard_size
    if value < 1 or ws % value:
        divisors = [k for k in range(1, ws + 1) if ws % k == 0]
        raise ValueError(
            f"{_API}: reshard_after_forward={value} must divide the shard group size {ws} "
            f"(valid: {divisors}; True behaves like {ws}, False like 1)."
        )
    if value in (1, ws):
        return None
    ranks = mesh.ranks_along(info.shard_mesh_dim)
    return PostForwardMesh(ranks, info.shard_rank, value, backend_for(mesh.device_type))


def _check_policies(mp_policy, offload_policy) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{_API}: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}."
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"{_API}: offload_policy must be an OffloadPolicy (or CPUOffloadPolicy), got "
            f"{type(offload_policy).__name__}."
        )


def _ignored_ids(ignored_params) -> set[int]:
    if ignored_params is None:
        return set()
    ids = set()
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"{_API}: ignored_params must hold nn.Parameters, got {type(p)}.")
        ids.add(id(p))
    return ids


def _collect_params(modules, ignored: set[int]):
    """``[(param, [(module, name), ...], owner FSDPParam | None)]`` in registration order.

    Submodules already passed to fully_shard are skipped, with one exception: a parameter
    tied to one an inner call took (the same original ``nn.Parameter`` still registered
    here) is taken over by this, outer, call, whose group covers every use.
    """
    entries: dict[int, list] = {}
    visited: set[int] = set()
    names: dict[int, str] = {}

    def visit(m: nn.Module, prefix: str, top: bool) -> None:
        if id(m) in visited or (not top and "_fsdp_state" in m.__dict__):
            return
        visited.add(id(m))
        for attr, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            if isinstance(p, DTensor):
                raise NotImplementedError(
                    f"{_API}: parameter {prefix}{attr} is already a DTensor "
                    f"({p.placements}); composing fully_shard with tensor parallelism is not "
                    "supported yet."
                )
            owner = _MANAGED_ORIGINALS.get(id(p))
            if owner is not None and owner.original is not p:
                owner = None
            entry = entries.get(id(p))
            if entry is None:
                entries[id(p)] = [p, [(m, attr)], owner]
                names[id(p)] = prefix + attr
            else:
                entry[1].append((m, attr))
        for child_name, child in m._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    for i, m in enumerate(modules):
        visit(m, f"[{i}]." if len(modules) > 1 else "", True)
    return [tuple(entry) for entry in entries.values()], names


def _check_params(entries, names: dict[int, str], device: torch.device) -> None:
    devices: dict[str, list[str]] = {}
    for p, _locs, owner in entries:
        if owner is not None:
            continue
        name = names[id(p)]
        if p.ndim == 0:
            raise ValueError(
                f"{_API}: parameter {name!r} is 0-d (a scalar) and cannot be sharded. Make it "
                f"shape (1,) or pass it in ignored_params={{model.{name}}}."
            )
        devices.setdefault(str(p.device), []).append(name)
    if len(devices) > 1:
        listing = "; ".join(f"{d}: {', '.join(n[:3])}" for d, n in devices.items())
        raise ValueError(
            f"{_API}: parameters are on different devices ({listing}). Move the module to one "
            f"device first (module.to(...)), or build it on 'meta' and call to_empty() after "
            "fully_shard."
        )
    for d in devices:
        dev = torch.device(d)
        if dev.type not in ("meta", "cpu", device.type):
            raise ValueError(
                f"{_API}: parameters are on {d} but the mesh computes on {device}. Build the "
                f"mesh with device_type={dev.type!r} or move the module to {device}."
            )


def _take_over(owner: FSDPParam, locations, info: MeshInfo) -> FSDPParam:
    """Move a tied parameter from an inner group into this one (which covers all its uses)."""
    if owner.mesh_info != info:
        raise ValueError(
            f"{_API}: parameter {owner.fqn!r} is tied across two fully_shard calls with "
            "different meshes; pass the same mesh to both."
        )
    old = owner.group
    if old.initialized:
        raise ValueError(
            f"{_API}: parameter {owner.fqn!r} is tied to a module that has already run "
            "forward; apply fully_shard to every module before the first forward."
        )
    old.params.remove(owner)
    owner.locations.extend(locations)
    owner.to_sharded()
    return owner


def _shard_dim(fn, p: nn.Parameter, name: str) -> int:
    if fn is None:
        return 0
    placement = fn(p)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"{_API}: shard_placement_fn must return Shard(dim) or None, got {placement!r} "
            f"for parameter {name!r}."
        )
    dim = placement.dim + p.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < p.ndim:
        raise ValueError(
            f"{_API}: shard_placement_fn returned {placement!r} for parameter "
            f"{name!r} of shape {tuple(p.shape)}; dim must be in [0, {p.ndim})."
        )
    return dim
