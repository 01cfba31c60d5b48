"""FSDPParam: one managed parameter, sharded at rest and unsharded around its module's use.

At rest the module holds ``sharded_param``: an ``nn.Parameter`` wrapping a ``DTensor`` whose
local tensor is this rank's ``torch.chunk`` block along ``shard_dim`` (the last ranks may
hold fewer rows, or none). The optimizer sees only this.

For compute the module holds ``unsharded_param``: a plain ``nn.Parameter`` of the full
shape, a view into a buffer laid out rank-major and padded - block ``r`` holds rank ``r``'s
chunk padded to ``pad`` rows, so a grouped all-gather output copies in with one strided copy
per parameter. The buffer's memory comes and goes through an ``UnshardedStorage``
(``_storage.py``): freeing never drops the tensor, because autograd may hold the unsharded
parameter as a saved tensor that the next all-gather refills.

Everything derived from the sharded parameter (dtype, device, local tensor) is read fresh
each time, because ``module.to_empty()`` / ``.to()`` / ``.float()`` swap the contents of the
``nn.Parameter`` object in place.

[Note: replaced parameters] ``fully_shard`` replaces each parameter with a new
``nn.Parameter``. The one it replaced (the *original*) is marked with ``_fsdp_replaced_by``
(this ``FSDPParam``), and the new sharded one with ``_fsdp_managed``, so that later calls
recognise tied uses, a second call on an already sharded module, and an optimizer built on
the originals (``_replaced.py``) without any registry.

[Note: assigned parameters] A module may be given a new sharded parameter after
``fully_shard``: ``load_state_dict(sd, assign=True)`` with DTensors laid out like the current
ones (accelerate's ``cpu_ram_efficient_loading`` and torchtitan's seed checkpoint load this
way into a model sharded on the meta device), a user's ``module.weight = nn.Parameter(dt)``,
or a conversion that builds new parameters. The ``FSDPParam`` adopts it (``adopt_assigned``):
after every load (a load post-hook), after a conversion, at the root's lazy init and before
every all-gather from the sharded state. The new parameter must be a DTensor with the
current mesh, placements and global shape, and this rank's block as its local tensor; it is
moved to the shard's device when it lies elsewhere. The parameter it replaced is marked like
an original ([Note: replaced parameters]), so an optimizer built before the load raises at
its first ``step()``. A tied parameter adopts the one assigned last and registers it at every
use again.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from device_mesh import concatenate_meshes
from dtensor import DTensor
from dtensor.placement import (
    Replicate,
    Shard,
    StridedShard,
    chunk_offsets,
    chunk_sizes,
    padded_chunk_size,
)
from dtensor.spec import (
    DTensorSpec,
    TensorMeta,
    contiguous_stride,
    from_spec,
    local_of,
    set_local,
    spec_of,
)
from dtensor.tensor import is_torch_dtensor, redistribute_dtensor, torch_dtensor_message
from fsdp2._storage import UnshardedStorage

# The C++ use count of a storage (every tensor and view over it, autograd's saved ones
# included); torch has had it for years, but it is private, so its absence is tolerated.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _python_references(t: torch.Tensor) -> int:
    """Python references to ``t``; while C++ also holds it (autograd's accumulator, a saved
    tensor) the tensor keeps one more reference to its Python object, not counted here."""
    shared = t._use_count() > 1 if hasattr(t, "_use_count") else False
    return sys.getrefcount(t) - 1 - shared


@dataclass(frozen=True)
class SpmdDims:
    """``fully_shard(dp_mesh_dims=...)``: the full mesh the parameters live on, and the index
    in it of the dim FSDP shards over and of HSDP's replicate dim (None without)."""

    mesh: object
    shard_index: int
    replicate_index: int | None

    @property
    def dp_indices(self) -> frozenset[int]:
        """The data-parallel dims of ``mesh``."""
        return frozenset(i for i in (self.shard_index, self.replicate_index) if i is not None)


