"""FSDPState: the hooks of one ``fully_shard`` call, and the per-root iteration context.

One training step, for a model with ``fully_shard`` on every block and on the root:

forward
    root pre-forward: lazy init (first time), start the iteration, unshard the root group,
    prefetch the first block's all-gather. Each block's pre-forward waits for its own
    all-gather (already in flight), registers the unsharded parameters, issues the next
    block's, and wraps the block's inputs in an identity autograd function whose backward is
    the block's *post-backward*. Its post-forward reshards (unless the block keeps its
    parameters: ``reshard_after_forward=False``) and hooks the outputs so that the first
    gradient to reach them is the block's *pre-backward*.
backward
    pre-backward: re-gather (or wait for the prefetched gather), prefetch the block that ran
    before this one. post-backward: take the
    unsharded gradients, reshard, issue the reduction without waiting. A final callback,
    queued by the first pre-backward, runs the post-backward of groups whose inputs carried
    no gradient (the root), reshards what is left and waits for every reduction, installing
    the sharded ``.grad``.

What modules register follows each group's memory state (``_param_group.py``): the
unsharded parameters while they are gathered, the shards otherwise, as in PyTorch's FSDP2.

Activation checkpointing re-runs code inside backward, after the group's pre-backward has
gathered (and so registered) its parameters. When the recomputed code is the FSDP module's
own forward, the hooks see the ``PRE_BACKWARD`` state and leave the gathered parameters in
place (gathering again only if a post-backward of an earlier use resharded them).

[Note: recovery] An exception inside forward or backward leaves an iteration half done. The
post-forward hook also runs when forward raises (``always_call``) and marks the iteration
aborted; a backward that raised leaves its final callback queued and never run. The root's
next forward sees either sign and calls ``reset_iter_state()`` itself: in-flight collectives
are finished, unreduced gradients dropped, every group resharded, the trackers cleared.
"""

from __future__ import annotations

import enum
import logging

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from fsdp2._comm_context import CommContext
from fsdp2._param import replaced_by
from fsdp2._param_group import FSDPParamGroup

logger = logging.getLogger(__name__)


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


class IterationContext:
    """State shared by all ``fully_shard`` modules under one root, for one iteration, and
    the root's communication resources (``comm``)."""

    def __init__(self, root: FSDPState, states: list[FSDPState], comm: CommContext) -> None:
        self.root = root
        self.states = states
        self.comm = comm
        self.pre_forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        self.next_in_forward: dict[FSDPState, FSDPState] = {}
        self.callback_queued = False
        self.is_last_backward = True
        self.aborted = False  # a forward raised (see [Note: recovery])

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

    def needs_reset(self) -> bool:
        """Whether the previous iteration was cut short by an exception."""
        return (
            self.aborted
            or self.callback_queued
            or any(s.training_state is not TrainingState.IDLE for s in self.states)
        )

    def finish_reduces(self) -> None:
        self.comm.drain_reduces()
        if any(s.group is not None and s.group.offload for s in self.states):
            self.comm.streams.synchronize_compute()  # the optimizer steps on the host

    def ensure_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(_eager(self.root.final_callback))


