"""FSDPState: the hooks of one ``fully_shard`` call, and the per-root iteration context.

One training step, for a model with ``fully_shard`` on every block and on the root:

forward
    root pre-forward: lazy init (first time), start the iteration, unshard the root group,
    prefetch the first block's all-gather. Each block's pre-forward waits for its own
    all-gather (already in flight), issues the next block's, and wraps the block's inputs in
    an identity autograd function whose backward is the block's *post-backward*. Its
    post-forward reshards (frees the gathered storage) and hooks the outputs so that the
    first gradient to reach them is the block's *pre-backward*.
backward
    pre-backward: re-gather (or wait for the prefetched gather), prefetch the block that ran
    before this one. post-backward: take the unsharded gradients, reshard, issue the
    reduction without waiting. A final callback, queued by the first pre-backward, runs the
    post-backward of groups whose inputs carried no gradient (the root), reshards what is
    left and waits for every reduction, installing the sharded ``.grad``.

Activation checkpointing re-runs a block's forward inside backward; the hooks see the
``PRE_BACKWARD`` state and leave the (already unsharded) parameters alone.
"""

from __future__ import annotations

import enum
import gc
import logging
import weakref
from collections import deque

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from fsdp2 import _collectives as C
from fsdp2 import _host_memory
from fsdp2._param_group import FSDPParamGroup, PendingReduce

logger = logging.getLogger(__name__)

# Every live state, to find the root (the outermost fully_shard module) at lazy init.
_ALL_STATES: weakref.WeakSet = weakref.WeakSet()
# id(original parameter) -> FSDPParam that now manages it (to recognise tied uses). The
# FSDPParam holds the original only weakly, so a stale id is detected by ``owner.original``.
_MANAGED_ORIGINALS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