@dataclass(frozen=True)
class MeshInfo:
    """How a ``fully_shard`` mesh is used: one dim shards, an optional other dim replicates.

    ``shard_rank`` is this rank's index along the shard dim (its chunk index). ``spmd``: the
    full mesh of ``dp_mesh_dims`` (``mesh`` is then its data-parallel dims), else None.
    """

    mesh: object
    shard_mesh_dim: int
    replicate_mesh_dim: int | None
    shard_size: int
    shard_rank: int
    replicate_size: int
    spmd: SpmdDims | None = None

    @property
    def shard_group(self):
        return self.mesh.get_group(self.shard_mesh_dim)

    @property
    def replicate_group(self):
        if self.replicate_mesh_dim is None:
            return None
        return self.mesh.get_group(self.replicate_mesh_dim)

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int) -> tuple:
        if self.replicate_mesh_dim is None:
            return (Shard(shard_dim),)
        return (Replicate(), Shard(shard_dim))


def _spmd_layout(info: MeshInfo, shard_dim: int, tp_spec: DTensorSpec | None):
    """The mesh and placements of a sharded parameter at rest.

    Plain: the FSDP mesh with ``(Shard(d),)`` or HSDP's ``(Replicate(), Shard(d))``. Over
    tensor parallelism: the FSDP mesh's dims then the TP mesh's, with the TP placements last;
    when TP already shards ``d``, FSDP's shard splits inside TP's (``StridedShard``), as
    PyTorch lays it out.
    """
    if tp_spec is None:
        return info.mesh, info.placements(shard_dim)
    if info.spmd is not None:
        return _full_mesh_layout(info.spmd, shard_dim, tp_spec)
    mesh = concatenate_meshes([info.mesh, tp_spec.mesh])
    split = 1
    for i, p in enumerate(tp_spec.placements):
        if isinstance(p, Shard) and p.dim == shard_dim:
            split *= tp_spec.mesh.size(i)
    fsdp = StridedShard(shard_dim, split) if split > 1 else Shard(shard_dim)
    dp = (Replicate(), fsdp) if info.replicate_mesh_dim is not None else (fsdp,)
    return mesh, (*dp, *tp_spec.placements)


def _full_mesh_layout(spmd: SpmdDims, shard_dim: int, spec: DTensorSpec):
    """``dp_mesh_dims``: the parameter's own mesh and placements, with the shard dim's
    ``Replicate()`` turned into FSDP's shard of the local tensor - ``StridedShard`` when later
    mesh dims shard the same tensor dim, so FSDP's block splits inside theirs."""
    mesh, placements = spec.mesh, list(spec.placements)
    split = 1
    for j in range(spmd.shard_index + 1, mesh.ndim):
        p = placements[j]
        if isinstance(p, (Shard, StridedShard)) and p.dim == shard_dim:
            split *= mesh.size(j)
    placements[spmd.shard_index] = StridedShard(shard_dim, split) if split > 1 else Shard(shard_dim)
    return mesh, tuple(placements)


class CheckedParameter(nn.Parameter):
    """Check mode (``fully_shard(check_freed=True)``): an unsharded parameter that refuses every torch
    operation while its memory is freed, so a tensor kept from forward and read after
    resharding raises instead of reading freed memory (see ``_storage.py``). Autograd's own
    reads of saved tensors in backward bypass Python and are unaffected.

    Example:
        >>> kept = block.attn.qkv.weight          # kept from inside forward
        >>> kept.sum()                            # after the block resharded
        RuntimeError: ... read after fully_shard freed it ...
    """

    _fsdp_owner: FSDPParam

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in tree_leaves((args, kwargs)):  # also inside lists: torch.cat([kept, x])
            if isinstance(a, CheckedParameter) and not a._fsdp_owner.is_unsharded_allocated:
                raise RuntimeError(
                    f"{func.__name__}: the unsharded parameter {a._fsdp_owner.fqn!r} was read "
                    "after fully_shard freed it (a tensor kept from inside forward and used "
                    "after its module resharded). Read it inside forward, or call "
                    "full_tensor() on the sharded parameter."
                )
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


def internal():
    """Runtime code touching unsharded parameters bypasses ``CheckedParameter``'s check."""
    return torch._C.DisableTorchFunctionSubclass()


def replaced_by(param: nn.Parameter) -> FSDPParam | None:
    """The ``FSDPParam`` that replaced ``param`` ([Note: replaced parameters]), if any."""
    return getattr(param, "_fsdp_replaced_by", None)


def unsharded_of(param: torch.Tensor) -> FSDPParam | None:
    """The ``FSDPParam`` whose unsharded parameter ``param`` is, if it is one."""
    return getattr(param, "_fsdp_unsharded_of", None)


def is_managed(param: torch.Tensor) -> bool:
    """Whether ``param`` is a sharded parameter some ``fully_shard`` call created."""
    return bool(getattr(param, "_fsdp_managed", False))


class FSDPParam:
    """One parameter managed by a ``fully_shard`` group.

    ``locations`` lists every ``(module, attribute name)`` that registers this parameter: a
    tied weight has several, and swapping sharded <-> unsharded updates all of them.
    """

    def __init__(
        self,
        param: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        mesh_info: MeshInfo,
        shard_dim: int,
        device: torch.device,
        *,
        pin_memory: bool = False,
    ) -> None:
        self.locations = list(locations)
        self.mesh_info = mesh_info
        self.shard_dim = shard_dim
        self.requires_grad = param.requires_grad
        # [Note: FSDP over tensor parallelism] A parameter that is already a DTensor on a
        # tensor-parallel mesh is sharded by its local tensor: FSDP's shape is the TP-local
        # shape, the all-gather restores the TP-local tensor, and the module computes with a
        # DTensor on the TP mesh. At rest it is one DTensor on the concatenated mesh.
        self.tp_spec: DTensorSpec | None = spec_of(param) if isinstance(param, DTensor) else None
        self.global_shape = param.shape
        self.shape = local_of(param).shape if self.tp_spec is not None else param.shape
        self.spmd_mesh, self.placements = _spmd_layout(mesh_info, shard_dim, self.tp_spec)
        self._original = weakref.ref(param)
        self.pin_memory = pin_memory  # CPU offload: keep the shard in page-locked memory
        self.shard_device = device  # where the shard lives (its local tensor; meta until built)
        self.sharded_param = self._shard(param, device)
        self.unsharded_param: nn.Parameter | None = None
        self.storage: UnshardedStorage | None = None
        self._unsharded_key = None
        # no-sync accumulation in the reduce dtype, when it differs from the compute dtype
        self.accumulated_grad: torch.Tensor | None = None
        # deterministic reduction: one gradient per micro-batch, summed as a binary counter
        # (count, gradient or None) - [Note: one summation tree] in dtensor/comm.py
        self.grad_leaves: list[tuple[int, torch.Tensor | None]] = []
        self.fqn = locations[0][1]
        self.group = None  # the FSDPParamGroup that gathers it (``join``)

    def claim(self, call: str) -> None:
        """Mark the original as replaced and the shard as managed by the fully_shard call
        on ``call`` ([Note: replaced parameters]); done only once the call installs."""
        original = self.original
        if original is not None:
            original._fsdp_replaced_by = self
        self.sharded_param._fsdp_managed = call

    def join(self, group) -> None:
        """Be gathered and reduced by ``group`` (an ``FSDPParamGroup``, on its construction:
        a tied parameter an enclosing call takes over joins that call's group)."""
        self.group = group

    @property
    def original(self) -> nn.Parameter | None:
        """The plain parameter this one replaced, while something still references it."""
        return self._original()

    # ------------------------------------------------------------------------- geometry
    @property
    def rows(self) -> int:
        """Global size along the shard dim."""
        return self.shape[self.shard_dim]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape) // self.rows if self.rows else 0

    @property
    def pad(self) -> int:
        """Rows per rank in the padded, rank-major layout."""
        return padded_chunk_size(self.rows, self.mesh_info.shard_size)

    @property
    def padded_numel(self) -> int:
        """Elements this parameter contributes to one rank's row of a grouped collective."""
        return self.pad * self.row_numel

    @property
    def local_rows(self) -> int:
        return chunk_sizes(self.rows, self.mesh_info.shard_size)[self.mesh_info.shard_rank]

    def moved_shape(self, rows: int) -> tuple[int, ...]:
        """Shape with the shard dim moved first and given ``rows``."""
        rest = [s for i, s in enumerate(self.shape) if i != self.shard_dim]
        return (rows, *rest)

    def rank_numels(self) -> list[int]:
        """Elements in each rank's shard (the last ranks may hold fewer, or none)."""
        return [n * self.row_numel for n in chunk_sizes(self.rows, self.mesh_info.shard_size)]

    # ------------------------------------------------------------------------- sharded side
    def _shard(self, param: nn.Parameter, device: torch.device) -> nn.Parameter:
        info = self.mesh_info
        offset = chunk_offsets(self.rows, info.shard_size)[info.shard_rank]
        data = local_of(param).detach() if self.tp_spec is not None else param.detach()
        local = data.narrow(self.shard_dim, offset, self.local_rows)
        target = data.device if data.device.type == "meta" else device
        local = local.to(target, memory_format=torch.contiguous_format, copy=True)
        if self.pin_memory and target.type == "cpu":
            local = local.pin_memory()
        shape = self.global_shape
        spec = DTensorSpec(
            self.spmd_mesh,
            self.placements,
            TensorMeta(shape, contiguous_stride(shape), param.dtype),
        )
        dt = from_spec(local, spec)
        return nn.Parameter(dt, requires_grad=param.requires_grad)

    # ------------------------------------------------------------------------- assigned
    def assigned(self, at: tuple | None = None) -> torch.Tensor | None:
        """A parameter registered at one of the locations (only at ``at``, a ``(module,
        attribute)``, when given) in place of the sharded one ([Note: assigned
        parameters]): the first such, in location order; None if none."""
        own = (self.sharded_param, self.unsharded_param)
        for module, name in self.locations if at is None else [at]:
            current = module._parameters.get(name)
            if current is not None and all(current is not t for t in own):
                return current
        return None

    def adopt_assigned(self, at: tuple | None = None) -> bool:
        """Adopt a newly assigned sharded parameter (at ``at`` only, when given), if any,
        and register it at every location; whether one was adopted. Call it only while the
        group is sharded."""
        new = self.assigned(at)
        if new is None:
            return False
        self._adopt(self._checked_assignment(new))
        self.to_sharded()
        return True

    def _checked_assignment(self, new: torch.Tensor) -> nn.Parameter:
        """``new`` validated against the current layout, on the shard's device, contiguous."""
        expected = (
            f"a DTensor on {self.spmd_mesh!r} with placements {tuple(self.placements)} and "
            f"global shape {tuple(self.global_shape)}"
        )
        fix = (
            "Build it from the current parameter p: distribute_tensor(full_tensor, "
            "p.device_mesh, p.placements) (dtensor's), as load_state_dict(sd, assign=True) "
            "expects."
        )
        if not isinstance(new, DTensor) and is_torch_dtensor(new):
            raise TypeError(torch_dtensor_message("fully_shard", f"parameter {self.fqn!r}", new))
        if not isinstance(new, DTensor):
            raise TypeError(
                f"fully_shard: parameter {self.fqn!r} was assigned a {type(new).__name__} of "
                f"shape {tuple(new.shape)}; a sharded parameter must be {expected}. {fix}"
            )
        if is_managed(new) or replaced_by(new) is not None:
            raise ValueError(
                f"fully_shard: parameter {self.fqn!r} was assigned a parameter fully_shard "
                "already manages or replaced (another module's sharded parameter: a tie made "
                "after fully_shard?). Tie parameters before calling fully_shard, or assign a "
                f"new DTensor. {fix}"
            )
        spec = spec_of(new)
        if (spec.mesh, tuple(spec.placements), new.shape) != (
            self.spmd_mesh,
            tuple(self.placements),
            self.global_shape,
        ):
            raise ValueError(
                f"fully_shard: parameter {self.fqn!r} was assigned a DTensor on {spec.mesh!r} "
                f"with placements {tuple(spec.placements)} and global shape {tuple(new.shape)}; "
                f"it must be {expected}. {fix}"
            )
        local = local_of(new)
        want = list(self.shape)
        want[self.shard_dim] = self.local_rows
        if tuple(local.shape) != tuple(want):
            raise ValueError(
                f"fully_shard: parameter {self.fqn!r} was assigned a DTensor whose local tensor "
                f"has shape {tuple(local.shape)}; this rank's block is {tuple(want)}. {fix}"
            )
        moved = local
        if local.device.type != "meta" and local.device != self.shard_device:
            moved = local.to(self.shard_device)
        moved = moved.contiguous()
        if moved is local:
            return new
        return nn.Parameter(from_spec(moved, spec), requires_grad=new.requires_grad)

    def _adopt(self, new: nn.Parameter) -> None:
        """Make ``new`` the sharded parameter; the old one is marked replaced."""
        old = self.sharded_param
        old._fsdp_replaced_by = self
        new._fsdp_managed = getattr(old, "_fsdp_managed", True)
        self.sharded_param = new
        if new.requires_grad != self.requires_grad:
            self.requires_grad = new.requires_grad
            if self.unsharded_param is not None:
                with internal():
                    self.unsharded_param.requires_grad_(new.requires_grad)
        if self.local.device.type == "cpu":
            self.pin_local()

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard (a plain tensor), read from the current sharded parameter."""
        return local_of(self.sharded_param)

    def pin_local(self) -> None:
        """Move the shard into page-locked host memory (after ``to_empty(device="cpu")``
        made a fresh, pageable one), so device copies of it can be asynchronous."""
        if self.pin_memory and not self.local.is_pinned():
            set_local(self.sharded_param, self.local.pin_memory())

    @property
    def dtype(self) -> torch.dtype:
        return self.sharded_param.dtype

    @property
    def shard_version(self) -> tuple[int, int]:
        """Changes whenever the shard is written in place: through the DTensor (an optimizer
        step, ``copy_`` under no_grad) or through its local tensor (``to_local()``)."""
        return self.sharded_param._version, self.local._version

    def copy_shard_into(self, dst_row: torch.Tensor) -> None:
        """Write this rank's shard into its ``padded_numel`` slot of an all-gather input."""
        n = self.local_rows * self.row_numel
        if n:
            src = self.local.movedim(self.shard_dim, 0) if self.shard_dim else self.local
            dst_row[:n].view(self.moved_shape(self.local_rows)).copy_(src, non_blocking=True)

    def _as_run(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` (shaped like this parameter, or like its shard) as one contiguous 1-D run
        with the shard dim first, in ``dtype``: ``t`` itself when it already is one."""
        src = t.movedim(self.shard_dim, 0) if self.shard_dim else t
        return src.to(dtype).contiguous().view(-1)

    def shard_run(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard as one contiguous 1-D run in the rank-major layout."""
        return self._as_run(self.local, dtype)

    def grad_run(self, grad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """An unsharded gradient as one contiguous 1-D run in the rank-major layout (rank
        ``j``'s block starts at ``j * padded_numel``); zeros for ``None``."""
        if grad is None:
            return torch.zeros(self.rows * self.row_numel, dtype=dtype, device=self.local.device)
        return self._as_run(grad, dtype)

    # ------------------------------------------------------------------------- unsharded side
    def ensure_unsharded(self, dtype: torch.dtype, device: torch.device, comm) -> None:
        """Create (once per dtype/device) the unsharded parameter over storage from ``comm``
        (the root's ``CommContext``). Its memory is given by ``back()`` right before an
        all-gather writes into it."""
        key = (dtype, device)
        if self._unsharded_key == key:
            return
        shape = self.moved_shape(self.mesh_info.shard_size * self.pad)
        self.storage = comm.storage(shape, dtype, device)
        full = self.storage.tensor[: self.rows]
        if self.shard_dim:
            full = full.movedim(0, self.shard_dim)
        if self.tp_spec is not None:
            param = nn.Parameter(self._as_tp(full), requires_grad=self.requires_grad)
        elif comm.check_freed:
            param = CheckedParameter(full, requires_grad=self.requires_grad)
            param._fsdp_owner = self
        else:
            param = nn.Parameter(full, requires_grad=self.requires_grad)
        param._fsdp_unsharded_of = self
        self.unsharded_param = param
        self._unsharded_key = key
        del full, param
        self._own_refs = self._references()

    def unsharded_rank_blocks(self) -> torch.Tensor:
        """The unsharded buffer as ``(shard_size, padded_numel)``: block r = rank r's chunk."""
        return self.storage.tensor.view(self.mesh_info.shard_size, self.padded_numel)

    def _references(self) -> tuple[int, int, int]:
        """Python references to the unsharded parameter and (tensor parallel) to its local
        tensor, and C++ users of its storage (every tensor and view over it)."""
        param = self.unsharded_param
        local = _python_references(local_of(param)) if self.tp_spec is not None else 0
        storage = _use_count(self.storage.tensor.untyped_storage()._cdata)
        return _python_references(param), local, storage

    def held_elsewhere(self) -> bool:
        """[Note: kept unsharded parameters] Whether anything but the runtime may read the
        unsharded parameter's memory: a Python reference to the parameter kept from forward
        (``w = module.weight``), to its local tensor (``to_local()`` under tensor
        parallelism), or any tensor over its storage - a view someone kept, or one autograd
        saved for backward. Counted against the runtime's own references at creation. C++
        users of the parameter itself (autograd's gradient accumulator, while a graph
        lives) never read it outside backward and are not counted; the Python count is
        corrected for the one reference they add."""
        if _use_count is None:  # cannot tell: assume the worst
            return True
        return any(now > own for now, own in zip(self._references(), self._own_refs))

    def back_storage(self, *, filled_now: bool = False) -> None:
        """Give the unsharded buffer memory right before an all-gather writes into it.

        ``filled_now``: the caller overwrites the whole buffer at once, on this thread (the
        staged route's copy-out), so no other code can read it in between. Otherwise (the
        direct route: peers' messages land later, while forward or backward code runs) a
        buffer something else still references never shows another parameter's bytes
        ([Note: kept unsharded parameters]). On accelerators the caching allocator's memory
        is not checked (as in PyTorch; the check mode catches such reads)."""
        exposed = not filled_now and self.storage.tensor.device.type == "cpu"
        self.storage.back(held_elsewhere=exposed and self.held_elsewhere())

    def free_unsharded(self) -> None:
        if self.storage is not None:
            self.storage.free()

    @property
    def is_unsharded_allocated(self) -> bool:
        return self.storage is not None and self.storage.is_allocated

    def alias_shard(self) -> None:
        """World of one, no cast: the unsharded parameter shares the shard's storage."""
        local = self.local
        current = self.unsharded_param
        if current is not None:
            mine = local_of(current) if self.tp_spec is not None else current
            if mine.data_ptr() == local.data_ptr() and mine.shape == local.shape:
                return
        grad = current.grad if current is not None else None
        data = self._as_tp(local) if self.tp_spec is not None else local
        self.unsharded_param = nn.Parameter(data, requires_grad=self.requires_grad)
        self.unsharded_param._fsdp_unsharded_of = self
        if grad is not None:
            self.unsharded_param.grad = grad

    def _as_tp(self, local: torch.Tensor) -> DTensor:
        """The TP-local tensor ``local`` as the DTensor the module computes with."""
        spec = self.tp_spec
        meta = TensorMeta(spec.shape, spec.meta.stride, local.dtype)
        return from_spec(local, DTensorSpec(spec.mesh, spec.placements, meta))

    def _tp_local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of the unsharded parameter as a plain TP-local tensor: a DTensor
        gradient laid out otherwise (``Partial`` sums over a sequence shard) is first
        redistributed to the parameter's TP placements."""
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(self.tp_spec.placements)
        spmd = self.mesh_info.spmd
        if spmd is not None:  # dp_mesh_dims: the data-parallel dims are FSDP's to reduce
            target = tuple(
                g if i in spmd.dp_indices else t
                for i, (g, t) in enumerate(zip(grad.placements, target, strict=True))
            )
        if tuple(grad.placements) != target:
            grad = redistribute_dtensor(grad, target)
        return local_of(grad)

    # ------------------------------------------------------------------------- registration
    def register(self, tensor: torch.Tensor) -> None:
        """Point every location at ``tensor`` (bypassing ``nn.Module.__setattr__`` checks)."""
        for module, name in self.locations:
            module._parameters[name] = tensor

    def to_sharded(self) -> None:
        self.register(self.sharded_param)

    def to_unsharded(self) -> None:
        self.register(self.unsharded_param)

    # ------------------------------------------------------------------------- gradients
    def accumulate_unsharded_grad(self, dtype: torch.dtype) -> None:
        """No-sync backward: move the new unsharded gradient into ``accumulated_grad`` in
        ``dtype`` (the reduce dtype), so micro-batches add in that precision."""
        with internal():
            grad = self.unsharded_param.grad if self.unsharded_param is not None else None
            if grad is None:
                return
            self.unsharded_param.grad = None
        grad = self._tp_local_grad(grad)
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(dtype)
        else:
            self.accumulated_grad += grad

    def _pop_unsharded_grad(self) -> torch.Tensor | None:
        """Detach the unsharded parameter's ``.grad`` (None when there is none) and return it."""
        if self.unsharded_param is None:
            return None
        with internal():
            grad = self.unsharded_param.grad
            self.unsharded_param.grad = None
        return grad

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Detach and return the gradient to reduce: the unsharded parameter's, plus what
        no-sync backwards accumulated."""
        grad = self._pop_unsharded_grad()
        if grad is not None:
            grad = self._tp_local_grad(grad)
        acc, self.accumulated_grad = self.accumulated_grad, None
        if acc is None:
            return grad
        if grad is not None:
            acc += grad
        return acc

    def push_grad_leaf(self, dtype: torch.dtype) -> None:
        """Deterministic reduction, no-sync backward: take this micro-batch's unsharded
        gradient (in ``dtype``) as the next leaf of the summation tree.

        The leaves are kept as a binary counter: two neighbouring sums of equally many
        leaves are added at once, so ``2**j`` micro-batches are summed as a balanced tree
        (((g0 + g1) + (g2 + g3)) for four) while holding at most ``log2(count) + 1``
        gradients. A micro-batch without a gradient is a leaf too (``None``), so the
        grouping of the others does not shift.
        """
        grad = self._pop_unsharded_grad()
        if grad is not None:
            grad = self._tp_local_grad(grad).to(dtype)
        leaves = self.grad_leaves
        leaves.append((1, grad))
        while len(leaves) > 1 and leaves[-1][0] == leaves[-2][0]:
            (n, b), (_, a) = leaves.pop(), leaves.pop()
            leaves.append((2 * n, _add_leaves(a, b)))

    def take_tree_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Deterministic reduction, backward with sync: this micro-batch's gradient as the
        last leaf, then the leaves summed from the right (the remaining counter entries hold
        decreasing powers of two, so this is ``tree_sum_into``'s grouping of the leaves)."""
        self.push_grad_leaf(dtype)
        leaves, self.grad_leaves = self.grad_leaves, []
        total = leaves.pop()[1]
        while leaves:
            total = _add_leaves(leaves.pop()[1], total)
        return total

    def has_unreduced_grads(self) -> bool:
        """Whether gradients wait for a reduction (accumulated without sync)."""
        with internal():
            pending = self.unsharded_param is not None and self.unsharded_param.grad is not None
        return pending or self.accumulated_grad is not None or bool(self.grad_leaves)

    def drop_unsharded_grads(self) -> None:
        """Forget unreduced gradients (recovery after an exception)."""
        if self.unsharded_param is not None:
            with internal():
                self.unsharded_param.grad = None
        self.accumulated_grad = None
        self.grad_leaves = []

    def shard_grad_from_row(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's gradient shard from its ``padded_numel`` slot of a reduced row."""
        block = row[: self.local_rows * self.row_numel].view(self.moved_shape(self.local_rows))
        if self.shard_dim:
            block = block.movedim(0, self.shard_dim).contiguous()
        return block

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Install (or add to) the sharded ``.grad`` as a DTensor like the parameter."""
        local_grad = local_grad.to(device=self.local.device, dtype=self.dtype)
        existing = self.sharded_param.grad
        if existing is None:
            spec = spec_of(self.sharded_param)
            self.sharded_param.grad = from_spec(local_grad, spec)
        else:
            local_of(existing).add_(local_grad)


def _add_leaves(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of two summation-tree nodes, ``None`` meaning "no gradient"; ``a`` (a
    gradient this parameter took and owns) is overwritten."""
    if a is None:
        return b
    if b is None:
        return a
    return a.add_(b)
