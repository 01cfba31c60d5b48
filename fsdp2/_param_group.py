"""FSDPParamGroup: the parameters of one ``fully_shard`` call, gathered and reduced together.

Memory state (``ShardedState``):

* ``SHARDED`` - only the shards exist; the unsharded buffers hold no memory;
* ``UNSHARDED`` - one all-gather has filled every unsharded parameter;
* ``SHARDED_POST_FORWARD`` - ``reshard_after_forward=k``: after forward this rank keeps the
  rows of ``k`` ranks' shards, so backward re-gathers within a group of ``k``.

An all-gather in flight (``unshard()`` issued, ``wait_for_unshard()`` not yet called) is
``gather_in_flight``. What the modules *register* follows the memory state, as in PyTorch's
FSDP2: once an all-gather completes they register the unsharded parameters, and resharding
registers the sharded DTensors again. So after ``unshard()``, after a forward that keeps the
memory (``reshard_after_forward=False``) and during a group's backward, a module's attributes
and ``named_parameters()`` are the unsharded tensors; ``SHARDED_POST_FORWARD`` registers the
sharded DTensors. ``state_dict()`` swaps the shards in for the save (``_state_dict.py``).

[Note: stale gathered copies] Gathered parameters, or the rows ``reshard_after_forward=k``
keeps, may outlive an optimizer step (a forward that no backward follows - under no_grad,
say - between backward and ``step()``, or ``reshard_after_backward=False``). PyTorch's FSDP2
then computes the next forward with the old values. Here each gather records the shards'
version counters (an in-place write bumps them), and ``unshard()`` drops what was kept and
gathers again when a shard changed since.

``post_backward()`` takes the unsharded gradients and issues one reduction of their
rank-major blocks in the reduce dtype, plus one "had a gradient" flag per parameter, so a
parameter that no rank used keeps ``grad=None``, exactly as on one process.
``finish_reduce()`` waits, completes HSDP's all-reduce, divides and installs each rank's
slice as the sharded ``.grad``. ``_collectives.py`` chooses the routes.

With a single data-parallel rank and no dtype cast nothing needs to move, so the unsharded
parameter is an alias of the shard and no collective is issued.
"""

from __future__ import annotations

import enum
import functools
import logging

import torch
import torch.distributed as dist

from dtensor import debug
from fsdp2 import _collectives as C
from fsdp2._param import FSDPParam, MeshInfo
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

logger = logging.getLogger(__name__)


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDED = "unsharded"


class FSDPStateError(AssertionError):
    """An internal invariant of the runtime does not hold (a bug, not a usage error)."""


