"""FSDPParamGroup: the parameters of one ``fully_shard`` call, gathered and reduced together.

Its ``FSDPState`` (``owner``) builds it and owns what the call was given for all its modules
(the modules, ``mp_policy``); the group owns what moves its parameters: the mesh, the device,
offloading, ``reshard_after_forward`` and the controls ``FSDPModule.set_*`` change. The
root's lazy init attaches it to the root's ``CommContext`` (``lazy_init``) and computes, once,
what its parameters' dtypes decide: each one's compute dtype, the all-gather's row layout,
the reduction dtype and whether nothing needs to move (``trivial``); a conversion of the
parameters (``module.to(...)``) computes them again (``refresh_dtypes``).

Memory state (``ShardedState``, ``_lifecycle.py``): ``SHARDED`` - only the shards exist;
``UNSHARDING`` - an all-gather is in flight (``unshard()`` issued, ``wait_for_unshard()``
not yet called); ``UNSHARDED`` - the all-gather filled every unsharded parameter;
``SHARDED_POST_FORWARD`` - ``reshard_after_forward=k``: after forward this rank keeps the
rows of ``k`` ranks' shards, so backward re-gathers within a group of ``k``. Each move is one
method that checks where it comes from (``_begin_gather``, ``_end_gather``, ``_alias``,
``_free``, ``_drop_kept_rows``); ``unshard()``, ``wait_for_unshard()``, ``reshard()`` and
``discard_unsharded()`` are requests that make the moves the current state needs.

What the modules *register* follows the memory state, as in PyTorch's FSDP2: they register
the unsharded parameters exactly while the group is ``UNSHARDED`` and the sharded DTensors
otherwise. So after ``unshard()``, after a forward that keeps the memory
(``reshard_after_forward=False``) and during a group's backward, a module's attributes and
``named_parameters()`` are the unsharded tensors. ``state_dict()`` swaps the shards in for
the save (``_state_dict.py``).

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

import functools
import logging

import torch

from dtensor import debug
from fsdp2 import _collectives as C
from fsdp2._lifecycle import FSDPStateError as FSDPStateError  # raised here, imported from here
from fsdp2._lifecycle import ShardedState, check_move
from fsdp2._param import FSDPParam, MeshInfo
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

logger = logging.getLogger(__name__)

_BUG = "(a bug in fsdp2's runtime: please report it with this message)"


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
    """Parameters of one ``fully_shard`` call and the collectives that move them.

    Built whole by its ``FSDPState`` (``owner``); attached to the root at lazy init.

    Example:
        >>> group = model.blocks[0]._fsdp.group
        >>> group.unshard(); group.wait_for_unshard()   # what FSDPModule.unshard() does
        >>> group.state
        <ShardedState.UNSHARDED: 'unsharded'>
    """

    def __init__(
        self,
        owner,
        params: list[FSDPParam],
        mesh_info: MeshInfo,
        device: torch.device,
        offload_policy: OffloadPolicy,
        reshard_after_forward: bool | None,
        post_forward: PostForwardMesh | None,
    ) -> None:
        self.owner = owner  # the FSDPState of the call: its modules, mp_policy and name
        self.params = params
        for p in params:
            p.join(self)
        self.mesh_info = mesh_info
        self.device = device
        self.offload = isinstance(offload_policy, CPUOffloadPolicy) and device.type != "cpu"
        self.pin_memory = self.offload and offload_policy.pin_memory
        # Free the gathered parameters after forward: True / False, or None until the root's
        # lazy init settles it (True except for the root). With post_forward
        # (reshard_after_forward=k) a True keeps the rows of k ranks instead of nothing.
        self.reshard_after_forward = reshard_after_forward
        self.post_forward = post_forward
        # set once by lazy_init
        self.comm = None  # the root's CommContext
        self.scope = "fsdp"  # the flight recorder's name for it (its modules' paths)
        self.pool = None  # comm.pool, or comm.no_pool for a group whose shapes are unique
        # what the parameters' dtypes decide, computed by refresh_dtypes (at lazy init)
        self.layout: C.RowLayout | None = None  # one rank's row of the all-gather
        self.reduce_dtype: torch.dtype | None = None
        self.trivial = False
        self._grad_params: list[FSDPParam] = []  # the parameters that train
        self._widened: list[FSDPParam] = []  # ... of them, those computed in another dtype
        # controls (FSDPModule.set_*)
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.unshard_in_backward = True
        self.all_reduce_hook = None
        self.force_sum_reduction_for_comms = False  # reductions are always sums here
        self.deterministic = False  # set_deterministic_reduction: one summation tree
        # runtime: the memory state and what each state holds
        self.state = ShardedState.SHARDED
        self._gather: C.AllGather | None = None  # UNSHARDING: the all-gather in flight
        self._kept_rows: torch.Tensor | None = None  # SHARDED_POST_FORWARD: the rows kept
        self._gathered_versions: list | None = None  # shard versions at the last gather
        self._partial_reduce: torch.Tensor | None = None  # HSDP, requires_all_reduce=False

    @property
    def initialized(self) -> bool:
        return self.comm is not None

    @property
    def trains(self) -> bool:
        """Whether any of the parameters trains (known from lazy init on)."""
        return bool(self._grad_params)

    @property
    def modules(self) -> tuple:
        """The modules of the ``fully_shard`` call (its ``FSDPState``'s)."""
        return self.owner.modules

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The call's ``MixedPrecisionPolicy`` (its ``FSDPState``'s)."""
        return self.owner.mp_policy

    # --------------------------------------------------------------------------- set-up
    def remove(self, fp: FSDPParam) -> None:
        """Give up a tied parameter an enclosing call takes over ([Note: tied parameters])."""
        self.params.remove(fp)

    def lazy_init(self, comm, *, is_root: bool, scope: str, pooled: bool) -> None:
        """Attach to the root's ``comm`` (the root's first forward): settle
        ``reshard_after_forward`` (None: True except for the root), check offloaded shards,
        and compute what the parameters' dtypes decide. ``pooled``: another group of the
        root has buffers of the same shapes (``buffer_key``), so this one pools its own."""
        if self.reshard_after_forward is None:
            self.reshard_after_forward = not is_root
        self.check_offload()
        self.comm = comm
        self.scope = scope
        self.pool = comm.pool if pooled else comm.no_pool
        self.refresh_dtypes()

    def refresh_dtypes(self) -> None:
        """Compute what the parameters' dtypes and the policy decide (at lazy init, and after
        a conversion changed the dtypes): the all-gather's row layout (each parameter's
        compute dtype: ``param_dtype``, else its own), the reduction dtype, and whether
        nothing needs to move."""
        self.layout = self._row_layout()
        self.reduce_dtype = self._grad_reduce_dtype()
        self._grad_params = [p for p in self.params if p.requires_grad]
        self._widened = [
            p
            for p, dtype in zip(self.params, self.layout.dtypes, strict=True)
            if p.requires_grad and dtype != self.reduce_dtype
        ]
        # one data-parallel rank, no cast, no offload: the shard *is* the full parameter
        self.trivial = not self.params or (
            self.mesh_info.data_parallel_size == 1
            and all(d == p.dtype for p, d in zip(self.params, self.layout.dtypes, strict=True))
            and not self.offload
        )

    def _row_layout(self) -> C.RowLayout:
        dtype = self.mp_policy.param_dtype
        return C.RowLayout(
            [p.padded_numel for p in self.params], [dtype or p.dtype for p in self.params]
        )

    def _grad_reduce_dtype(self) -> torch.dtype:
        """One dtype for the group's gradient reduction: ``reduce_dtype``, else the compute
        dtype of the parameters that train (the widest, when a group mixes them)."""
        policy = self.mp_policy
        if policy.reduce_dtype is not None:
            return policy.reduce_dtype
        dtypes = {policy.param_dtype or p.dtype for p in self.params if p.requires_grad}
        dtypes = dtypes or {policy.param_dtype or p.dtype for p in self.params}
        return functools.reduce(torch.promote_types, sorted(dtypes, key=str))

    def buffer_key(self) -> tuple:
        """What decides the shapes of this group's collective buffers (read at lazy init,
        before ``lazy_init``, to see which groups share them)."""
        layout = self._row_layout()
        return (layout.width, len(self.params), layout.row_dtype, self._grad_reduce_dtype())

    def set_reshard_after_forward(self, flag: bool) -> None:
        """``FSDPModule.set_reshard_after_forward``: free (True) or keep (False) the gathered
        parameters after forward; an int given to ``fully_shard`` is forgotten."""
        self.reshard_after_forward = flag
        self.post_forward = None

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

    def adopt_assigned(self, fp: FSDPParam | None = None, at: tuple | None = None) -> None:
        """[Note: assigned parameters] Adopt the sharded parameters assigned since the last
        look (``load_state_dict(assign=True)``, a user's assignment, a conversion): every
        parameter's, or only ``fp``'s at location ``at``; only while sharded, where the
        modules register the shards. Recomputes what the dtypes decide when one was adopted
        after lazy init."""
        if self.state is not ShardedState.SHARDED:
            return
        if fp is None:
            adopted = [p.adopt_assigned() for p in self.params]
        else:
            adopted = [fp.adopt_assigned(at)]
        if any(adopted):
            self._gathered_versions = None
            if self.initialized:
                self.refresh_dtypes()

    def on_meta(self) -> list[FSDPParam]:
        """The parameters whose shard is still on the meta device."""
        return [p for p in self.params if p.local.device.type == "meta"]

    def follow_meta(self) -> None:
        """[Note: dry run on meta] Under PyTorch's fake process group, a group whose
        parameters are all still on the meta device at the first forward (a model built on
        meta and never materialized) is gathered and computed on meta: every buffer is a meta
        tensor, so a dry run of a large model in one process allocates nothing and issues the
        real collectives. Anywhere else a parameter on meta at the first forward is an error
        (``_check_materialized`` in ``_state.py``)."""
        if self.params and all(p.local.device.type == "meta" for p in self.params):
            self.device = torch.device("meta")
            self.offload = self.pin_memory = False

    # --------------------------------------------------------------------------- moves
    # Each move checks where it comes from, does its work, and enters its target state.
    def _check(self, allowed: tuple, target: ShardedState) -> None:
        check_move(self.owner.label, self.state, allowed, target, _BUG)

    def _begin_gather(self) -> None:
        """SHARDED or SHARDED_POST_FORWARD -> UNSHARDING: issue the all-gather (from the
        kept rows, when there are)."""
        self._check(
            (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD), ShardedState.UNSHARDING
        )
        for p, dtype in zip(self.params, self.layout.dtypes, strict=True):
            p.ensure_unsharded(dtype, self.device, self.comm)
        kept, self._kept_rows = self._kept_rows, None
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
        self.state = ShardedState.UNSHARDING

    def _end_gather(self) -> None:
        """UNSHARDING -> UNSHARDED: finish the all-gather; the modules register the
        unsharded parameters."""
        self._check((ShardedState.UNSHARDING,), ShardedState.UNSHARDED)
        gather, self._gather = self._gather, None
        gather.wait()
        for p in self.params:
            p.to_unsharded()
        self.state = ShardedState.UNSHARDED

    def _alias(self) -> None:
        """SHARDED -> UNSHARDED with nothing to gather (``trivial``): the unsharded
        parameters alias the shards."""
        self._check((ShardedState.SHARDED,), ShardedState.UNSHARDED)
        for p in self.params:
            p.alias_shard()
            p.to_unsharded()
        self.state = ShardedState.UNSHARDED

    def _free(self, *, keep_rows: bool) -> None:
        """UNSHARDED -> SHARDED, or SHARDED_POST_FORWARD keeping this rank's block of rows
        (``reshard_after_forward=k``): the modules register the shards again."""
        target = ShardedState.SHARDED_POST_FORWARD if keep_rows else ShardedState.SHARDED
        self._check((ShardedState.UNSHARDED,), target)
        for p in self.params:
            p.to_sharded()
        if keep_rows:
            self._kept_rows = self._rows_for_post_forward()
        if not self.trivial:
            for p in self.params:
                p.free_unsharded()
        self.state = target

    def _drop_kept_rows(self) -> None:
        """SHARDED_POST_FORWARD -> SHARDED: forget the rows kept after forward."""
        self._check((ShardedState.SHARDED_POST_FORWARD,), ShardedState.SHARDED)
        self._kept_rows = None
        self.state = ShardedState.SHARDED

    # --------------------------------------------------------------------------- requests
    def unshard(self) -> None:
        """Start the all-gather (returns at once); ``wait_for_unshard`` completes it."""
        self.adopt_assigned()
        state = self.state
        if state is ShardedState.UNSHARDING:
            return
        if state is not ShardedState.SHARDED and self._shards_changed():
            # [Note: stale gathered copies] parameters (or the rows reshard_after_forward=k
            # keeps) gathered before an optimizer step: drop them and gather again
            self.discard_unsharded()
        elif state is ShardedState.UNSHARDED:
            return
        if self.trivial:
            self._alias()
        else:
            self._begin_gather()

    def _shards_changed(self) -> bool:
        """Whether a shard was written since the all-gather that filled the unsharded
        parameters (in-place updates bump a tensor's version counter)."""
        versions = self._gathered_versions
        return versions is not None and any(
            p.shard_version != v for p, v in zip(self.params, versions, strict=True)
        )

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather; the unsharded parameters then hold the full values."""
        if self.state is ShardedState.UNSHARDING:
            self._end_gather()

    def reshard(self, *, after_forward: bool = False) -> None:
        """Free the unsharded parameters and register the sharded ones again (waiting for an
        all-gather in flight first); ``after_forward`` keeps the rows
        ``reshard_after_forward=k`` asks for."""
        self.wait_for_unshard()
        if self.state is ShardedState.UNSHARDED:
            keep = after_forward and self.post_forward is not None and not self.trivial
            self._free(keep_rows=keep)

    def discard_unsharded(self) -> None:
        """Drop every gathered copy, the rows kept after forward included (before a load or a
        change of dtype or device would make them stale)."""
        self.reshard()
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self._drop_kept_rows()

    def _rows_for_post_forward(self) -> torch.Tensor:
        pf = self.post_forward
        per = self.mesh_info.shard_size // pf.size
        lo = pf.index * per
        layout = self.layout
        rows = torch.empty((per, layout.width), dtype=layout.row_dtype, device=self.device)
        for i, p in enumerate(self.params):
            layout.slot(rows, i).copy_(p.unsharded_rank_blocks()[lo : lo + per])
        return rows

    # --------------------------------------------------------------------------- gradients
    def post_backward(self) -> PendingReduce | None:
        """Take the unsharded gradients, reshard, and issue their reduction."""
        with_grad = self._grad_params
        if not self.requires_gradient_sync or not with_grad:
            self._accumulate_without_sync()
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

    def _accumulate_without_sync(self) -> None:
        """No-sync backward: gradients stay unsharded and keep accumulating (in the reduce
        dtype when it differs, so micro-batches add in that precision); in deterministic
        mode each micro-batch's gradient is a leaf of the summation tree."""
        if self.deterministic:
            for p in self._grad_params:
                p.push_grad_leaf(self.reduce_dtype)
        else:
            for p in self._widened:
                p.accumulate_unsharded_grad(self.reduce_dtype)
        if self.reshard_after_backward:
            self.reshard()

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
        self.wait_for_unshard()
        self._partial_reduce = None
        for p in self.params:
            p.drop_unsharded_grads()
        self.discard_unsharded()
