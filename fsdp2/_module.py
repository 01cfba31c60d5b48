"""FSDPModule, the class every sharded module joins, and the handles and helpers around it.

``fully_shard`` swaps a module's ``__class__`` for a subclass of both ``FSDPModule`` and the
original class: ``isinstance(module, FSDPModule)`` holds and every original method works.
"""

from __future__ import annotations

import types

from torch import nn

from fsdp2._param_group import FSDPParamGroup, ShardedState
from fsdp2._state import FSDPState, states_below


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather.

    Example:
        >>> handle = model.blocks[1].unshard(async_op=True)
        >>> ...                  # compute while the all-gather runs
        >>> handle.wait()        # the block's full parameters are ready for its forward
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
        return states_below([self]) if recurse else [self._fsdp]

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [s.group for s in self._states(recurse) if s.group is not None]

    # ------------------------------------------------------------------------- memory
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now; with ``async_op`` return a handle.

        The gathered parameters are kept for the module's next forward (which then issues no
        all-gather). Once the all-gather completes (at once, or at ``wait()`` with
        ``async_op``) the module registers them, as PyTorch's FSDP2 does: its attributes and
        ``parameters()`` are the unsharded tensors until ``reshard()`` or the forward that
        reshards; ``state_dict()`` still gives the sharded DTensors.

        Example:
            >>> model.unshard()   # gathered now; forward uses them, reshard() frees them
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
        """Free the unsharded parameters; the module holds its shards only.

        Raises:
            FSDPStateError: called while the module computes with its gathered parameters
                (inside its forward, or inside its backward before its post-backward);
                the message names the module and the states.

        Example:
            >>> model.reshard()
        """
        self._fsdp.reshard()

    def reset_iter_state(self) -> None:
        """Recover after an exception inside forward or backward (root only).

        Finishes the collectives in flight, drops the failed iteration's unreduced and
        partially reduced gradients (no-sync and HSDP accumulation included), reshards every
        group and clears the iteration trackers. The next root forward does this by itself
        when it finds an iteration cut short; call it to recover earlier. Gradients already
        installed on the sharded parameters stay: call ``optimizer.zero_grad()``.

        Raises:
            RuntimeError: called on a module that is not the root.

        Example:
            >>> try:
            ...     loss_fn(model(x)).backward()
            ... except RuntimeError:
            ...     model.reset_iter_state(); opt.zero_grad()
        """
        self._fsdp.reset_iter_state()

    # ------------------------------------------------------------------------- controls
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse=True) -> None:
        """Turn gradient reduction off (gradient accumulation) or back on.

        Without sync, gradients accumulate unsharded on every rank (in ``reduce_dtype`` when
        it differs from ``param_dtype``); the next backward with sync reduces the sum.

        Example:
            >>> model.set_requires_gradient_sync(False)
            >>> loss(micro_batch_0).backward()
            >>> model.set_requires_gradient_sync(True)
            >>> loss(micro_batch_1).backward()     # reduces both micro-batches' gradients
        """
        flag = _check_bool(requires_gradient_sync, "requires_gradient_sync")
        for g in self._groups(recurse):
            g.requires_gradient_sync = flag

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse=True) -> None:
        """HSDP: skip (False) or do (True) the all-reduce across replicas after the reduction.

        Reductions without it are summed and kept; the next one with it adds them in before
        the all-reduce, so accumulated gradients equal one big batch's.

        Example:
            >>> model.set_requires_all_reduce(False)   # micro-batches before the last one
        """
        flag = _check_bool(requires_all_reduce, "requires_all_reduce")
        for g in self._groups(recurse):
            g.requires_all_reduce = flag

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse=True) -> None:
        """Free (True) or keep (False) the unsharded parameters between forward and backward.

        Raises:
            RuntimeError: called between a forward and its backward while a group holds
                the rows ``reshard_after_forward=int`` kept.

        Example:
            >>> model.set_reshard_after_forward(False)   # trade memory for one all-gather
        """
        flag = _check_bool(reshard_after_forward, "reshard_after_forward")
        states = self._states(recurse)
        for s in states:
            if s.group is not None and s.group.state is ShardedState.SHARDED_POST_FORWARD:
                raise RuntimeError(
                    "set_reshard_after_forward: call it between steps; a forward has run "
                    "whose backward still needs the rows kept by reshard_after_forward=int."
                )
        for s in states:
            if s.group is not None:
                s.group.set_reshard_after_forward(flag)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse=True) -> None:
        """Free (True) or keep (False) the unsharded parameters after backward.

        Example:
            >>> model.set_reshard_after_backward(False)   # e.g. during gradient accumulation
        """
        flag = _check_bool(reshard_after_backward, "reshard_after_backward")
        for g in self._groups(recurse):
            g.reshard_after_backward = flag

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

        Reductions are sums followed by a division (gloo has no pre-multiplied sum).

        Example:
            >>> model.set_gradient_divide_factor(1.0)   # sum gradients instead of averaging
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(
                f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}."
            )
        for g in self._groups(True):
            g.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """PyTorch's older name for ``set_gradient_divide_factor`` (same meaning).

        Example:
            >>> model.set_reduce_scatter_divide_factor(1.0)
        """
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Ask for sum-only reductions. Every reduction here already is a sum followed by a
        division, on gloo and NCCL alike, so the flag is recorded and changes nothing.

        Example:
            >>> model.set_force_sum_reduction_for_comms(True)
        """
        flag = _check_bool(enable, "enable")
        for g in self._groups(True):
            g.force_sum_reduction_for_comms = flag

    def set_deterministic_reduction(self, enabled: bool = True, *, recurse=True) -> None:
        """Sum gradients in one fixed order, whatever the world size (off by default).

        Every gradient is summed along one pairwise tree over the global batch's
        micro-batches in rank order: a rank's micro-batches accumulated without sync form
        its lower levels, the ranks' sums (moved to each shard's owner by an all-to-all,
        on every backend) its upper ones, HSDP's replicas its top. So, for a global batch
        of equal micro-batches split into consecutive runs of a power-of-two length per
        rank, world sizes ``W`` and ``2W`` (and one process) give bit-identical gradients
        and, with an elementwise optimizer, parameters - where the model's own kernels
        allow (docs/fsdp2.md, "Determinism"). PyTorch's FSDP2 has no such switch.

        Costs: the same bytes on the wire; off gloo an all-to-all replaces the
        reduce-scatter and needs a receive buffer as large as its input; accumulating ``m``
        micro-batches keeps up to ``log2(m)`` unsharded gradients instead of one.

        Raises:
            RuntimeError: gradients accumulated without sync wait for their reduction.

        Example:
            >>> model.set_deterministic_reduction(True)   # world size 4 == world size 2
        """
        flag = _check_bool(enabled, "enabled")
        groups = self._groups(recurse)
        if any(p.has_unreduced_grads() for g in groups for p in g.params):
            raise RuntimeError(
                "set_deterministic_reduction: gradients accumulated without sync wait for "
                "their reduction; switch between steps (after a backward with sync)."
            )
        for g in groups:
            g.deterministic = flag

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(reduced)`` on every reduction of this module's group.

        ``reduced`` is this rank's flat reduced gradient values (every parameter's block),
        a sum: after the replicate all-reduce under HSDP, after the shard-group reduction
        otherwise, before the division by the data-parallel size. The hook may modify it in
        place (e.g. all-reduce it over a group of its own). ``stream`` must be None: on
        CUDA the hook runs where the reduction finishes.

        Example:
            >>> model.set_all_reduce_hook(lambda g: dist.all_reduce(g, group=replicas))
        """
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {hook!r}.")
        if stream is not None:
            raise NotImplementedError(
                "set_all_reduce_hook: stream must be None; the hook runs where the reduction "
                "finishes."
            )
        group = self._fsdp.group
        if group is not None:
            group.all_reduce_hook = hook

    def set_post_optim_event(self, event) -> None:
        """CUDA: let the next forward's first all-gather wait for ``event`` (recorded after
        the optimizer step) instead of everything queued before it. On CPU collectives
        follow program order and this does nothing. Set a new event each iteration.

        Example:
            >>> opt.step(); ev = torch.cuda.Event(); ev.record(); model.set_post_optim_event(ev)
        """
        state = self._fsdp
        state.init_from_root()
        if state.ctx.comm.streams.enabled:
            state.ctx.comm.post_optim_event = event

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

    # ------------------------------------------------------------------------- conversions
    def _apply(self, fn, *args, **kwargs):
        # .to() / .float() / to_empty(): drop unsharded copies first, so none outlives a
        # change of dtype or device; conversions then act on the registered shards, and
        # the groups compute again what their parameters' dtypes decide.
        groups = self._groups(True)
        for m in self.modules():  # tied parameters an enclosing call's group took over
            for fp in m.__dict__.get("_fsdp_locations", {}).values():
                if fp.group is not None and all(fp.group is not g for g in groups):
                    groups.append(fp.group)
        for g in groups:
            g.discard_unsharded()
        out = super()._apply(fn, *args, **kwargs)
        for g in groups:
            g.adopt_assigned()  # a conversion that built new parameter objects
            if g.initialized:
                g.refresh_dtypes()
        return out

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
        try:
            out = method(self, *args, **kwargs)
        except BaseException:
            state._abort_hook(self, args, None)
            raise
        result = state._post_forward_hook(self, args, out)
        state._abort_hook(self, args, out)
        return out if result is None else result

    setattr(module, method_name, types.MethodType(wrapped, module))


_CLASS_CACHE: dict[type, type] = {}


def swap_class(module: nn.Module) -> None:
    """Make ``module`` an instance of ``FSDP<its class>`` (a subclass of both)."""
    cls = module.__class__
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_fsdp_orig_class": cls})
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls
