"""FSDPParamGroup: the parameters of one ``fully_shard`` call, gathered and reduced together.

A group moves between two states. *Sharded*: modules hold the sharded DTensor parameters.
*Unsharded*: one all-gather has refilled every unsharded parameter and the modules hold
those. ``unshard()`` issues the all-gather without waiting (that is what prefetching is);
``wait_for_unshard()`` finishes it (on NCCL: copies each parameter out of the gathered rows;
on gloo the messages landed in the parameters themselves) and swaps the registrations.
``reshard()`` frees the unsharded storage and swaps back.

``post_backward()`` takes the unsharded gradients and issues one reduction of their
rank-major blocks in the reduce dtype, plus one "had a gradient" flag per parameter, so a
parameter that no rank used keeps ``grad=None``, exactly as on one process.
``finish_reduce()`` waits, averages and installs each rank's slice as the sharded ``.grad``.
See [Note: collectives on gloo] in ``_collectives.py`` for the two routes.

With a single data-parallel rank and no dtype cast nothing needs to move, so the unsharded
parameter is an alias of the shard and no collective is issued.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from fsdp2 import _collectives as C
from fsdp2 import _host_memory
from fsdp2._param import FSDPParam, MeshInfo
from fsdp2._streams import streams_for
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

logger = logging.getLogger(__name__)


class PostForwardMesh:
    """``reshard_after_forward=k``: after forward each rank keeps 1/k of the parameters.

    The shard group is cut into consecutive blocks of ``k`` ranks; a block holds every row of
    the rank-major layout between its members, so backward re-gathers within the block.
    """

    def __init__(self, ranks: list[int], my_pos: int, k: int, backend: str) -> None:
        from device_mesh._groups import get_group

        self.size = k
        self.index = my_pos % k
        blocks = [tuple(ranks[i : i + k]) for i in range(0, len(ranks), k)]
        groups = [get_group(b, backend) for b in blocks]  # every rank creates every block
        self.group = groups[my_pos // k]


class PendingReduce:
    """A gradient reduction in flight for one group."""

    def __init__(self, group: FSDPParamGroup, collective, params: list[FSDPParam], grads) -> None:
        self.group = group
        self.collective = collective
        self.params = params
        # The unsharded gradients the reduce stream reads: held until the compute stream has
        # waited for the reduction (see [Note: stream-safe frees] in _streams.py).
        self.grads = grads


class FSDPParamGroup:
    """Parameters of one ``fully_shard`` call and the collectives that move them."""

    def __init__(
        self,
        params: list[FSDPParam],
        mesh_info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        post_forward: PostForwardMesh | None,
    ) -> None:
        self.params = params
        for p in params:
            p.group = self
        self.initialized = False  # set at the root's lazy init
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy) and device.type != "cpu"
        self.pin_memory = self.offload and offload_policy.pin_memory
        self.post_forward = post_forward
        self.streams = streams_for(device)
        self._gather_input = None  # int reshard: the kept rows, read by the gather stream
        # Collective buffers are kept for reuse only when another group has the same shapes
        # (set at lazy init): a lone group's buffers would sit idle for a whole step.
        self.pool = C.POOL
        # controls (FSDPModule.set_*)
        self.reshard_after_forward: bool | None = None  # None until lazy init resolves it
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.unshard_in_backward = True
        # runtime
        self.is_unsharded = False
        self._gather: C.Pending | None = None
        self._post_forward_rows: torch.Tensor | None = None

    # --------------------------------------------------------------------------- dtypes
    @property
    def orig_dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def param_dtype(self) -> torch.dtype:
        return self.mp_policy.param_dtype or self.orig_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self.param_dtype

    @property
    def trivial(self) -> bool:
        """One data-parallel rank, no cast, no offload: the shard *is* the full parameter."""
        return (
            self.mesh_info.data_parallel_size == 1
            and self.param_dtype == self.orig_dtype
            and not self.offload
        )

    def check_dtypes(self) -> None:
        """All parameters of a group travel in one buffer, so they need one dtype."""
        if self.mp_policy.param_dtype is not None:
            return
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{p.fqn}: {p.dtype}" for p in self.params)
            raise ValueError(
                f"fully_shard: the parameters of one group must share a dtype for the grouped "
                f"all-gather, got {listing}. Pass mp_policy=MixedPrecisionPolicy(param_dtype=...)"
                " or call fully_shard on the differing modules separately."
            )

    def check_offload(self) -> None:
        """CPU offload: sharded parameters must live on the host (pinned if asked)."""
        if not self.offload:
            return
        elsewhere = [
            f"{p.fqn} ({p.local.device})" for p in self.params if p.local.device.type != "cpu"
        ]
        if elsewhere:
            raise RuntimeError(
                f"fully_shard: CPUOffloadPolicy keeps sharded parameters in host memory, but "
                f"{', '.join(elsewhere[:3])} {'is' if len(elsewhere) == 1 else 'are'} on the "
                "device. Materialize the model on the host - module.to_empty(device='cpu') "
                "or load a CPU state dict - and do not move it to the GPU after fully_shard."
            )
        for p in self.params:
            p.pin_local()

    # --------------------------------------------------------------------------- unshard
    def unshard(self) -> None:
        """Start the all-gather (returns at once); ``wait_for_unshard`` completes it."""
        if self.is_unsharded or self._gather is not None or not self.params:
            return
        if self.trivial:
            for p in self.params:
                _alias_unsharded(p)
                p.to_unsharded()
            self.is_unsharded = True
            return
        for p in self.params:
            p.ensure_unsharded(self.param_dtype, self.device)
        _hold_pages_for(self.params)
        with self.streams.gather():
            self._issue_gather()

    def _issue_gather(self) -> None:
        info = self.mesh_info
        if self._post_forward_rows is not None:
            pf, kept = self.post_forward, self._post_forward_rows.view(-1)
            rows = self._input_rows(pf.group, pf.size, kept.numel())
            rows[0].copy_(kept)
            _replicate_first_row(rows)
            self._gather_input, self._post_forward_rows = self._post_forward_rows, None
            self._gather = C.all_gather_rows(
                rows, pf.group, pf.size, label=info.shard_mesh_dim, mesh=info.mesh, pool=self.pool
            )
            return
        if self._direct_route():
            self._issue_block_exchange()
            return
        rows = self._input_rows(info.shard_group, info.shard_size, self._row_numel())
        offset = 0
        for p in self.params:
            p.copy_shard_into(rows[0, offset : offset + p.padded_numel])
            offset += p.padded_numel
        _replicate_first_row(rows)
        self._gather = C.all_gather_rows(
            rows,
            info.shard_group,
            info.shard_size,
            label=info.shard_mesh_dim,
            mesh=info.mesh,
            pool=self.pool,
        )

    def _direct_route(self) -> bool:
        """Whether this group's collectives are point-to-point messages (see
        [Note: collectives on gloo])."""
        info = self.mesh_info
        nbytes = self._row_numel() * info.shard_size * self.param_dtype.itemsize
        return C.exchanges_blocks(info.shard_group, self.device, nbytes, len(self.params))

    def _issue_block_exchange(self) -> None:
        """Gloo on CPU: each shard goes straight into every rank's unsharded parameters
        (``C.gather_blocks``). This rank's own block is copied now; the pages the others
        land in must be in place before any message arrives."""
        info = self.mesh_info
        me = info.shard_rank
        pieces = []
        with _versions_preserved(self.params):  # gloo's own writes bypass the counter anyway
            for p in self.params:
                p.back_pages()
                send, blocks, counts = (
                    p.shard_run(self.param_dtype),
                    p.unsharded_rank_blocks(),
                    p.rank_numels(),
                )
                if counts[me]:
                    blocks[me, : counts[me]].copy_(send)
                pieces.append((send, blocks, counts))
        self._gather = C.gather_blocks(
            pieces,
            info.shard_group,
            me,
            row_bytes=self._row_numel() * self.param_dtype.itemsize,
            label=info.shard_mesh_dim,
            mesh=info.mesh,
        )

    def _input_rows(self, group, k: int, n: int) -> torch.Tensor:
        """All-gather input: ``k`` copies of our row on gloo (all-to-all), one elsewhere."""
        copies = k if C.wants_replicated_input(group) else 1
        return self.pool.get((copies, n), self.param_dtype, self.device)

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather and swap the unsharded parameters in."""
        if self._gather is None:
            return
        out = self._gather.wait()  # None when the messages landed in the parameters
        self._gather = self._gather_input = None
        if out is not None:
            self._copy_out(out.view(self.mesh_info.shard_size, -1))
        for p in self.params:
            p.to_unsharded()
        self.is_unsharded = True

    def _copy_out(self, rows: torch.Tensor) -> None:
        """Copy each parameter's blocks out of the gathered rank-major rows."""
        for p in self.params:
            p.back_pages()
        with _versions_preserved(self.params):
            torch.split_with_sizes_copy(
                rows,
                [p.padded_numel for p in self.params],
                dim=1,
                out=[p.unsharded_rank_blocks() for p in self.params],
            )

    def buffer_key(self) -> tuple:
        """What decides the shapes of this group's collective buffers."""
        return (self._row_numel(), len(self.params), self.param_dtype, self.reduce_dtype)

    def _row_numel(self) -> int:
        return sum(p.padded_numel for p in self.params)

    # --------------------------------------------------------------------------- reshard
    def reshard(self, *, after_forward: bool = False) -> None:
        """Free the unsharded parameters and register the sharded ones again."""
        if self._gather is not None:
            self.wait_for_unshard()
        if not self.is_unsharded:
            return
        if after_forward and self.post_forward is not None and not self.trivial:
            self._post_forward_rows = self._rows_for_post_forward()
        for p in self.params:
            if not self.trivial:
                p.free_unsharded()
            p.to_sharded()
        self.is_unsharded = False

    def _rows_for_post_forward(self) -> torch.Tensor:
        pf = self.post_forward
        per = self.mesh_info.shard_size // pf.size
        lo = pf.index * per
        rows = torch.empty((per, self._row_numel()), dtype=self.param_dtype, device=self.device)
        offset = 0
        for p in self.params:
            n = p.padded_numel
            rows[:, offset : offset + n].copy_(p.unsharded_rank_blocks()[lo : lo + per])
            offset += n
        return rows

    # --------------------------------------------------------------------------- gradients
    def post_backward(self) -> PendingReduce | None:
        """Take the unsharded gradients, reshard, and issue their reduction."""
        with_grad = [p for p in self.params if p.requires_grad]
        if not self.requires_gradient_sync or not with_grad:
            # no-sync: gradients stay on the unsharded parameters and keep accumulating
            if self.reshard_after_backward:
                self.reshard()
            return None
        grads = [p.take_unsharded_grad() for p in with_grad]
        if self.reshard_after_backward:
            self.reshard()
        if self.trivial:
            self._install_local_grads(with_grad, grads)
            return None
        info = self.mesh_info
        hsdp = info.replicate_mesh_dim is not None and self.requires_all_reduce
        if self._direct_route():
            collective = self._issue_block_reduce(with_grad, grads, hsdp)
            return PendingReduce(self, collective, with_grad, None)
        with self.streams.reduce():
            rows = self._gradient_rows(with_grad, grads)
            # The side stream may still read the gradients, so they are kept until the compute
            # stream has waited for it; on CPU they go now, before the receive buffer exists.
            keep, grads = (grads if self.streams.enabled else None), None
            collective = C.reduce_rows(
                rows,
                info.shard_rank,
                info.shard_group,
                divide_by=1.0 if hsdp else self._divide_factor(),
                label=info.shard_mesh_dim,
                mesh=info.mesh,
                pool=self.pool,
            )
        return PendingReduce(self, collective, with_grad, keep)

    def _issue_block_reduce(self, params: list[FSDPParam], grads: list, hsdp: bool) -> C.Pending:
        """Gloo on CPU: each rank's block of every gradient goes straight to that rank
        (``C.reduce_blocks``), with no rank-major staging buffer."""
        info = self.mesh_info
        dtype = self.reduce_dtype
        pieces, slot = [], 0
        for p, g in zip(params, grads, strict=True):
            pieces.append((p.grad_run(g, dtype), p.padded_numel, p.rank_numels(), slot))
            slot += p.padded_numel
        flags = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
        return C.reduce_blocks(
            pieces,
            flags,
            info.shard_group,
            info.shard_rank,
            width=slot + len(params),
            divide_by=1.0 if hsdp else self._divide_factor(),
            label=info.shard_mesh_dim,
            mesh=info.mesh,
            pool=self.pool,
        )

    def _gradient_rows(self, params: list[FSDPParam], grads: list) -> torch.Tensor:
        """``(shard_size, N + len(params))`` rank-major gradients in the reduce dtype + flags."""
        ws = self.mesh_info.shard_size
        dtype = self.param_dtype  # _chunk_cat wants one input dtype; it casts into the output
        pieces = []
        for p, g in zip(params, grads, strict=True):
            if g is None:
                g = torch.zeros(p.moved_shape(p.rows), dtype=dtype, device=self.device)
            elif p.shard_dim:
                g = g.movedim(p.shard_dim, 0)
            pieces.append(g)
        flags = [1.0 if g is not None else 0.0 for g in grads]
        pieces.append(torch.tensor([flags], dtype=dtype, device=self.device).expand(ws, -1))
        width = sum(p.padded_numel for p in params) + len(params)
        rows = self.pool.get((ws, width), self.reduce_dtype, self.device)
        torch._chunk_cat(pieces, dim=0, num_chunks=ws, out=rows)
        return rows

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for a reduction, average it and install this rank's gradient shards."""
        row = pending.collective.wait()
        params = pending.params
        info = self.mesh_info
        if info.replicate_mesh_dim is not None and self.requires_all_reduce:
            C.all_reduce_sum(
                row, info.replicate_group, label=info.replicate_mesh_dim, mesh=info.mesh
            )
            row.div_(self._divide_factor())  # the flags too: only their sign is read
        n = row.numel() - len(params)
        values, flags = row[:n], row[n:].tolist()
        pending.grads = None  # the compute stream has waited for the reduction
        if self.offload:
            values = self._copy_to_host(values, params)
        offset = 0
        for p, flag in zip(params, flags, strict=True):
            if flag > 0:
                p.accumulate_sharded_grad(p.shard_grad_from_row(values[offset:]))
            offset += p.padded_numel

    def _copy_to_host(self, values: torch.Tensor, params: list[FSDPParam]) -> torch.Tensor:
        """CPU offload: start copying the reduced gradients into (pinned) host memory.

        The copy is asynchronous; the end of backward waits for the compute stream before
        any optimizer step can read it. When the host must read the values right away -
        adding to an existing gradient, a dtype cast, a non-dim-0 shard made contiguous -
        it waits now.
        """
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=self.pin_memory)
        host.copy_(values, non_blocking=self.pin_memory)
        reads_now = any(
            p.sharded_param.grad is not None or p.shard_dim != 0 or p.dtype != values.dtype
            for p in params
        )
        if reads_now:
            self.streams.synchronize_compute()
        return host

    def _divide_factor(self) -> float:
        if self.gradient_divide_factor is not None:
            return self.gradient_divide_factor
        info = self.mesh_info
        return info.shard_size * (info.replicate_size if self.requires_all_reduce else 1)

    def _install_local_grads(self, params: list[FSDPParam], grads: list) -> None:
        factor = self._divide_factor()
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.accumulate_sharded_grad(g / factor if factor != 1 else g)

    def has_unsharded_grads(self) -> bool:
        return any(
            p.unsharded_param is not None and p.unsharded_param.grad is not None
            for p in self.params
        )


def _replicate_first_row(rows: torch.Tensor) -> None:
    if rows.size(0) > 1:
        rows[1:].copy_(rows[0].expand(rows.size(0) - 1, -1))


def _alias_unsharded(p: FSDPParam) -> None:
    """World of one: the unsharded parameter shares the shard's storage."""
    local = p.local
    current = p.unsharded_param
    if current is None or current.data_ptr() != local.data_ptr() or current.shape != local.shape:
        grad = current.grad if current is not None else None
        p.unsharded_param = torch.nn.Parameter(local, requires_grad=p.requires_grad)
        if grad is not None:
            p.unsharded_param.grad = grad


def _hold_pages_for(params) -> None:
    """Let the page bank hold a group's worth of unsharded parameters (the largest group's;
    see [Note: host memory]), for the next group to take while it gathers."""
    nbytes = sum(p.region_bytes() for p in params)
    _host_memory.PAGES.keep_bytes = max(_host_memory.PAGES.keep_bytes, nbytes)


@contextlib.contextmanager
def _versions_preserved(params):
    """Writes into the unsharded parameters inside this block leave their version counters
    alone: autograd checks them on saved tensors, and a refill is not a modification."""
    with contextlib.ExitStack() as stack:
        for p in params:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(p.unsharded_param))
        yield
