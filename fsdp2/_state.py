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

Each ``FSDPState`` moves its ``TrainingState`` (``_lifecycle.py``) from its hooks, one
checked method per move: IDLE -> FORWARD (pre-forward) -> IDLE (post-forward); IDLE ->
PRE_BACKWARD (pre-backward) -> POST_BACKWARD (post-backward) -> IDLE (the final callback).
Between a module's post-backward and the end of backward it is POST_BACKWARD.

[Note: recovery] An exception inside forward or backward leaves an iteration half done. The
post-forward hook also runs when forward raises (``always_call``) and marks the iteration
aborted; a backward that raised leaves its final callback queued and never run. The root's
next forward sees either sign and calls ``reset_iter_state()`` itself: in-flight collectives
are finished, unreduced gradients dropped, every group resharded, the trackers cleared.
"""

from __future__ import annotations

import logging

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from device_mesh.groups import simulated_world
from dtensor import debug
from fsdp2._comm_context import CommContext
from fsdp2._lifecycle import FSDPStateError, ShardedState, TrainingState, check_move
from fsdp2._param import replaced_by
from fsdp2._param_group import FSDPParamGroup

logger = logging.getLogger(__name__)

_BUG = "(a bug in fsdp2's runtime: please report it with this message)"
_IDLE, _FORWARD = TrainingState.IDLE, TrainingState.FORWARD
_PRE_BACKWARD, _POST_BACKWARD = TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD


class IterationContext:
    """State shared by all ``fully_shard`` modules under one root, for one iteration, and
    the root's communication resources (``comm``).

    Example:
        >>> ctx = model._fsdp.ctx              # after the first forward
        >>> ctx.root is model._fsdp, len(ctx.states)
        (True, 3)
    """

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
        """A new iteration: learn the forward order of the last one (implicit prefetch)."""
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
            s.start_iteration()

    def needs_reset(self) -> bool:
        """Whether the previous iteration was cut short by an exception."""
        return (
            self.aborted
            or self.callback_queued
            or any(s.training_state is not _IDLE for s in self.states)
        )

    def reset(self) -> None:
        """Forget the iteration an exception cut short ([Note: recovery])."""
        self.pre_forward_order = []
        self.post_forward_order = []
        self.callback_queued = False
        self.aborted = False

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
    """Hooks and per-module state of one ``fully_shard`` call (one or several modules).

    Built whole by ``fully_shard``. Owns what the call was given for all its modules - the
    modules, ``mp_policy``, ``check_freed`` - its place among the calls (``outer``, the ties
    it leaves to an enclosing call), its ``TrainingState``, and its ``FSDPParamGroup``, which
    it builds from ``params`` and the group's settings (None for a call with no parameters).
    The root's lazy init gives every state below it the iteration context (``join``).

    Example:
        >>> state = model.blocks[0]._fsdp
        >>> state.training_state, state.group.state        # between steps
        (<TrainingState.IDLE: 'idle'>, <ShardedState.SHARDED: 'sharded'>)
    """

    def __init__(
        self,
        modules: tuple[torch.nn.Module, ...],
        params: list,
        *,
        mesh_info,
        device: torch.device,
        mp_policy,
        offload_policy,
        reshard_after_forward: bool | None,
        post_forward,
        check_freed: bool = False,
        pending_ties: list | None = None,
    ) -> None:
        self.modules = modules
        self.mp_policy = mp_policy
        self.check_freed = check_freed  # the root's CommContext: on when any call asks
        # ties to parameters of calls outside this one's subtree, for an enclosing call to
        # resolve: (owner FSDPParam, module, attribute name)
        self.pending_ties: list = list(pending_ties or ())
        self.outer: FSDPState | None = None  # the enclosing fully_shard call (nest_in)
        self.group: FSDPParamGroup | None = None
        if params:
            self.group = FSDPParamGroup(
                self, params, mesh_info, device, offload_policy, reshard_after_forward, post_forward
            )
        # set by the root's lazy init (join)
        self.ctx: IterationContext | None = None
        self.is_root = False
        self.path: str | None = None  # the modules' paths under the root
        # the training state and what it counts
        self.training_state = _IDLE
        self.post_backward_waiting = 0  # _PostBackward nodes of this iteration not yet run
        self._forward_calls: list[bool] = []  # forwards in progress: whether post-forward ran
        self._finished: set[int] = set()  # modules whose forward finished (a list call)
        # controls (FSDPModule.set_modules_to_*_prefetch)
        self.forward_prefetch: list[FSDPState] | None = None  # None: implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self.handles = self._register_hooks()

    def _register_hooks(self) -> list:
        # The hooks run eagerly even inside a compiled module or a compiled training step:
        # dynamo does not trace them (they talk to process groups and keep Python state);
        # the forward between them is what torch.compile compiles. The backward entry
        # points (pre-backward, post-backward, the final callback) are kept out the same way.
        pre, post, abort = (
            _eager(h) for h in (self._pre_forward_hook, self._post_forward_hook, self._abort_hook)
        )
        self._pre_backward_eager = _eager(self._pre_backward)
        handles = []
        for m in self.modules:
            handles += [
                m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
                m.register_forward_hook(post),
                m.register_forward_hook(abort, always_call=True),
            ]
        return handles

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"FSDPState({names})"

    @property
    def label(self) -> str:
        """The call's modules, for messages: their paths under the root once the root's
        lazy init knows them, else their classes."""
        if self.path is not None:
            return repr(self.path)
        return ", ".join(module_label(m) for m in self.modules)

    @property
    def reshard_after_forward_arg(self) -> bool | None:
        """The group's ``reshard_after_forward`` (None until the root's lazy init settles
        it), as ``fsdp2.tools`` reads it; the group owns it."""
        return None if self.group is None else self.group.reshard_after_forward

    # ----------------------------------------------------------------------- set-up
    def nest_in(self, outer: FSDPState) -> None:
        """``outer`` (a later ``fully_shard`` call) contains this call's modules; the ties
        this call left pending moved up to it ([Note: tied parameters])."""
        self.outer = outer
        self.pending_ties = []

    def give_up(self, fp) -> None:
        """An enclosing call takes over the tied parameter ``fp``; a group left with no
        parameters is dropped, so the hooks run with nothing to gather, reshard or reduce."""
        self.group.remove(fp)
        if not self.group.params:
            self.group = None

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
        groups = [s.group for s in states if s.group is not None]
        for g in groups:
            g.adopt_assigned()  # [Note: assigned parameters]
        _check_materialized(groups)
        for g in groups:
            g.check_offload()
        device = groups[0].device if groups else torch.device("cpu")
        check_freed = any(s.check_freed for s in states)  # any call of this root asked
        ctx = IterationContext(self, states, CommContext(device, check_freed=check_freed))
        pooled = _pooled_groups(groups)
        for s in states:
            s.join(ctx, paths, pooled)
        logger.debug("fully_shard root %r manages %d groups", self, len(states))

    def join(self, ctx: IterationContext, paths: dict[int, str], pooled: set[int]) -> None:
        """Join the root's iteration context (its lazy init), attaching the group to the
        root's ``CommContext``; ``pooled`` holds the ids of groups that pool buffers."""
        self.ctx = ctx
        self.is_root = ctx.root is self
        self.path = ", ".join(paths.get(id(m)) or "root" for m in self.modules)
        if self.group is not None:
            self.group.lazy_init(
                ctx.comm,
                is_root=self.is_root,
                scope=f"fsdp {self.path}",  # what the flight recorder calls it
                pooled=id(self.group) in pooled,
            )

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

    # ----------------------------------------------------------------------- moves
    # Each move of the training state checks where it comes from (_lifecycle.py).
    def _move(self, allowed: tuple, target: TrainingState) -> None:
        check_move(self.label, self.training_state, allowed, target, _BUG)
        self.training_state = target

    def _enter_forward(self) -> None:
        """IDLE (also POST_BACKWARD, or a PRE_BACKWARD a raised backward left) -> FORWARD;
        a nested forward of a module already in FORWARD is no move."""
        if self.training_state is not _FORWARD:
            self._move((_IDLE, _POST_BACKWARD, _PRE_BACKWARD), _FORWARD)
        self._forward_calls.append(False)

    def _leave_forward(self) -> None:
        """FORWARD -> IDLE: the forward of every module of the call finished, or raised."""
        self._move((_FORWARD,), _IDLE)

    def _enter_pre_backward(self) -> None:
        """IDLE (also FORWARD, or POST_BACKWARD for a module used again) -> PRE_BACKWARD."""
        self._move((_IDLE, _FORWARD, _POST_BACKWARD), _PRE_BACKWARD)

    def _enter_post_backward(self) -> None:
        """PRE_BACKWARD -> POST_BACKWARD: the modules' backward is done."""
        self._move((_PRE_BACKWARD,), _POST_BACKWARD)

    def _end_backward(self) -> None:
        """POST_BACKWARD (also IDLE, or a list call's partial FORWARD) -> IDLE: the end of
        backward, from the root's final callback."""
        self._move((_POST_BACKWARD, _IDLE, _FORWARD), _IDLE)
        self._forward_calls.clear()
        self._finished.clear()

    def start_iteration(self) -> None:
        """The root's forward starts an iteration: no post-backward is awaited yet."""
        self.post_backward_waiting = 0

    # ----------------------------------------------------------------------- forward
    def _recomputing(self) -> bool:
        """Whether this forward is an activation-checkpoint recomputation: the module is in
        backward and the autograd engine is running (a ``PRE_BACKWARD`` state outside any
        backward is left over from a backward that raised, [Note: recovery])."""
        return self.training_state is _PRE_BACKWARD and torch._C._current_graph_task_id() != -1

    def in_compute(self) -> bool:
        """Whether the modules are inside their forward, or inside a backward the autograd
        engine is running now (a state an exception left behind does not count)."""
        return self.training_state is _FORWARD or self._recomputing()

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
        if self.is_root:
            self._root_pre_forward()
        self._enter_forward()
        self.ctx.pre_forward_order.append(self)
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
            self._prefetch(self._forward_targets(), backward=False)
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled() and self.group is not None and self.group.trains:
            args, kwargs = self._attach_post_backward(args, kwargs)
        return args, kwargs

    def _root_pre_forward(self) -> None:
        """The root's pre-forward, before its own unshard: reset an iteration an exception
        cut short ([Note: recovery]), and start a new iteration (a training step) at the
        outermost forward (not at a nested one: ``generate`` calling ``forward``)."""
        ctx = self.ctx
        if ctx.aborted or (not self._forward_calls and ctx.needs_reset()):
            logger.warning(
                "fully_shard: the previous iteration raised inside forward or backward; "
                "resetting FSDP's iteration state (its gradients are dropped)"
            )
            self.reset_iter_state()
        if not self._forward_calls:  # the outermost forward: a new iteration starts
            ctx.start_forward()
            if not torch.compiler.is_compiling():
                debug.new_step()  # the flight recorder numbers steps (docs/debugging.md)

    def _post_forward_hook(self, module, args, output):
        if self._recomputing():  # the post-backward reshards; the output is cast as in forward
            return self._cast_output(output)
        if self._forward_calls:
            self._forward_calls[-1] = True  # this forward did not raise (see _abort_hook)
        self._finished.add(id(module))
        tensors = []
        if torch.is_grad_enabled():
            flat = tree_flatten(output)[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(self._forward_calls) == 1 and len(self._finished) == len(self.modules):
            self._finish_forward()
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward_eager, mode="any")
        return self._cast_output(output)

    def _finish_forward(self) -> None:
        """The outermost forward of every module of the call returned: reshard (unless the
        group keeps its parameters) and leave FORWARD."""
        self._finished.clear()
        self.ctx.post_forward_order.append(self)
        if self.group is not None and self.group.reshard_after_forward:
            self.group.reshard(after_forward=True)
        self._leave_forward()

    def _cast_output(self, output):
        if self.mp_policy.output_dtype is not None:
            return _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _abort_hook(self, module, args, output):
        """Runs after every forward, also one that raised ([Note: recovery]): one whose
        post-forward did not run resharded at once and marks the iteration aborted."""
        if self._recomputing() or not self._forward_calls or self._forward_calls.pop():
            return None  # a recomputation, no forward of ours, or its post-forward ran
        if self.group is not None:
            self.group.reshard()  # memory back at once; parameters() shows the shards
        if self.training_state is _FORWARD:
            self.ctx.aborted = True  # the root's next forward resets the iteration
            self._finished.clear()
            self._leave_forward()
        return None

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
        if self.training_state is _PRE_BACKWARD:
            return
        self._enter_pre_backward()
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
        """The modules' backward is done: reshard and issue the gradient reduction."""
        self._enter_post_backward()
        self.post_backward_waiting = 0
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
            s._finish_backward()
        if ctx.is_last_backward:
            ctx.finish_reduces()
            ctx.comm.end_of_backward()
        ctx.callback_queued = False

    def _finish_backward(self) -> None:
        """Run the post-backward of a call whose inputs carried no gradient (the root),
        reshard what a post-backward left gathered, and return to IDLE."""
        if self.training_state is _PRE_BACKWARD:
            self.run_post_backward()
        elif self.group is not None and self.group.reshard_after_backward:
            self.group.reshard()
        self._end_backward()

    # ----------------------------------------------------------------------- user requests
    def reshard(self) -> None:
        """``FSDPModule.reshard()``: free the gathered parameters - refused while the
        modules compute with them (inside their forward, or their backward before the
        post-backward), where autograd still reads them."""
        group = self.group
        if group is None:
            return
        if self.in_compute() and group.state in (ShardedState.UNSHARDED, ShardedState.UNSHARDING):
            raise FSDPStateError(
                self.label,
                group.state,
                ShardedState.SHARDED,
                f"while in {self.training_state}: reshard() would free the parameters its "
                "forward or backward is computing with. Call reshard() after the module's "
                "forward returned (a forward hook registered after fully_shard runs then) "
                "or between steps.",
            )
        group.reshard()

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
            s._reset()
        ctx.comm.end_of_backward()
        ctx.reset()

    def _reset(self) -> None:
        """Any training state -> IDLE, the group resharded and its gradients dropped."""
        if self.group is not None:
            self.group.reset()
        self.training_state = _IDLE
        self.post_backward_waiting = 0
        self._forward_calls.clear()
        self._finished.clear()

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


