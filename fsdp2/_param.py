"""FSDPParam: one managed parameter, sharded at rest and unsharded around its module's use.

At rest the module holds ``sharded_param``: an ``nn.Parameter`` wrapping a ``DTensor`` whose
local tensor is this rank's ``torch.chunk`` block along ``shard_dim`` (the last ranks may
hold fewer rows, or none). The optimizer sees only this.

For compute the module holds ``unsharded_param``: a plain ``nn.Parameter`` of the full
shape, a view into ``_unsharded_buf``, a buffer laid out rank-major and padded - block ``r``
holds rank ``r``'s chunk padded to ``pad`` rows, so the grouped all-gather output copies in
with one strided copy per parameter. [Note: free by resize] ``free_unsharded`` shrinks the
buffer's *storage* to zero bytes instead of dropping the tensor: autograd may hold the
unsharded parameter as a saved tensor, and the next all-gather refills the same storage
before backward reads it. On CPU a large buffer instead lives in a mapping of its own and
freeing drops its pages (see [Note: host memory] in ``_host_memory.py``).

Everything derived from the sharded parameter (dtype, device, local tensor) is read fresh
each time, because ``module.to_empty()`` / ``.to()`` / ``.float()`` swap the contents of the
``nn.Parameter`` object in place.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from dtensor import DTensor
from dtensor._spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.placement import Replicate, Shard, chunk_offsets, chunk_sizes, padded_chunk_size
from fsdp2 import _host_memory


@dataclass(frozen=True)
class MeshInfo:
    """How a ``fully_shard`` mesh is used: one dim shards, an optional other dim replicates.

    ``shard_rank`` is this rank's index along the shard dim (its chunk index).
    """

    mesh: object
    shard_mesh_dim: int
    replicate_mesh_dim: int | None
    shard_size: int
    shard_rank: int
    replicate_size: int

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
        self.shape = param.shape
        self._original = weakref.ref(param)  # to recognise other (tied) uses of it
        self.pin_memory = pin_memory  # CPU offload: keep the shard in page-locked memory
        self.sharded_param = self._shard(param, device)
        self.unsharded_param: nn.Parameter | None = None
        self._unsharded_buf: torch.Tensor | None = None
        self._region: _host_memory.HostRegion | None = None  # CPU: see [Note: host memory]
        self._unsharded_key = None
        self.fqn = locations[0][1]
        self.group = None  # the FSDPParamGroup that gathers it (set by the group)

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

    # ------------------------------------------------------------------------- sharded side
    def _shard(self, param: nn.Parameter, device: torch.device) -> nn.Parameter:
        info = self.mesh_info
        offset = chunk_offsets(self.rows, info.shard_size)[info.shard_rank]
        data = param.detach()
        local = data.narrow(self.shard_dim, offset, self.local_rows)
        target = data.device if data.device.type == "meta" else device
        local = local.to(target, memory_format=torch.contiguous_format, copy=True)
        if self.pin_memory and target.type == "cpu":
            local = local.pin_memory()
        spec = DTensorSpec(
            info.mesh,
            info.placements(self.shard_dim),
            TensorMeta(self.shape, contiguous_stride(self.shape), param.dtype),
        )
        dt = DTensor(local, spec, requires_grad=False)
        return nn.Parameter(dt, requires_grad=param.requires_grad)

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard (a plain tensor), read from the current sharded parameter."""
        return self.sharded_param._local_tensor

    def pin_local(self) -> None:
        """Move the shard into page-locked host memory (after ``to_empty(device="cpu")``
        made a fresh, pageable one), so device copies of it can be asynchronous."""
        if self.pin_memory and not self.local.is_pinned():
            self.sharded_param._local_tensor = self.local.pin_memory()

    @property
    def dtype(self) -> torch.dtype:
        return self.sharded_param.dtype

    def copy_shard_into(self, dst_row: torch.Tensor) -> None:
        """Write this rank's shard into its ``padded_numel`` slot of an all-gather input."""
        n = self.local_rows * self.row_numel
        if n:
            src = self.local.movedim(self.shard_dim, 0) if self.shard_dim else self.local
            dst_row[:n].view(self.moved_shape(self.local_rows)).copy_(src, non_blocking=True)

    def rank_numels(self) -> list[int]:
        """Elements in each rank's shard (the last ranks may hold fewer, or none)."""
        return [n * self.row_numel for n in chunk_sizes(self.rows, self.mesh_info.shard_size)]

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
    def ensure_unsharded(self, dtype: torch.dtype, device: torch.device) -> None:
        """Create (once per dtype/device) the unsharded parameter and give it storage."""
        key = (dtype, device)
        if self._unsharded_key != key:
            shape = self.moved_shape(self.mesh_info.shard_size * self.pad)
            buf, self._region = _host_memory.allocate(shape, dtype, device)
            full = buf[: self.rows]
            if self.shard_dim:
                full = full.movedim(0, self.shard_dim)
            self._unsharded_buf = buf
            self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)
            self._unsharded_key = key
            return
        if self._region is not None:
            return  # backed by pages just before the all-gather writes into it (back_pages)
        storage = self._unsharded_buf.untyped_storage()
        nbytes = self._unsharded_buf.numel() * self._unsharded_buf.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def unsharded_rank_blocks(self) -> torch.Tensor:
        """The unsharded buffer as ``(shard_size, padded_numel)``: block r = rank r's chunk."""
        return self._unsharded_buf.view(self.mesh_info.shard_size, self.padded_numel)

    def free_unsharded(self) -> None:
        if self._region is not None:
            _host_memory.PAGES.release(self._region)
        elif self._unsharded_buf is not None:
            self._unsharded_buf.untyped_storage().resize_(0)

    def back_pages(self) -> None:
        """Give the unsharded parameter's mapping pages (a freed parameter's, where the page
        bank holds some) right before the all-gather writes into it: when its messages are
        posted on gloo, before the copy-out elsewhere."""
        if self._region is not None:
            _host_memory.PAGES.acquire(self._region)

    def region_bytes(self) -> int:
        """Bytes of the unsharded parameter's own mapping (0 when it has none)."""
        return self._region.nbytes if self._region is not None else 0

    @property
    def is_unsharded_allocated(self) -> bool:
        if self._region is not None:
            return self._region.resident
        buf = self._unsharded_buf
        return buf is not None and buf.untyped_storage().size() > 0

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
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Detach and return the gradient accumulated on the unsharded parameter."""
        if self.unsharded_param is None:
            return None
        grad = self.unsharded_param.grad
        self.unsharded_param.grad = None
        return grad

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
            spec = self.sharded_param._spec
            self.sharded_param.grad = DTensor(local_grad, spec, requires_grad=False)
        else:
            existing._local().add_(local_grad)