class IterationContext:
    """State shared by all ``fully_shard`` modules under one root, for one iteration."""

    # Reductions in flight at once. A new one first finishes the oldest, so it reuses that
    # one's buffers; measured at 4 ranks: one in flight, peak RSS ~50 MB lower than two.
    MAX_PENDING_REDUCES = 1

    def __init__(self, root: FSDPState, states: list[FSDPState]) -> None:
        self.root = root
        self.states = states
        self.pre_forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        self.next_in_forward: dict[FSDPState, FSDPState] = {}
        self.callback_queued = False
        self.is_last_backward = True
        self.pending: deque[PendingReduce] = deque()

    def start_forward(self) -> None:
        if self.pre_forward_order:
            order = self.pre_forward_order
            nxt: dict[FSDPState, FSDPState] = {}
            for a, b in zip(order, order[1:], strict=False):
                if a is not b:
                    nxt.setdefault(a, b)
            self.next_in_forward = nxt
        self.pre_forward_order = []
        self.post_forward_order = []
        for s in self.states:
            s.post_backward_waiting = 0

    def make_room_for_reduce(self) -> None:
        """Finish the oldest reductions before a new one takes its buffers, so that at most
        ``MAX_PENDING_REDUCES`` are ever in flight (the freed buffers are reused at once)."""
        while len(self.pending) >= self.MAX_PENDING_REDUCES:
            self._finish_one()

    def queue_reduce(self, pending: PendingReduce) -> None:
        self.pending.append(pending)

    def drain_reduces(self) -> None:
        """Finish every reduction in flight and return the pooled buffers (idle until the
        next step's gathers, so the memory is better given back)."""
        while self.pending:
            self._finish_one()
        C.POOL.clear()

    def finish_reduces(self) -> None:
        self.drain_reduces()
        offloading = [s.group for s in self.states if s.group is not None and s.group.offload]
        if offloading:  # the optimizer steps on the host: wait for the device copies
            offloading[0].streams.synchronize_compute()

    def _finish_one(self) -> None:
        pending = self.pending.popleft()
        pending.group.finish_reduce(pending)

    def ensure_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.root.final_callback)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once their gradients exist."""

    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.post_backward_from_inputs()
        return (None, *grads)


class FSDPState:
    """Hooks and per-module state of one ``fully_shard`` call (one or several modules)."""

    def __init__(
        self,
        modules: tuple[torch.nn.Module, ...],
        group: FSDPParamGroup | None,
        mp_policy,
        reshard_after_forward: bool | int | None,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.reshard_after_forward_arg = reshard_after_forward
        self.ctx: IterationContext | None = None
        self.is_root = False
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None  # None: implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self.post_backward_waiting = 0
        self.needs_post_backward = False
        self._depth = 0
        self._done: set[int] = set()
        for m in modules:
            m.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
            m.register_forward_hook(self._post_forward_hook)
        _ALL_STATES.add(self)

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"FSDPState({names})"

    # ----------------------------------------------------------------------- lazy init
    def lazy_init(self) -> None:
        """Become the root of every fully_shard module below us (first forward only)."""
        if self.ctx is not None:
            return
        self._check_no_uninitialized_ancestor()
        subtree = [m for top in self.modules for m in top.modules()]
        seen, states = set(), []
        for m in subtree:
            state = m.__dict__.get("_fsdp_state")
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                states.append(state)
        ctx = IterationContext(self, states)
        for s in states:
            s.ctx = ctx
            s.is_root = s is self
            if s.group is not None:
                arg = s.reshard_after_forward_arg
                s.group.reshard_after_forward = (not s.is_root) if arg is None else bool(arg)
                s.group.check_dtypes()
                s.group.check_offload()
                s.group.initialized = True
        _share_buffer_pool([s.group for s in states if s.group is not None and s.group.params])
        _name_params(self.modules)
        _check_tied_leftovers(states)
        logger.debug("fully_shard root %r manages %d groups", self, len(states))

    def init_from_root(self) -> None:
        """Lazy-init through the outermost fully_shard module containing this one (for calls
        such as ``unshard()`` that may come before the first forward)."""
        if self.ctx is not None:
            return
        root = self
        for other in list(_ALL_STATES):
            if any(root.modules[0] is m for top in other.modules for m in top.modules()):
                root = other
        root.lazy_init()

    def _check_no_uninitialized_ancestor(self) -> None:
        mine = self.modules[0]
        for other in list(_ALL_STATES):
            if other is self:
                continue
            if any(mine is m for top in other.modules for m in top.modules()):
                outer = type(other.modules[0]).__name__
                raise RuntimeError(
                    f"fully_shard: {type(mine).__name__}.forward ran before the forward of the "
                    f"fully_shard module {outer} that contains it. The outermost fully_shard "
                    f"module is the root and must run forward first (call model(...), not a "
                    f"submodule); it then sets up every module below it. If fully_shard was "
                    f"applied to this submodule after the model's first forward, apply "
                    f"fully_shard to all modules before running any forward."
                )

    # ----------------------------------------------------------------------- forward
    def _pre_forward_hook(self, module, args, kwargs):
        if self.training_state is TrainingState.PRE_BACKWARD:
            return None  # activation-checkpoint recomputation: parameters already unsharded
        self.lazy_init()
        ctx = self.ctx
        if self.is_root and self._depth == 0:
            ctx.start_forward()
        self._depth += 1
        self.training_state = TrainingState.FORWARD
        ctx.pre_forward_order.append(self)
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
            self._prefetch(self._forward_targets(), backward=False)
        policy = self.mp_policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), policy.param_dtype)
        if torch.is_grad_enabled() and self._has_grad_params():
            args, kwargs = self._attach_post_backward(args, kwargs)
        return args, kwargs

    def _post_forward_hook(self, module, args, output):
        if self.training_state is TrainingState.PRE_BACKWARD:
            return None
        self._depth -= 1
        self._done.add(id(module))
        tensors = []
        if torch.is_grad_enabled():
            flat = tree_flatten(output)[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if self._depth == 0 and len(self._done) == len(self.modules):
            self._done.clear()
            self.ctx.post_forward_order.append(self)
            if self.group is not None:
                if not tensors:
                    self.group.reshard()  # nothing to differentiate: no backward will come
                elif self.group.reshard_after_forward:
                    self.group.reshard(after_forward=True)
            self.training_state = TrainingState.IDLE
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _has_grad_params(self) -> bool:
        return self.group is not None and any(p.requires_grad for p in self.group.params)

    def _attach_post_backward(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(self, *(flat[i] for i in idx))
        for i, t in zip(idx, outs, strict=True):
            flat[i] = t
        self.post_backward_waiting += 1
        return spec.unflatten(flat)

    # ----------------------------------------------------------------------- backward
    def _pre_backward(self, *unused) -> None:
        ctx = self.ctx
        ctx.ensure_final_callback()
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.needs_post_backward = True
        group = self.group
        if group is not None and group.unshard_in_backward:
            group.unshard()
            group.wait_for_unshard()
        self._prefetch(self._backward_targets(), backward=True)

    def post_backward_from_inputs(self) -> None:
        self.post_backward_waiting -= 1
        if self.post_backward_waiting <= 0:
            self.run_post_backward()

    def run_post_backward(self) -> None:
        self.post_backward_waiting = 0
        self.needs_post_backward = False
        self.training_state = TrainingState.IDLE
        if self.group is not None:
            self.ctx.make_room_for_reduce()
            pending = self.group.post_backward()
            if pending is not None:
                self.ctx.queue_reduce(pending)

    def final_callback(self) -> None:
        """End of backward (root only): finish every group, then wait for reductions."""
        ctx = self.ctx
        if ctx.is_last_backward:
            # Every block's reduction is in flight: finish them and return the pooled
            # buffers before the groups left over (the root) allocate theirs.
            ctx.drain_reduces()
        for s in ctx.states:
            if s.needs_post_backward:
                s.run_post_backward()
            elif s.group is not None and s.group.reshard_after_backward:
                s.group.reshard()
            s.training_state = TrainingState.IDLE
            s._depth = 0
            s._done.clear()
        if ctx.is_last_backward:
            ctx.finish_reduces()
            _host_memory.PAGES.clear()  # nothing gathers until the next forward
        ctx.callback_queued = False

    # ----------------------------------------------------------------------- prefetch
    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        nxt = self.ctx.next_in_forward.get(self)
        return [nxt] if nxt is not None else []

    def _backward_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.ctx.post_forward_order
        for i in range(len(order) - 1, 0, -1):
            if order[i] is self:
                return [order[i - 1]]
        return []

    @staticmethod
    def _prefetch(targets: list[FSDPState], *, backward: bool) -> None:
        for t in targets:
            if t.group is not None and (t.group.unshard_in_backward or not backward):
                t.group.unshard()


def _cast_floats(tree, dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _share_buffer_pool(groups: list[FSDPParamGroup]) -> None:
    """Pool collective buffers only for groups whose shapes another group shares (the
    blocks of a transformer); the root's are freed after use instead of held all step."""
    counts: dict[tuple, int] = {}
    for g in groups:
        counts[g.buffer_key()] = counts.get(g.buffer_key(), 0) + 1
    for g in groups:
        g.pool = C.POOL if counts[g.buffer_key()] > 1 else C.NO_POOL


def _name_params(roots) -> None:
    """Give each managed parameter its path under the root, for error messages."""
    for top in roots:
        for mod_name, m in top.named_modules(remove_duplicate=False):
            state = m.__dict__.get("_fsdp_state")
            if state is None or state.group is None:
                continue
            for p in state.group.params:
                for loc_mod, attr in p.locations:
                    if loc_mod is m:
                        p.fqn = f"{mod_name}.{attr}" if mod_name else attr


def _check_tied_leftovers(states) -> None:
    """A managed parameter's original still registered in some module means a broken tie.

    ``fully_shard`` replaces a parameter in the modules it covers; a module outside every
    call (a tied embedding, say) would keep training the old, full, unsynchronized tensor.
    The originals are held weakly, so only ones something still references are examined.
    """
    for s in states:
        for p in s.group.params if s.group is not None else ():
            original = p.original
            if original is None:
                continue
            for holder in _modules_registering(original):
                raise ValueError(
                    f"fully_shard: parameter {p.fqn!r} is tied to the {holder} parameter of a "
                    f"module that no fully_shard call covers, so the two would drift apart. "
                    f"Call fully_shard on a module that contains both uses (for example the "
                    f"root model) after the inner calls; the shared parameter then moves to "
                    f"that group."
                )


def _modules_registering(param) -> list[str]:
    """``'Class.attr'`` for every module whose ``_parameters`` holds ``param``."""
    found = []
    for holder in gc.get_referrers(param):
        if not isinstance(holder, dict):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, dict) and owner.get("_parameters") is holder:
                for m in gc.get_referrers(owner):
                    if isinstance(m, torch.nn.Module) and m.__dict__ is owner:
                        attr = next(k for k, v in holder.items() if v is param)
                        found.append(f"{type(m).__name__}.{attr}")
    return found