class PostForwardMesh:
    """``reshard_after_forward=k``: after forward each rank keeps 1/k of the parameters.

    The shard group is cut into consecutive blocks of ``k`` ranks; a block holds every row of
    the rank-major layout between its members, so backward re-gathers within the block.
    """

    def __init__(self, ranks: list[int], my_pos: int, k: int, backend: str) -> None:
        from device_mesh.groups import get_group, hold

        self.size = k
        self.index = my_pos % k
        blocks = [tuple(ranks[i : i + k]) for i in range(0, len(ranks), k)]
        groups = [get_group(b, backend) for b in blocks]  # every rank creates every block
        self._group = hold(groups[my_pos // k])  # weakly, as meshes hold theirs

    @property
    def group(self):
        from device_mesh.groups import resolve

        return resolve(self._group, api="fully_shard(reshard_after_forward=int)")


class PendingReduce:
    """A gradient reduction in flight for one group."""

    def __init__(self, group: FSDPParamGroup, reduction, params, local_flags, divided: bool):
        self.group = group
        self.reduction = reduction
        self.params = params
        self.local_flags = local_flags  # which parameters had a gradient on this rank
        self.divided = divided  # whether the collective already divided the sum

    def wait_only(self) -> None:
        """Finish the collective and drop its result (recovery after an exception)."""
        self.reduction.wait()


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
        self.modules: tuple = ()  # the modules of the fully_shard call (set by it)
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy) and device.type != "cpu"
        self.pin_memory = self.offload and offload_policy.pin_memory
        self.post_forward = post_forward
        self.comm = None  # the root's CommContext, set at lazy init
        self.scope = "fsdp"  # the flight recorder's name for it (its module's path, at lazy init)
        self.pool = None  # comm.pool, or comm.no_pool for a group whose shapes are unique
        # controls (FSDPModule.set_*)
        self.reshard_after_forward: bool | None = None  # None until lazy init resolves it
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.unshard_in_backward = True
        self.all_reduce_hook = None
        self.force_sum_reduction_for_comms = False  # reductions are always sums here
        self.deterministic = False  # set_deterministic_reduction: one summation tree
        # runtime
        self.state = ShardedState.SHARDED
        self._gather: C.AllGather | None = None
        self._kept_rows: torch.Tensor | None = None  # SHARDED_POST_FORWARD only
        self._gathered_versions: list | None = None  # shard versions at the last gather
        self.registered_unsharded = False
        self._partial_reduce: torch.Tensor | None = None  # HSDP, requires_all_reduce=False

    @property
    def initialized(self) -> bool:
        return self.comm is not None

    # --------------------------------------------------------------------------- dtypes
    def compute_dtype(self, p: FSDPParam) -> torch.dtype:
        """The dtype ``p`` is gathered and computed in: ``param_dtype``, else its own."""
        return self.mp_policy.param_dtype or p.dtype

    @property
    def layout(self) -> C.RowLayout:
        """Slots of one rank's row of this group's all-gather (bytes when dtypes differ)."""
        return C.RowLayout(
            [p.padded_numel for p in self.params], [self.compute_dtype(p) for p in self.params]
        )

    @property
    def reduce_dtype(self) -> torch.dtype:
        """One dtype for the group's gradient reduction: ``reduce_dtype``, else the compute
        dtype of the parameters that train (the widest, when a group mixes them)."""
        if self.mp_policy.reduce_dtype is not None:
            return self.mp_policy.reduce_dtype
        dtypes = {self.compute_dtype(p) for p in self.params if p.requires_grad}
        dtypes = dtypes or {self.compute_dtype(p) for p in self.params}
        return functools.reduce(torch.promote_types, sorted(dtypes, key=str))

    @property
    def trivial(self) -> bool:
        """One data-parallel rank, no cast, no offload: the shard *is* the full parameter."""
        return (
            self.mesh_info.data_parallel_size == 1
            and all(self.compute_dtype(p) == p.dtype for p in self.params)
            and not self.offload
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

    def follow_meta(self) -> None:
        """[Note: dry run on meta] Parameters still on the meta device at the first forward
        (a model built on meta and never materialized, under PyTorch's fake process group)
        are gathered and computed on meta: every buffer is a meta tensor, so a dry run of a
        large model in one process allocates nothing and issues the real collectives."""
        if self.params and all(p.local.device.type == "meta" for p in self.params):
            self.device = torch.device("meta")
            self.offload = self.pin_memory = False

    def _check(self, ok: bool, what: str) -> None:
        if not ok:
            rank = dist.get_rank() if dist.is_initialized() else 0
            names = ", ".join(p.fqn for p in self.params[:3])
            raise FSDPStateError(f"[rank {rank}] fsdp2 group ({names}): {what}")

    # --------------------------------------------------------------------------- unshard
    @property
    def gather_in_flight(self) -> bool:
        return self._gather is not None

    def unshard(self) -> None:
        """Start the all-gather (returns at once); ``wait_for_unshard`` completes it."""
        if self._gather is not None:
            return
        if self.state is not ShardedState.SHARDED and self._shards_changed():
            # [Note: stale gathered copies] parameters (or the rows reshard_after_forward=k
            # keeps) gathered before an optimizer step: drop them and gather again
            self.discard_unsharded()
        if self.state is ShardedState.UNSHARDED:
            return
        if not self.params or self.trivial:  # nothing to gather (a tie moved all away)
            for p in self.params:
                p.alias_shard()
            self.state = ShardedState.UNSHARDED
            self.register_unsharded()
            return
        for p in self.params:
            p.ensure_unsharded(self.compute_dtype(p), self.device, self.comm)
        kept, self._kept_rows = self._kept_rows, None
        self._check(
            (kept is not None) == (self.state is ShardedState.SHARDED_POST_FORWARD),
            f"kept rows do not match state {self.state}",
        )
        self.comm.hold_pages_for(sum(p.storage.nbytes for p in self.params))
        self._gathered_versions = [p.shard_version for p in self.params]
        with debug.collective_scope(self.scope):
            self._gather = C.foreach_all_gather(
                self.params,
                layout=self.layout,
                device=self.device,
                comm=self.comm,
                pool=self.pool,
                kept_rows=kept,
                post_forward=self.post_forward,
            )

    def _shards_changed(self) -> bool:
        """Whether a shard was written since the all-gather that filled the unsharded
        parameters (in-place updates bump a tensor's version counter)."""
        versions = self._gathered_versions
        return versions is not None and any(
            p.shard_version != v for p, v in zip(self.params, versions, strict=True)
        )

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather; the unsharded parameters then hold the full values."""
        if self._gather is None:
            return
        gather, self._gather = self._gather, None
        gather.wait()
        self.state = ShardedState.UNSHARDED
        self.register_unsharded()

    # --------------------------------------------------------------------------- registration
    def register_unsharded(self) -> None:
        """Let the modules see the unsharded parameters (done whenever they are gathered)."""
        self._check(self.state is ShardedState.UNSHARDED, f"registering unsharded in {self.state}")
        if not self.registered_unsharded:
            for p in self.params:
                p.to_unsharded()
            self.registered_unsharded = True

    def register_sharded(self) -> None:
        """Let the modules see the sharded parameters again (the memory may stay)."""
        if self.registered_unsharded:
            for p in self.params:
                p.to_sharded()
            self.registered_unsharded = False

    # --------------------------------------------------------------------------- reshard
    def reshard(self, *, after_forward: bool = False) -> None:
        """Free the unsharded parameters and register the sharded ones again."""
        self.wait_for_unshard()
        self.register_sharded()
        if self.state is not ShardedState.UNSHARDED:
            return
        if after_forward and self.post_forward is not None and not self.trivial:
            self._kept_rows = self._rows_for_post_forward()
            self.state = ShardedState.SHARDED_POST_FORWARD
        else:
            self.state = ShardedState.SHARDED
        if not self.trivial:
            for p in self.params:
                p.free_unsharded()

    def discard_unsharded(self) -> None:
        """Drop every gathered copy, the rows kept after forward included (before a load or a
        change of dtype or device would make them stale)."""
        self.reshard()
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self._kept_rows = None
            self.state = ShardedState.SHARDED

    def _rows_for_post_forward(self) -> torch.Tensor:
        pf = self.post_forward
        per = self.mesh_info.shard_size // pf.size
        lo = pf.index * per
        layout = self.layout
        rows = torch.empty((per, layout.width), dtype=layout.row_dtype, device=self.device)
        for i, p in enumerate(self.params):
            layout.slot(rows, i).copy_(p.unsharded_rank_blocks()[lo : lo + per])
        return rows

    def buffer_key(self) -> tuple:
        """What decides the shapes of this group's collective buffers."""
        layout = self.layout
        return (layout.width, len(self.params), layout.row_dtype, self.reduce_dtype)

    # --------------------------------------------------------------------------- gradients
    def _accumulates_in_reduce_dtype(self, p: FSDPParam) -> bool:
        return self.reduce_dtype != self.compute_dtype(p)

    def post_backward(self) -> PendingReduce | None:
        """Take the unsharded gradients, reshard, and issue their reduction."""
        with_grad = [p for p in self.params if p.requires_grad]
        if not self.requires_gradient_sync or not with_grad:
            # no-sync: gradients stay unsharded and keep accumulating (in the reduce dtype
            # when it differs, so micro-batches add in that precision); in deterministic
            # mode each micro-batch's gradient is a leaf of the summation tree
            for p in with_grad:
                if self.deterministic:
                    p.push_grad_leaf(self.reduce_dtype)
                elif self._accumulates_in_reduce_dtype(p):
                    p.accumulate_unsharded_grad(self.reduce_dtype)
            if self.reshard_after_backward:
                self.reshard()
            return None
        if self.deterministic:
            grads = [p.take_tree_grad(self.reduce_dtype) for p in with_grad]
        else:
            grads = [p.take_unsharded_grad() for p in with_grad]
        if self.reshard_after_backward:
            self.reshard()
        if self.trivial and self.all_reduce_hook is None:
            self._install_local_grads(with_grad, grads)
            return None
        hsdp = self.mesh_info.replicate_mesh_dim is not None
        divided = not hsdp and self.all_reduce_hook is None
        with debug.collective_scope(self.scope):
            reduction = C.foreach_reduce(
                with_grad,
                grads,
                dtype=self.reduce_dtype,
                device=self.device,
                comm=self.comm,
                pool=self.pool,
                divide_by=self._divide_factor() if divided else 1.0,
                tree=self.deterministic,
            )
        local_flags = [g is not None for g in grads]
        return PendingReduce(self, reduction, with_grad, local_flags, divided)

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for a reduction, finish HSDP's all-reduce, divide, and install this rank's
        gradient shards. Reads the flags on the host only where this rank had no gradient
        of its own (on CUDA that read is the only host sync a reduction may need)."""
        row = pending.reduction.wait()
        params = pending.params
        info = self.mesh_info
        local_flags = pending.local_flags
        if info.replicate_mesh_dim is not None:
            if self._partial_reduce is not None:  # micro-batches reduced without all-reduce
                row.add_(self._partial_reduce)
                self._partial_reduce = None
                local_flags = [False] * len(params)  # the flags must be read: any may be set
            if not self.requires_all_reduce:
                self._partial_reduce = row
                return
            with debug.collective_scope(self.scope):
                C.all_reduce_sum(
                    row,
                    info.replicate_group,
                    label=info.replicate_mesh_dim,
                    mesh=info.mesh,
                    tree=self.deterministic,
                )
        n = row.numel() - len(params)
        values, flags = row[:n], row[n:]
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(values)
        if not pending.divided:
            row.div_(self._divide_factor())  # the flags too: only their sign is read
        present = local_flags if all(local_flags) else [f > 0 for f in flags.tolist()]
        if self.offload:
            values = self._copy_to_host(values, params)
        offset = 0
        for p, has in zip(params, present, strict=True):
            if has:
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
            self.comm.streams.synchronize_compute()
        return host

    def _divide_factor(self) -> float:
        if self.gradient_divide_factor is not None:
            return self.gradient_divide_factor
        return self.mesh_info.data_parallel_size

    def _install_local_grads(self, params: list[FSDPParam], grads: list) -> None:
        factor = self._divide_factor()
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.accumulate_sharded_grad(g / factor if factor != 1 else g)

    # --------------------------------------------------------------------------- recovery
    def reset(self) -> None:
        """Back to a clean sharded state after an exception (``reset_iter_state``): finish
        any all-gather in flight, drop unreduced and partially reduced gradients, reshard."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self.state = ShardedState.UNSHARDED
        self._partial_reduce = None
        for p in self.params:
            p.drop_unsharded_grads()
        self.discard_unsharded()