def _pooled_groups(groups: list[FSDPParamGroup]) -> set[int]:
    """The ids of the groups that pool collective buffers: those whose shapes another group
    shares (the blocks of a transformer); the root's are freed after use instead of held
    all step."""
    keys = {id(g): g.buffer_key() for g in groups}
    counts: dict[tuple, int] = {}
    for key in keys.values():
        counts[key] = counts.get(key, 0) + 1
    return {i for i, key in keys.items() if counts[key] > 1}


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


def _check_materialized(groups) -> None:
    """No parameter may still be on the meta device at the first forward, as in PyTorch's
    FSDP2: it would compute on meta and fail later, far from the cause. A dry run under
    PyTorch's fake process group, where every parameter of a group is on meta, computes on
    meta instead ([Note: dry run on meta] in ``_param_group.py``)."""
    on_meta = []
    for g in groups:
        mine = g.on_meta()
        if mine and simulated_world() and len(mine) == len(g.params):
            g.follow_meta()
        else:
            on_meta += mine
    if not on_meta:
        return
    names = ", ".join(repr(p.fqn) for p in on_meta[:6]) + (" ..." if len(on_meta) > 6 else "")
    device = groups[0].device.type
    raise RuntimeError(
        f"fully_shard: {len(on_meta)} parameter(s) are still on the meta device at the first "
        f"forward: {names}. Materialize them before training: model.to_empty(device="
        f"{device!r}) and then initialize them (model.reset_parameters(), or each module's "
        "reset_parameters()), or load sharded values with model.load_state_dict(sharded_sd, "
        "assign=True), each value a DTensor built with distribute_tensor(full, "
        "p.device_mesh, p.placements) from the parameter p it replaces."
    )


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