def _eager(fn):
    """``fn`` run as plain Python even while a compiled function is active (docs/compile.md)."""
    return torch.compiler.disable(fn)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once their gradients exist."""

    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @torch.compiler.disable  # the autograd engine calls it: keep dynamo out (docs/compile.md)
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
        self.check_freed = False  # the root's fully_shard(check_freed=...) decides
        self.ctx: IterationContext | None = None
        self.outer: FSDPState | None = None  # the enclosing fully_shard call, if any
        # ties to parameters of calls outside this one's subtree, for an enclosing call to
        # resolve: (owner FSDPParam, module, attribute name)
        self.pending_ties: list = []
        self.is_root = False
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None  # None: implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self.post_backward_waiting = 0
        self.needs_post_backward = False
        self._depth = 0
        self._done: set[int] = set()
        self._post_ran = 0  # post-forward hooks that ran normally, for abort detection
        self.handles = []
        # The hooks run eagerly even inside a compiled module or a compiled training step:
        # dynamo does not trace them (they talk to process groups and keep Python state);
        # the forward between them is what torch.compile compiles. The backward entry
        # points (pre-backward, post-backward, the final callback) are kept out the same way.
        pre, post, abort = (
            _eager(h) for h in (self._pre_forward_hook, self._post_forward_hook, self._abort_hook)
        )
        self._pre_backward_eager = _eager(self._pre_backward)
        for m in modules:
            self.handles += [
                m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
                m.register_forward_hook(post),
                m.register_forward_hook(abort, always_call=True),
            ]

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"FSDPState({names})"

    # ----------------------------------------------------------------------- lazy init
    def lazy_init(self) -> None:
        """Become the root of every fully_shard module below us (first forward only)."""
        if self.ctx is not None:
            return
        if self.outer is not None:
            outer = type(self.outer.modules[0]).__name__
            mine = type(self.modules[0]).__name__
            raise RuntimeError(
                f"fully_shard: {mine}.forward ran before the forward of the fully_shard module "
                f"{outer} that contains it. The outermost fully_shard module is the root and "
                f"must run forward first (call model(...), not a submodule); it then sets up "
                f"every module below it."
            )
        states = self.subtree_states()
        paths = _module_paths(self.modules)
        _name_params(states, paths)
        _check_pending_ties(states, paths)
        _check_tied_leftovers(self.modules)
        groups = [s.group for s in states if s.group is not None and s.group.params]
        for g in groups:
            g.follow_meta()
        device = groups[0].device if groups else torch.device("cpu")
        check_freed = any(s.check_freed for s in states)  # any call of this root asked
        ctx = IterationContext(self, states, CommContext(device, check_freed=check_freed))
        for s in states:
            s.ctx = ctx
            s.is_root = s is self
            if s.group is not None:
                arg = s.reshard_after_forward_arg
                s.group.reshard_after_forward = (not s.is_root) if arg is None else bool(arg)
                s.group.check_offload()
                s.group.comm = ctx.comm
                names = ", ".join(paths.get(id(m)) or "root" for m in s.group.modules)
                s.group.scope = f"fsdp {names}"  # what the flight recorder calls it
        _share_buffer_pool(groups, ctx.comm)
        logger.debug("fully_shard root %r manages %d groups", self, len(states))

    def subtree_states(self) -> list[FSDPState]:
        """Every fully_shard state at or below this call's modules, outermost first."""
        return states_below(self.modules)

    def init_from_root(self) -> None:
        """Lazy-init through the outermost fully_shard call containing this one (for calls
        such as ``unshard()`` that may come before the first forward)."""
        root = self
        while root.outer is not None:
            root = root.outer
        root.lazy_init()

    # ----------------------------------------------------------------------- forward
    def _recomputing(self) -> bool:
        """Whether this forward is an activation-checkpoint recomputation: the module is in
        backward and the autograd engine is running (a ``PRE_BACKWARD`` state outside any
        backward is left over from a backward that raised, [Note: recovery])."""
        return (
            self.training_state is TrainingState.PRE_BACKWARD
            and torch._C._current_graph_task_id() != -1
        )

    def in_compute(self) -> bool:
        """Whether the modules are inside their forward, or inside a backward the autograd
        engine is running now (a state an exception left behind does not count)."""
        return self.training_state is TrainingState.FORWARD or self._recomputing()

    def _cast_inputs(self, args, kwargs):
        policy = self.mp_policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            return _cast_floats((args, kwargs), policy.param_dtype)
        return args, kwargs

    def _pre_forward_hook(self, module, args, kwargs):
        if self._recomputing():
            # activation-checkpoint recomputation: pre-backward gathered them already, unless
            # a post-backward of an earlier use of this module resharded them since. The
            # inputs are cast as in forward, or the recomputed tensors differ from the saved.
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        self.lazy_init()
        ctx = self.ctx
        if self.is_root and (ctx.aborted or (self._depth == 0 and ctx.needs_reset())):
            logger.warning(
                "fully_shard: the previous iteration raised inside forward or backward; "
                "resetting FSDP's iteration state (its gradients are dropped)"
            )
            self.reset_iter_state()
        if self.is_root and self._depth == 0:
            ctx.start_forward()
        self._depth += 1
        self.training_state = TrainingState.FORWARD
        ctx.pre_forward_order.append(self)
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
            self.group.register_unsharded()  # also after a save swapped the shards in
            self._prefetch(self._forward_targets(), backward=False)
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled() and self._has_grad_params():
            args, kwargs = self._attach_post_backward(args, kwargs)
        return args, kwargs

    def _post_forward_hook(self, module, args, output):
        if self._recomputing():  # the post-backward reshards; the output is cast as in forward
            return self._cast_output(output)
        self._post_ran += 1
        self._depth -= 1
        self._done.add(id(module))
        tensors = []
        if torch.is_grad_enabled():
            flat = tree_flatten(output)[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if self._depth == 0 and len(self._done) == len(self.modules):
            self._done.clear()
            self.ctx.post_forward_order.append(self)
            if self.group is not None and self.group.reshard_after_forward:
                self.group.reshard(after_forward=True)
            self.training_state = TrainingState.IDLE
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward_eager, mode="any")
        return self._cast_output(output)

    def _cast_output(self, output):
        if self.mp_policy.output_dtype is not None:
            return _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _abort_hook(self, module, args, output):
        """Runs after every forward, also one that raised ([Note: recovery])."""
        if self._post_ran or self._recomputing():
            self._post_ran = max(self._post_ran - 1, 0)  # post-forward ran: nothing to do
            return None
        if self.group is not None:
            self.group.reshard()  # memory back at once; parameters() shows the shards
        if self.ctx is not None and self.training_state is TrainingState.FORWARD:
            self.ctx.aborted = True  # the root's next forward resets the iteration
        self.training_state = TrainingState.IDLE  # out of this forward
        return None

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
            comm = self.ctx.comm
            comm.make_room_for_reduce()
            pending = self.group.post_backward()
            if pending is not None:
                comm.queue_reduce(pending)

    def final_callback(self) -> None:
        """End of backward (root only): finish every group, then wait for reductions."""
        ctx = self.ctx
        if ctx.is_last_backward:
            # Every block's reduction is in flight: finish them and return the pooled
            # buffers before the groups left over (the root) allocate theirs.
            ctx.comm.drain_reduces()
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
            ctx.comm.end_of_backward()
        ctx.callback_queued = False

    # ----------------------------------------------------------------------- recovery
    def reset_iter_state(self) -> None:
        """[Note: recovery] Finish in-flight collectives, drop unreduced gradients, reshard
        every group and clear the trackers, so the next forward starts clean."""
        ctx = self.ctx
        if ctx is None:
            return
        if not self.is_root:
            raise RuntimeError(
                "reset_iter_state: call it on the root fully_shard module (the outermost "
                f"one), got {type(self.modules[0]).__name__}, which is not the root."
            )
        ctx.comm.discard_reduces()
        for s in ctx.states:
            if s.group is not None:
                s.group.reset()
            s.training_state = TrainingState.IDLE
            s.post_backward_waiting = 0
            s.needs_post_backward = False
            s._depth = 0
            s._done.clear()
            s._post_ran = 0
        ctx.comm.end_of_backward()
        ctx.pre_forward_order = []
        ctx.post_forward_order = []
        ctx.callback_queued = False
        ctx.aborted = False

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


def states_below(tops) -> list[FSDPState]:
    """The fully_shard states of ``tops`` and every module below them, outermost first."""
    seen, states = set(), []
    for top in tops:
        for m in top.modules():
            state = m.__dict__.get("_fsdp_state")
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states


def _cast_floats(tree, dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _share_buffer_pool(groups: list[FSDPParamGroup], comm: CommContext) -> None:
    """Pool collective buffers only for groups whose shapes another group shares (the
    blocks of a transformer); the root's are freed after use instead of held all step."""
    counts: dict[tuple, int] = {}
    for g in groups:
        counts[g.buffer_key()] = counts.get(g.buffer_key(), 0) + 1
    for g in groups:
        g.pool = comm.pool if counts[g.buffer_key()] > 1 else comm.no_pool


def _module_paths(roots) -> dict[int, str]:
    """``{id(module): its path under the root}`` (the root itself: its class name)."""
    paths: dict[int, str] = {}
    for i, top in enumerate(roots):
        prefix = f"[{i}]." if len(roots) > 1 else ""
        for name, m in top.named_modules(remove_duplicate=False):
            paths.setdefault(id(m), prefix + name)
    return paths


def module_label(m, paths: dict[int, str] | None = None) -> str:
    """A module's path under the root when known, else its original class name."""
    if paths and paths.get(id(m)):
        return repr(paths[id(m)])
    cls = type(m)
    return getattr(cls, "_fsdp_orig_class", cls).__name__


def _name_params(states, paths: dict[int, str]) -> None:
    """Give each managed parameter its path under the root, for error messages."""
    for state in states:
        for p in state.group.params if state.group is not None else ():
            module, attr = p.locations[0]
            path = paths.get(id(module))
            if path is not None:
                p.fqn = f"{path}.{attr}" if path else attr


def _check_pending_ties(states, paths: dict[int, str]) -> None:
    """A parameter tied across two sibling fully_shard calls needs a call that contains
    both (it then moves to that call's group); none came before the first forward."""
    for s in states:
        for owner, module, attr in s.pending_ties:
            first_module, first_attr = owner.locations[0]
            raise ValueError(
                f"fully_shard: parameter {module_label(first_module, paths)}.{first_attr} is "
                f"tied to {module_label(module, paths)}.{attr}, and the two are sharded by "
                f"separate fully_shard calls (on {module_label(owner.group.modules[0], paths)} "
                f"and on {module_label(s.modules[0], paths)}) with no call containing both. "
                "Call fully_shard on a module that contains both uses (for example the root "
                "model) after them; the shared parameter then moves to that group."
            )


def _check_tied_leftovers(roots) -> None:
    """A replaced parameter still registered in a module below the root means a tie that no
    fully_shard call covered: the two would drift apart. Found by walking the module tree
    (``fully_shard`` marks every parameter it replaced, see [Note: replaced parameters])."""
    for top in roots:
        for name, m in top.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                owner = replaced_by(p) if p is not None else None
                if owner is not None:
                    path = f"{name}.{attr}" if name else attr
                    raise ValueError(
                        f"fully_shard: parameter {path!r} was replaced by fully_shard (as "
                        f"{owner.fqn!r}) but {type(m).__name__}.{attr} still registers the "
                        "original, so the two would drift apart. Call fully_shard on a module "
                        "that contains both uses (for example the root model) after the inner "
                        "calls; the shared parameter then moves to that group."
                    )
