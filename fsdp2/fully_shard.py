"""``fully_shard``: validate, build, install.

``fully_shard(module)`` validates everything first - arguments, parameters, tied parameters
and the order of calls - using only inputs that are the same on every rank, so every rank
fails together and a failing call changes nothing and creates no process group. Then it
creates the process groups it needs, builds the sharded parameters, and only then installs
them: registers the shards, moves tied parameters, hooks the modules and swaps each module's
``__class__`` for a subclass of both ``FSDPModule`` and the original class.

[Note: tied parameters] A parameter registered in several modules is sharded once. Uses
inside one call share it directly. When an inner call already took it and this call's
subtree contains every use, this call takes it over: its group is unsharded while all the
uses run. When two sibling calls share it (``fully_shard(tok)``, ``fully_shard(head)``),
neither group covers the other's use, so the second call records a *pending tie*; the first
enclosing call that contains both takes the parameter over (the lowest common ancestor,
typically the root). A pending tie left at the first forward is an error naming both uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from device_mesh import DeviceMesh, as_device_mesh, concatenate_meshes, init_device_mesh
from device_mesh.groups import backend_for
from dtensor import DTensor
from dtensor.placement import Replicate, Shard, from_torch_placement
from dtensor.tensor import is_torch_dtensor, torch_dtensor_message
from fsdp2._module import FSDPModule, UnshardHandle, register_fsdp_forward_method, swap_class
from fsdp2._param import FSDPParam, MeshInfo, SpmdDims, is_managed, replaced_by
from fsdp2._param_group import PostForwardMesh
from fsdp2._replaced import install_optimizer_check
from fsdp2._state import FSDPState
from fsdp2._state_dict import add_location
from fsdp2.api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_dp_mesh_dims,
    as_mp_policy,
    as_offload_policy,
)

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]

_API = "fully_shard"


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen, immutable)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen, immutable)
    ignored_params: set[nn.Parameter] | None = None,
    check_freed: bool = False,
    dp_mesh_dims: DataParallelMeshDims | None = None,
):
    """Shard ``module``'s parameters over ``mesh`` and gather them only while it computes.

    Call it bottom-up: on each transformer block, then on the root. Every parameter of
    ``module`` not already taken by an inner call becomes an ``nn.Parameter`` holding a
    ``DTensor`` sharded ``(Shard(0),)`` over a 1-D mesh (``(Replicate(), Shard(0))`` over a
    2-D mesh: HSDP). Build the optimizer afterwards, on ``model.parameters()``. Returns
    ``module`` itself, now also an ``FSDPModule``.

    Args:
        module: a module, or a list of modules that share one all-gather.
        mesh: defaults to a 1-D mesh over all ranks of the default process group. PyTorch's
            ``DeviceMesh`` is accepted too (converted over its process groups).
        reshard_after_forward: True frees the gathered parameters after forward (gather
            again in backward); False keeps them; None means True except for the root; an
            int ``k`` keeps a 1/k share after forward and re-gathers within groups of ``k``.
        shard_placement_fn: per parameter, ``Shard(dim)`` to shard another dim, or None.
        mp_policy: dtypes for compute, reduction and outputs (ours or PyTorch's).
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded state in host memory.
        ignored_params: parameters left alone (not sharded, no gradient reduction).
        check_freed: (ours, not PyTorch's; on for a whole root when any of its calls asks)
            check mode: any torch operation on an unsharded parameter while its memory is
            freed (a tensor kept from forward, read after its module resharded) raises
            instead of reading freed memory. A debugging aid: it costs a Python check per
            operation on unsharded parameters. The environment variable
            ``FSDP2_CHECK_FREED=1`` (or ``=0``) overrides it.
        dp_mesh_dims: ``DataParallelMeshDims``: ``mesh`` is the full mesh the parameters
            (DTensors, ``Replicate()`` on these dims) live on; see ``DataParallelMeshDims``.

    Raises:
        ValueError / TypeError: invalid arguments, naming the argument and value, raised on
            every rank before any collective and before anything is modified.
        RuntimeError: ``fully_shard`` called on a module inside one already sharded.

    Example:
        >>> for block in model.blocks:  # model = GPT(cfg)
        ...     fully_shard(block)
        >>> fully_shard(model)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    """
    # 1. validate: nothing is modified and no process group is created before this passes
    args = (reshard_after_forward, mp_policy, offload_policy, check_freed, dp_mesh_dims)
    call = _validate(module, mesh, *args)
    plan = _checked_plan(call, ignored_params, shard_placement_fn)
    # 2. process groups, 3. the sharded parameters (the modules still untouched), 4. install
    post_forward = _post_forward_mesh(call)
    _install(call, plan, _build(plan, call), post_forward)
    install_optimizer_check()
    return module


@dataclass(frozen=True)
class _Call:
    """One call's arguments, validated: its modules, the mesh and how it is used, the
    compute device, and the settings its ``FSDPState`` and group are built with."""

    modules: tuple[nn.Module, ...]
    mesh: DeviceMesh
    info: MeshInfo
    device: torch.device
    reshard_after_forward: bool | int | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    check_freed: bool


def _validate(module, mesh, reshard_after_forward, mp_policy, offload_policy, check_freed, dims):
    """Step 1a: the arguments, checked and converted (PyTorch's mesh and policies)."""
    modules = _as_modules(module)
    mesh = _default_mesh() if mesh is None else as_device_mesh(mesh, api=_API)
    dims = as_dp_mesh_dims(dims, api=_API)
    info = _mesh_info(mesh) if dims is None else _spmd_mesh_info(mesh, dims, reshard_after_forward)
    device = _compute_device(mesh)
    _check_reshard_after_forward(reshard_after_forward, info)
    if not isinstance(check_freed, bool):
        raise TypeError(f"{_API}: check_freed must be a bool, got {check_freed!r}.")
    return _Call(
        modules=modules,
        mesh=mesh,
        info=info,
        device=device,
        reshard_after_forward=reshard_after_forward,
        mp_policy=as_mp_policy(mp_policy),
        offload_policy=as_offload_policy(offload_policy),
        check_freed=check_freed,
    )


def _checked_plan(call: _Call, ignored_params, shard_placement_fn) -> _Plan:
    """Step 1b: what this call will shard and take over, every parameter checked (no
    changes)."""
    plan = _collect_params(call.modules, _ignored_ids(ignored_params))
    _check_params(plan, call.device)
    if call.info.spmd is None:
        _check_tensor_parallel(plan, call.mesh)
    else:
        _check_spmd_params(plan, call.info.spmd)
    plan.dims = [_shard_dim(shard_placement_fn, p, plan.names[id(p)]) for p, _ in plan.new]
    _check_take_overs(plan, call.info)
    return plan


def _build(plan: _Plan, call: _Call) -> dict:
    """Step 3: ``{id(param): FSDPParam}``, the sharded parameters of ``plan.new``, not
    installed."""
    shard_device, pin = _shard_storage(call.offload_policy, call.device)
    return {
        id(p): FSDPParam(p, locations, call.info, dim, shard_device, pin_memory=pin)
        for (p, locations), dim in zip(plan.new, plan.dims, strict=True)
    }


def _install(call: _Call, plan: _Plan, built: dict, post_forward) -> None:
    """Step 4: register the shards, move tied parameters in, and make each module an
    ``FSDPModule`` with the call's ``FSDPState`` (which builds the call's group)."""
    params = _install_params(plan, built, call.modules)
    rab = call.reshard_after_forward
    if isinstance(rab, int) and not isinstance(rab, bool):
        rab = rab != 1  # k: True (keeping the rows of post_forward), 1: False
    state = FSDPState(
        call.modules,
        params,
        mesh_info=call.info,
        device=call.device,
        mp_policy=call.mp_policy,
        offload_policy=call.offload_policy,
        reshard_after_forward=rab,
        post_forward=post_forward,
        check_freed=call.check_freed,
        pending_ties=plan.pending,
    )
    for nested in plan.nested:
        nested.nest_in(state)
    for m in call.modules:
        m.__dict__["_fsdp_state"] = state
        swap_class(m)


# --------------------------------------------------------------------------------- collecting
@dataclass
class _Plan:
    """What one call will do, decided before anything changes.

    ``order``: ``("new", param)`` or ``("take", FSDPParam)`` in registration order;
    ``new``: ``(param, locations)`` to shard; ``taken``: ``{id(FSDPParam): (it, new
    locations)}`` tied parameters moved in from inner calls; ``pending``: ties for an
    enclosing call to resolve; ``nested``: fully_shard states directly below (their
    pending ties are now this call's, resolved or pending); ``names``: ``{id(param): name}``
    of ``new``; ``dims``: the shard dim of each of ``new``.
    """

    order: list = field(default_factory=list)
    new: list = field(default_factory=list)
    taken: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)
    nested: list = field(default_factory=list)
    names: dict = field(default_factory=dict)
    dims: list = field(default_factory=list)


def _collect_params(modules, ignored: set[int]) -> _Plan:
    """Walk the modules (not into inner fully_shard calls) and sort every parameter."""
    walk = _Walk(modules, ignored)
    for i, m in enumerate(modules):
        walk.visit(m, f"[{i}]." if len(modules) > 1 else "", top=True)
    walk.bring_up_nested_ties()
    plan = walk.plan
    plan.new = [walk.new[id(p)] for kind, p in plan.order if kind == "new"]
    return plan


class _Walk:
    """One walk of ``_collect_params`` over the modules of a call, filling ``plan``."""

    def __init__(self, modules, ignored: set[int]) -> None:
        self.plan = _Plan()
        self.ignored = ignored
        self.subtree = {id(m) for top in modules for m in top.modules()}
        self.new: dict[int, tuple] = {}  # id(param) -> (param, locations)
        self.visited: set[int] = set()

    def visit(self, m: nn.Module, prefix: str, top: bool) -> None:
        """Sort ``m``'s parameters, then its children's; stop at an inner call's module."""
        if id(m) in self.visited:
            return
        self.visited.add(id(m))
        state = m.__dict__.get("_fsdp_state")
        if state is not None and not top:
            if all(state is not s for s in self.plan.nested):  # a list call: met once per module
                self.plan.nested.append(state)
            return
        for attr, p in m._parameters.items():
            if p is not None and id(p) not in self.ignored:
                self._sort(m, attr, p, prefix + attr)
        for child_name, child in m._modules.items():
            if child is not None:
                self.visit(child, f"{prefix}{child_name}.", False)

    def _sort(self, m: nn.Module, attr: str, p: nn.Parameter, name: str) -> None:
        """``p`` (at ``m.attr``) is new to this call, a tie to take over or leave pending,
        or an error (already sharded by an enclosing call)."""
        if is_managed(p):
            raise RuntimeError(
                f"{_API}: parameter {name!r} was already sharded by fully_shard on "
                f"{p._fsdp_managed}, which contains this module. Call fully_shard on "
                "inner modules first (each block), then on the modules that contain them "
                "(the root last)."
            )
        owner = replaced_by(p)
        if owner is not None:
            if _covers(owner, self.subtree):
                self._take(owner, m, attr)
            else:
                self.plan.pending.append((owner, m, attr))
            return
        entry = self.new.get(id(p))
        if entry is None:
            self.new[id(p)] = (p, [(m, attr)])
            self.plan.order.append(("new", p))
            self.plan.names[id(p)] = name
        else:
            entry[1].append((m, attr))

    def _take(self, owner: FSDPParam, module: nn.Module, attr: str) -> None:
        entry = self.plan.taken.get(id(owner))
        if entry is None:
            entry = self.plan.taken[id(owner)] = (owner, [])
            self.plan.order.append(("take", owner))
        entry[1].append((module, attr))

    def bring_up_nested_ties(self) -> None:
        """Ties inner calls could not resolve come up to this one: taken over when this
        call covers them, else left pending for an enclosing call."""
        for state in self.plan.nested:
            for tie in state.pending_ties:
                owner, m, attr = tie
                if _covers(owner, self.subtree) and id(m) in self.subtree:
                    self._take(owner, m, attr)
                else:
                    self.plan.pending.append(tie)


def _covers(owner: FSDPParam, subtree: set[int]) -> bool:
    """Whether every module of ``owner``'s current call lies in ``subtree``."""
    return all(id(m) in subtree for m in owner.group.modules)


def _install_params(plan: _Plan, built: dict, modules) -> list[FSDPParam]:
    """Register the shards, move tied parameters in, and return the group's parameters."""
    label = ", ".join(type(m).__name__ for m in modules)
    params = []
    for kind, item in plan.order:
        if kind == "new":
            fp = built[id(item)]
            fp.claim(label)
        else:
            fp, locations = plan.taken[id(item)]
            fp.group.owner.give_up(fp)  # its group is dropped if this was its last
            fp.locations.extend(locations)
        fp.to_sharded()
        for m, attr in fp.locations:
            add_location(m, attr, fp)
        params.append(fp)
    return params


# --------------------------------------------------------------------------------- validation
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
    if not dist.is_initialized():
        from device_mesh.groups import ensure_default_group

        ensure_default_group(device_type)
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_info(mesh: DeviceMesh) -> MeshInfo:
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"{_API}: mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got a "
            f"{mesh.ndim}-D mesh of shape {mesh.shape}. Slice it, e.g. mesh['dp']."
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            f"{_API}: a 2-D mesh (HSDP: replicate, shard) needs mesh_dim_names, got {mesh!r}. "
            'Build it with init_device_mesh(..., mesh_dim_names=("dp_replicate", "dp_shard")).'
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


def _spmd_mesh_info(mesh: DeviceMesh, dims: DataParallelMeshDims, reshard_after_forward):
    """``dp_mesh_dims``: the data-parallel part of the full ``mesh`` (its shard dim, after
    the replicate dim for HSDP) as a ``MeshInfo`` that also knows the full mesh."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"{_API}: dp_mesh_dims names mesh dims, but mesh {mesh!r} has no mesh_dim_names. "
            'Build it with init_device_mesh(..., mesh_dim_names=("dp", "tp")).'
        )
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(
                f"{_API}: dp_mesh_dims={dims!r} names {name!r}, which is not a dim of the "
                f"mesh; its dims are {names}. Name the mesh's data-parallel dims (e.g. "
                f"DataParallelMeshDims(shard={names[0]!r}))."
            )
    _check_spmd_supported(dims, reshard_after_forward)
    shard, replicate = dims.shard_names[0], (dims.replicate_names or (None,))[0]
    if shard == replicate:
        raise ValueError(
            f"{_API}: dp_mesh_dims={dims!r} names {shard!r} as both shard and replicate dim; "
            "a mesh dim is one or the other: name two different dims."
        )
    if replicate is not None and names.index(replicate) > names.index(shard):
        raise NotImplementedError(
            f"{_API}: dp_mesh_dims={dims!r}: the replicate dim {replicate!r} must come before "
            f"the shard dim {shard!r} in the mesh {names} (HSDP's (replicate, shard) order)."
        )
    dp_mesh = mesh[shard] if replicate is None else mesh[(replicate, shard)]
    spmd = SpmdDims(
        mesh=mesh,
        shard_index=names.index(shard),
        replicate_index=None if replicate is None else names.index(replicate),
    )
    return dataclasses.replace(_mesh_info(dp_mesh), spmd=spmd)


def _check_spmd_supported(dims: DataParallelMeshDims, reshard_after_forward) -> None:
    """The parts of PyTorch's ``dp_mesh_dims`` this library does not implement."""
    if not dims.shard_names:
        raise NotImplementedError(
            f"{_API}: dp_mesh_dims={dims!r} has no shard dim (plain replication, PyTorch's "
            "DDP mode), which is not supported here: this runtime always shards. Name the "
            "data-parallel dim as shard (FSDP), or shard and replicate (HSDP)."
        )
    if len(dims.shard_names) > 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(
            f"{_API}: dp_mesh_dims={dims!r} names several mesh dims in one field (PyTorch "
            "flattens them into one dim), which is not supported here. Build the mesh with "
            "one dim per data-parallel role (e.g. flatten dp_shard and cp into one dim)."
        )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"{_API}: reshard_after_forward={reshard_after_forward} (an int) is not supported "
            "with dp_mesh_dims (as in PyTorch); pass True or False."
        )


def _check_spmd_params(plan: _Plan, spmd: SpmdDims) -> None:
    """``dp_mesh_dims``: every parameter is a DTensor on the full mesh, ``Replicate()`` on
    the data-parallel dims and no ``Partial`` anywhere."""
    names = spmd.mesh.mesh_dim_names
    for p, _locations in plan.new:
        name = plan.names[id(p)]
        fix = (
            "With dp_mesh_dims every parameter must be a DTensor on the mesh passed to "
            "fully_shard, Replicate() on its data-parallel dims (e.g. distribute_tensor(t, "
            "mesh, [Replicate(), Shard(0)]) or parallelize_module over the full mesh)."
        )
        if not isinstance(p, DTensor):
            raise ValueError(f"{_API}: parameter {name!r} is a plain tensor. {fix}")
        if p.device_mesh != spmd.mesh:
            raise ValueError(
                f"{_API}: parameter {name!r} lives on {p.device_mesh!r}, not on the mesh "
                f"{spmd.mesh!r} passed to fully_shard. {fix}"
            )
        for i in sorted(spmd.dp_indices):
            if not isinstance(p.placements[i], Replicate):
                raise ValueError(
                    f"{_API}: parameter {name!r} has placement {p.placements[i]!r} on the "
                    f"data-parallel mesh dim {names[i]!r}; it must be Replicate(). {fix}"
                )
        if any(pl.is_partial() for pl in p.placements):
            raise ValueError(
                f"{_API}: parameter {name!r} is a Partial DTensor; redistribute it to "
                "Shard/Replicate before fully_shard."
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


def _check_reshard_after_forward(value, info: MeshInfo) -> None:
    if value is None or isinstance(value, bool):
        return
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


def _post_forward_mesh(call: _Call) -> PostForwardMesh | None:
    """Step 2: ``reshard_after_forward=k`` (k neither 1 nor the shard size): the groups of
    ``k`` ranks backward re-gathers within (created on every rank)."""
    value, info, mesh = call.reshard_after_forward, call.info, call.mesh
    if value is None or isinstance(value, bool) or value in (1, info.shard_size):
        return None
    ranks = mesh.ranks_along(info.shard_mesh_dim)
    return PostForwardMesh(ranks, info.shard_rank, value, backend_for(mesh.device_type))


def _ignored_ids(ignored_params) -> set[int]:
    if ignored_params is None:
        return set()
    ids = set()
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"{_API}: ignored_params must hold nn.Parameters, got {type(p)}.")
        ids.add(id(p))
    return ids


def _check_params(plan: _Plan, device: torch.device) -> None:
    devices: dict[str, list[str]] = {}
    for p, _locations in plan.new:
        name = plan.names[id(p)]
        if is_torch_dtensor(p):
            raise TypeError(
                torch_dtensor_message(_API, f"parameter {name!r}", p)
                + " (tensor parallelism from torch.distributed.tensor.parallel: use "
                "dtensor.parallel's parallelize_module with this fully_shard)"
            )
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


def _check_tensor_parallel(plan: _Plan, mesh: DeviceMesh) -> None:
    """A DTensor parameter (tensor parallelism) must live on a 1-D mesh that is another
    dim of the FSDP mesh's root, after the FSDP dims ([Note: FSDP over tensor parallelism])."""
    for p, _locations in plan.new:
        if not isinstance(p, DTensor):
            continue
        name = plan.names[id(p)]
        tp = p.device_mesh
        if tp.ndim != 1:
            raise NotImplementedError(
                f"{_API}: parameter {name!r} is a DTensor on a {tp.ndim}-D mesh {tp!r}; only "
                "parameters laid out by tensor parallelism over one mesh dim can be sharded "
                "on top."
            )
        if any(pl.is_partial() for pl in p.placements):
            raise ValueError(
                f"{_API}: parameter {name!r} is a Partial DTensor; redistribute it to "
                "Shard/Replicate before fully_shard."
            )
        try:
            concatenate_meshes([mesh, tp])
        except ValueError as e:
            raise ValueError(
                f"{_API}: parameter {name!r} is tensor-parallel on {tp!r}, which is not "
                f"another dim of the FSDP mesh {mesh!r}'s root mesh ({e}). Build one mesh, "
                'e.g. init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")), and pass '
                'mesh["tp"] to parallelize_module and mesh["dp"] to fully_shard.'
            ) from None


def _check_take_overs(plan: _Plan, info: MeshInfo) -> None:
    """A tied parameter moves into this call's group only if both groups use one mesh and
    the old group has not run yet ([Note: tied parameters])."""
    for owner, locations in plan.taken.values():
        user = f"{type(locations[0][0]).__name__}.{locations[0][1]}"
        if owner.mesh_info != info:
            raise ValueError(
                f"{_API}: parameter {owner.fqn!r} is tied to {user} across two fully_shard "
                "calls with different meshes; pass the same mesh to both."
            )
        if owner.group.initialized:
            raise ValueError(
                f"{_API}: parameter {owner.fqn!r} is tied to {user}, but its module has "
                "already run forward; apply fully_shard to every module before the first "
                "forward."
            )


def _shard_dim(fn, p: nn.Parameter, name: str) -> int:
    if fn is None:
        return 0
    placement = from_torch_placement(fn(p))
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
