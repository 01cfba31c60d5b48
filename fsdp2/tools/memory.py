"""MemoryTracker: live tensor bytes of a training step, by category, module and phase.

[Note: memory tracker] While the context is active, a ``TorchDispatchMode`` sees every
operator the process runs (forward, the autograd engine's backward, the optimizer, the
collectives of ``fully_shard``) and registers the storage of every tensor an operator
returns; a weak reference to that storage's Python object (which torch keeps alive exactly
as long as the storage itself) tells when it is freed. Memory is counted by *unique storage*,
so views and shared tensors count once, and at the storage's current size, so a storage
freed with ``untyped_storage().resize_(0)`` counts as freed. The parameters, gradients and
optimizer state given to the tracker (and everything ``fully_shard`` manages below the
given modules) are found by walking them, so what existed before the context is counted
too.

Categories (``CATEGORIES``), by what a storage is *now*, walked at every sample:

* ``sharded_params`` - parameters at rest: ``fully_shard``'s local shards, and the plain
  parameters of modules outside ``fully_shard``;
* ``unsharded_params`` - ``fully_shard``'s gathered parameters, counted only while they
  have memory: one freed by resizing its storage to zero, or by dropping its pages
  ([Note: host memory] in ``fsdp2/_host_memory.py``), counts zero;
* ``sharded_grads`` / ``unsharded_grads`` - ``.grad`` of the above (and gradients
  accumulated without sync);
* ``optimizer_state`` - ``optimizer.state`` of the optimizers given, or stepped inside;
* ``comm_buffers`` - fsdp2's buffer pool (kept or lent), the page bank's held pages, and
  DTensor's collective workspaces;
* ``activations`` - everything else a forward made (what autograd saved for backward
  included), and the inputs of tracked modules;
* ``temporaries`` - everything else made in backward or in the optimizer step;
* ``other`` - module buffers, tensors given to ``track_external``, and memory made before
  the context that an operator inside views (a data set sliced into batches).

Phases (``PHASES``): ``forward`` from a tracked module's forward (outside backward), ``backward``
from the autograd engine's start, ``optimizer`` from an optimizer's ``step``; each lasts
until the next begins, so the loss belongs to forward, gradient clipping to backward and
``zero_grad`` to the optimizer.

The tracker samples after every operator: ``current`` is the sum now, ``peak`` the highest
sample. Library code logs and never prints: ``summary()`` returns plain data,
``log_summary()`` logs it, and ``fsdp2.tools.tables`` renders it as a rich table.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from dtensor import DTensor, live_workspaces
from dtensor.spec import local_of
from fsdp2._host_memory import region_at
from fsdp2._param import is_managed, unsharded_of
from fsdp2._storage import MappedStorage

logger = logging.getLogger(__name__)

CATEGORIES = (
    "sharded_params",
    "unsharded_params",
    "sharded_grads",
    "unsharded_grads",
    "optimizer_state",
    "activations",
    "temporaries",
    "comm_buffers",
    "other",
)
PHASES = ("forward", "backward", "optimizer")

__all__ = ["MemoryTracker", "ModuleStats", "Sample"]


@dataclass
class ModuleStats:
    """What one module's calls did to memory (bytes; the highest over its calls).

    ``before_forward`` / ``after_forward``: the total when its forward began and ended
    (``after - before`` is what the forward left alive: activations, gathered parameters);
    ``forward_peak`` / ``backward_peak``: the highest total inside its forward (its
    ``fully_shard`` hooks included) and inside its backward.

    Example:
        >>> stats = tracker.by_module()["blocks.0"]
        >>> stats.forward_peak >= stats.after_forward
        True
    """

    calls: int = 0
    before_forward: int = 0
    after_forward: int = 0
    forward_peak: int = 0
    backward_peak: int = 0


@dataclass
class Sample:
    """One point of the timeline (``MemoryTracker(timeline=True)``): after operator number
    ``index``, in ``phase`` of step ``step`` (counted from 0; a step runs from its forward to
    the next step's forward, so its ``zero_grad`` belongs to it), ``bytes`` per category (in
    the order of ``CATEGORIES``).

    Example:
        >>> s = tracker.timeline[0]
        >>> s.phase, sum(s.bytes) > 0
        ('forward', True)
    """

    index: int
    step: int
    phase: str
    bytes: tuple[int, ...] = field(default_factory=tuple)


# A storage that is two things at once counts as the first here: a gradient shard that views
# a collective's receive buffer is a gradient.
_PRIORITY = {
    c: i
    for i, c in enumerate(
        ("sharded_params", "sharded_grads", "unsharded_params", "unsharded_grads")
        + ("optimizer_state", "comm_buffers", "other")
    )
}


def _state_tensors(opt):
    """The tensors of an optimizer's state (a dict of dicts of tensors and numbers)."""
    for st in opt.state.values():
        values = st.values() if isinstance(st, dict) else tree_leaves(st)
        for t in values:
            if isinstance(t, torch.Tensor):
                yield t


def _tensors_in(out):
    """The tensors in an operator's result (a tensor, or a tuple or list of them)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return out
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Record:
    __slots__ = ("nbytes", "category", "birth", "device", "ref")

    def __init__(self, nbytes: int, category: str, birth: str, device: str, ref) -> None:
        self.nbytes = nbytes
        self.category = category
        self.birth = birth
        self.device = device
        self.ref = ref


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_of(t) if isinstance(t, DTensor) else t


def _storage_of(t) -> torch.UntypedStorage | None:
    """The storage holding ``t``'s bytes (a DTensor's local tensor's); None for a tensor
    without memory (meta) or a wrapper subclass (its inner tensors are registered)."""
    if not isinstance(t, torch.Tensor):
        return None
    t = _local(t)
    if t.device.type == "meta" or t.layout != torch.strided or is_traceable_wrapper_subclass(t):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class _Roles:
    """What one walk found: the role of each storage it reached (when several reach one,
    the first in ``_PRIORITY``; a collective buffer keeps the first role it got), and those
    storages in the order reached, referenced until they are registered."""

    def __init__(self) -> None:
        self.of: dict[int, str] = {}
        self.live: list = []

    def assign(self, t, category: str) -> None:
        """``t``'s storage plays ``category`` (unless it already plays a higher one)."""
        storage = _storage_of(t)
        if storage is None:
            return
        key = id(storage)
        held = self.of.get(key)
        if held is None:
            self.live.append(storage)
        if held is None or _PRIORITY[category] < _PRIORITY[held]:
            self.of[key] = category

    def assign_comm_buffer(self, storage) -> None:
        """``storage`` is a collective's buffer, unless it was reached before."""
        if id(storage) not in self.of:
            self.of[id(storage)] = "comm_buffers"
            self.live.append(storage)


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._after_op(out, getattr(func, "is_view", False))
        return out


class MemoryTracker:
    """Track live tensor bytes by category, module and phase, current and peak, on any
    device (see [Note: memory tracker] in ``fsdp2/tools/memory.py``).

    Give it the modules and optimizers to walk (here or with ``track_external``), then run
    the steps inside ``with tracker:``. ``timeline=True`` keeps one ``Sample`` per operator
    in ``timeline`` (for a chart, ``fsdp2.tools.chart``); ``timeline=n`` keeps only those
    of the last ``n`` optimizer steps (and of the step under way).

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> opt = torch.optim.Adam(model.parameters())
        >>> with MemoryTracker(model, opt) as tracker:
        ...     model(torch.randn(32, 8)).sum().backward()
        ...     opt.step()
        >>> tracker.by_category()["optimizer_state"]  # Adam: 2 x 212 floats, 4 step counts
        1712
    """

    def __init__(self, *external, timeline: bool | int = False) -> None:
        self._modules: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._tensors: list[torch.Tensor] = []
        self._keep_timeline = timeline
        self.timeline: list[Sample] = []
        self._records: dict[int, _Record] = {}
        self._dead: deque = deque()  # (id, weakref) of storages freed, not yet forgotten
        self._totals: dict[tuple[str, str], int] = defaultdict(int)  # (device, category)
        self._roles: dict[int, str] = {}
        self._fsdp: list = []  # FSDPParam
        self._plain: list = []  # parameters outside fully_shard
        self._pools: list = []  # fsdp2's collective buffer pools
        self._pending_other: list[int] = []  # views of unknown memory since the last walk
        self._banks: list = []
        self._volatile_ids: set[int] = set()
        self._volatile: dict[tuple[str, str], int] = {}
        self._names: dict[int, str] = {}
        self._module_stats: dict[str, ModuleStats] = {}
        self._in_forward: list[tuple[str, int]] = []  # (name, peak so far)
        self._in_backward: dict[str, int] = {}
        self._phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}
        self._peak = 0
        self._peak_by: dict[tuple[str, str], int] = {}
        self._in_optimizer = 0
        self._last_phase = "forward"
        self._sample_step = 0  # the step samples belong to: from its forward to the next
        self._stepping: list = []  # optimizers inside step(), innermost last
        self._state_count = -1  # state entries of the stepping optimizer when last looked
        self._walked: set[int] = set()  # modules whose hooks walk (fully_shard ones, roots)
        self._states: list = []  # the fully_shard states below the tracked modules
        self._step = 0
        self._ops = 0
        self._handles: list = []
        self._grad_handles: list = []
        self._mode: _Mode | None = None
        self.track_external(*external)

    # ------------------------------------------------------------------------- setup
    def track_external(self, *external) -> None:
        """Walk these too: modules (their parameters, gradients, buffers and everything
        ``fully_shard`` manages below them), optimizers (their state) and tensors.

        Example:
            >>> tracker = MemoryTracker()
            >>> tracker.track_external(model, opt)
        """
        for obj in external:
            if isinstance(obj, nn.Module):
                self._modules.append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                self._optimizers.append(obj)
            elif isinstance(obj, torch.Tensor):
                self._tensors.append(obj)
            else:
                raise TypeError(
                    "MemoryTracker.track_external: expected modules, optimizers or tensors, "
                    f"got {type(obj).__name__}."
                )

    def __enter__(self) -> MemoryTracker:
        if self._mode is not None:
            raise RuntimeError("MemoryTracker: this tracker is already active.")
        self._names = {}
        self._states, self._walked = [], {id(root) for root in self._modules}
        for root in self._modules:
            for name, m in root.named_modules():
                if id(m) in self._names:
                    continue
                self._names[id(m)] = name or type(m).__name__
                state = m.__dict__.get("_fsdp_state")
                if state is not None:
                    self._walked.add(id(m))
                    if not any(state is st for st in self._states):
                        self._states.append(state)
                self._handles += [
                    m.register_forward_pre_hook(self._pre_forward, prepend=True),
                    m.register_forward_hook(self._post_forward, always_call=True),
                ]
        self._handles += [
            register_optimizer_step_pre_hook(self._pre_step),
            register_optimizer_step_post_hook(self._post_step),
        ]
        self._walk()
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._sample()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)
        self._end_backward_windows()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._walk()
        self._sample()

    # ------------------------------------------------------------------------- results
    @property
    def current(self) -> int:
        """Live bytes now (all devices); after the context, at its exit.

        Example:
            >>> tracker.current <= tracker.peak
            True
        """
        self._sample_if_active()
        return self._current()

    def _current(self) -> int:
        return sum(self._totals.values()) + sum(self._volatile.values())

    def _sample_if_active(self) -> None:
        if self._mode is not None:  # hooks may have freed memory since the last operator
            self._walk()
            self._sample()

    @property
    def peak(self) -> int:
        """The highest ``current`` of any sample so far (all devices).

        Example:
            >>> tracker.peak >= tracker.by_phase()["backward"]["peak"]
            True
        """
        self._sample_if_active()
        return self._peak

    @property
    def steps(self) -> int:
        """Optimizer steps completed inside the context so far.

        Example:
            >>> tracker.steps
            1
        """
        return self._step

    def by_category(self, kind: str = "current", device: str | None = None) -> dict[str, int]:
        """Bytes per category (every name of ``CATEGORIES``): ``kind="current"``, or
        ``"peak"`` for the composition at the peak; ``device`` (e.g. ``"cpu"``,
        ``"cuda:0"``) keeps only that device's bytes.

        Example:
            >>> tracker.by_category("peak")["activations"] > 0
            True
        """
        if kind not in ("current", "peak"):
            raise ValueError(
                f"MemoryTracker.by_category: kind is 'current' or 'peak', not {kind!r}."
            )
        if kind == "current":
            self._sample_if_active()
            source = dict(self._totals)
            for k, v in self._volatile.items():
                source[k] = source.get(k, 0) + v
        else:
            self._sample_if_active()
            source = self._peak_by
        out = dict.fromkeys(CATEGORIES, 0)
        for (dev, cat), n in source.items():
            if device is None or dev == str(torch.device(device)):
                out[cat] += n
        return out

    def by_phase(self) -> dict[str, dict]:
        """Per phase (``PHASES``) that ran: ``{"peak": bytes, "by_category": {...}}``, the
        highest sample in that phase and its composition.

        Example:
            >>> tracker.by_phase()["forward"]["by_category"]["activations"] > 0
            True
        """
        return {
            phase: {"peak": peak, "by_category": dict(cats)}
            for phase in PHASES
            if phase in self._phase_peaks
            for peak, cats in [self._phase_peaks[phase]]
        }

    def by_module(self) -> dict[str, ModuleStats]:
        """``ModuleStats`` per module of the tracked modules that ran, by qualified name
        (the root module under its class name), in the order they first ran.

        Example:
            >>> tracker.by_module()["0"].after_forward > tracker.by_module()["0"].before_forward
            True
        """
        return dict(self._module_stats)

    def reset_peak(self) -> None:
        """Start the peaks (total, per phase, per module) again from the current bytes.

        Example:
            >>> tracker.reset_peak(); tracker.peak == tracker.current
            True
        """
        self._peak = 0
        self._peak_by = {}
        self._phase_peaks = {}
        self._module_stats = {}
        self._walk()
        self._sample()

    def summary(self) -> dict:
        """Everything as plain data (bytes): ``current``, ``peak``, ``by_category``
        (``{"current": {...}, "peak": {...}}``), ``by_phase`` and ``by_module`` (dicts of
        the ``ModuleStats`` fields), ``steps`` (optimizer steps seen).

        Example:
            >>> s = tracker.summary()
            >>> s["peak"] == sum(s["by_category"]["peak"].values())
            True
        """
        return {
            "current": self.current,
            "peak": self.peak,
            "by_category": {
                "current": self.by_category("current"),
                "peak": self.by_category("peak"),
            },
            "by_phase": self.by_phase(),
            "by_module": {k: vars(v).copy() for k, v in self._module_stats.items()},
            "steps": self._step,
        }

    def log_summary(self, log: logging.Logger | None = None, level: int = logging.INFO) -> None:
        """Log the summary (MiB), one line per category, phase and module.

        Example:
            >>> logging.basicConfig(level=logging.INFO)
            >>> tracker.log_summary()
        """
        log = log or logger
        mib = 1 << 20
        s = self.summary()
        log.log(
            level, "memory: current %.2f MiB, peak %.2f MiB", s["current"] / mib, s["peak"] / mib
        )
        for cat in CATEGORIES:
            cur, pk = s["by_category"]["current"][cat], s["by_category"]["peak"][cat]
            log.log(
                level, "  %-17s current %10.2f MiB  at peak %10.2f MiB", cat, cur / mib, pk / mib
            )
        for phase, p in s["by_phase"].items():
            log.log(level, "  phase %-10s peak %10.2f MiB", phase, p["peak"] / mib)
        for name, m in s["by_module"].items():
            log.log(
                level,
                "  module %-24s forward peak %10.2f MiB  left alive %10.2f MiB  "
                "backward peak %10.2f MiB",
                name,
                m["forward_peak"] / mib,
                (m["after_forward"] - m["before_forward"]) / mib,
                m["backward_peak"] / mib,
            )

    # ------------------------------------------------------------------------- phases
    @property
    def phase(self) -> str:
        """The phase now: ``"forward"``, ``"backward"`` or ``"optimizer"``, the one begun last
        (see [Note: memory tracker]).

        Example:
            >>> tracker.phase
            'forward'
        """
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            self._last_phase = "backward"
        return self._last_phase

    def _pre_step(self, opt, args, kwargs) -> None:
        if self._mode is None:
            return
        self._end_backward_windows()
        if not any(o is opt for o in self._optimizers):
            self._optimizers.append(opt)
        self._stepping.append(opt)
        self._state_count = -1
        self._in_optimizer += 1
        self._walk()
        self._sample()

    def _post_step(self, opt, args, kwargs) -> None:
        if self._mode is None:
            return
        self._walk()
        self._sample()
        self._stepping.pop()
        self._in_optimizer -= 1
        self._last_phase = "optimizer"
        self._step += 1
        keep = self._keep_timeline
        if keep is not True and keep:
            first = self._step - keep
            self.timeline = [s for s in self.timeline if s.step >= first]

    def _name(self, module) -> str:
        return self._names.get(id(module), type(module).__name__)

    def _pre_forward(self, module, args) -> None:
        if self._mode is None:
            return
        if id(module) in self._walked:
            self._walk()
        if not self._in_optimizer and torch._C._current_graph_task_id() == -1:
            if self._last_phase == "optimizer":  # the next step's forward
                self._sample_step = self._step
            self._last_phase = "forward"
        phase = self.phase
        for t in tree_leaves(args):
            self._register(_storage_of(t), phase, inputs=True)
        self._sample()
        if phase == "forward" and self._in_backward:
            self._end_backward_windows()  # a new forward after a backward (accumulation)
        name = self._name(module)
        stats = self._module_stats.setdefault(name, ModuleStats())
        now = self._current()
        if phase == "forward":
            stats.calls += 1
            stats.before_forward = now
        self._in_forward.append((name, now))
        if phase == "forward":
            # the module's backward ends when its inputs' gradients exist
            self._on_first_grad(args, self._backward_end(name, id(module) in self._walked))

    def _post_forward(self, module, args, output) -> None:
        if self._mode is None or not self._in_forward:
            return
        if id(module) in self._walked:
            self._walk()
        self._sample()
        name, peak = self._in_forward.pop()
        stats = self._module_stats[name]
        stats.forward_peak = max(stats.forward_peak, peak, self._current())
        if self.phase != "forward":
            return  # a recomputation (activation checkpointing) inside backward
        stats.after_forward = self._current()
        # the module's backward starts when its outputs' gradients exist
        self._on_first_grad(output, self._backward_start(name, id(module) in self._walked))

    def _on_first_grad(self, tree, callback) -> None:
        """Call ``callback`` once the first gradient of ``tree``'s tensors that require one
        exists (nothing when none does)."""
        tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self._grad_handles.append(register_multi_grad_hook(tensors, callback, mode="any"))

    def _backward_start(self, name: str, walk: bool):
        def hook(grads) -> None:
            if self._mode is not None:
                if walk:
                    self._walk()
                self._sample()
                self._in_backward.setdefault(name, self._current())

        return hook

    def _backward_end(self, name: str, walk: bool):
        def hook(grads) -> None:
            if self._mode is not None and name in self._in_backward:
                if walk:
                    self._walk()
                self._sample()
                peak = max(self._in_backward.pop(name), self._current())
                stats = self._module_stats[name]
                stats.backward_peak = max(stats.backward_peak, peak)

        return hook

    def _end_backward_windows(self) -> None:
        for name, peak in self._in_backward.items():
            stats = self._module_stats[name]
            stats.backward_peak = max(stats.backward_peak, peak)
        self._in_backward = {}
        for h in self._grad_handles:
            h.remove()
        self._grad_handles = []

    # ------------------------------------------------------------------------- storages
    def _register(self, storage, phase: str, *, inputs: bool = False) -> None:
        if storage is None:
            return
        key = id(storage)
        self._drain()  # a storage freed just now may have had this id
        if key in self._records or key in self._volatile_ids:
            return
        if phase == "forward" or inputs:
            birth = "activations"
        elif phase == "other":
            birth = "other"
        else:
            birth = "temporaries"
        category = birth  # a walk or a refresh assigns roles
        if birth == "other" and region_at(storage.data_ptr()) is not None:
            category = "comm_buffers"  # fsdp2's own host mapping, not a parameter's: a buffer
        elif birth == "other":  # maybe a collective buffer being made: look again next sample
            self._pending_other.append(key)
        device = str(storage.device)
        ref = weakref.ref(storage, self._freed_callback(key))
        nbytes = storage.nbytes()
        self._records[key] = _Record(nbytes, category, birth, device, ref)
        self._totals[(device, category)] += nbytes

    def _comm_now(self):
        """The storages of the buffer pools and workspaces now (a few each)."""
        for pool in self._pools:
            yield from pool.storages()
        for ws in live_workspaces():
            yield from ws.storages

    def _freed_callback(self, key: int):
        dead = self._dead

        def freed(ref) -> None:  # any thread may free a storage: only queue it here
            dead.append((key, ref))

        return freed

    def _drain(self) -> None:
        """Forget the storages freed since the last call."""
        while self._dead:
            key, ref = self._dead.popleft()
            rec = self._records.get(key)
            if rec is not None and rec.ref is ref:
                del self._records[key]
                self._roles.pop(key, None)
                self._totals[(rec.device, rec.category)] -= rec.nbytes

    def _set_category(self, key: int, category: str) -> None:
        rec = self._records.get(key)
        if rec is not None and rec.category != category:
            self._totals[(rec.device, rec.category)] -= rec.nbytes
            rec.category = category
            self._totals[(rec.device, category)] += rec.nbytes

    def _after_op(self, out, is_view: bool = False) -> None:
        self._ops += 1
        # a view of a storage not seen yet: memory made before the context (a data set)
        phase = "other" if is_view else self.phase
        for t in _tensors_in(out):
            self._register(_storage_of(t), phase)
        if self._stepping:  # state the step creates is state from the start
            opt = self._stepping[-1]
            count = sum(len(st) for st in opt.state.values())
            if count != self._state_count:  # new state entries: find their storages
                self._state_count = count
                for t in _state_tensors(opt):
                    s = _storage_of(t)
                    if s is not None and id(s) in self._records:
                        self._roles[id(s)] = "optimizer_state"
                        self._set_category(id(s), "optimizer_state")
        self._sample()

    # ------------------------------------------------------------------------- walks
    def _fsdp_params(self) -> tuple[list, list, list]:
        """The ``FSDPParam``s, page banks and buffer pools of the tracked modules."""
        params, banks, pools = [], [], []
        for state in self._states:
            if state.group is not None:
                params += state.group.params
            ctx = state.ctx
            if ctx is not None and not any(b is ctx.comm.pages for b in banks):
                banks.append(ctx.comm.pages)
                pools += [ctx.comm.pool, ctx.comm.no_pool]
        return params, banks, pools

    def _walk(self) -> None:
        """Assign roles to the storages of everything walkable, and refresh every record's
        size (a storage resized since counts at its new size)."""
        self._drain()
        self._fsdp, self._banks, self._pools = self._fsdp_params()
        roles = _Roles()
        for s in self._comm_now():
            roles.assign_comm_buffer(s)
        for opt in self._optimizers:
            for t in _state_tensors(opt):
                roles.assign(t, "optimizer_state")
        volatile = self._walk_unsharded(roles)
        for root in self._modules:
            for t in root.buffers():
                roles.assign(t, "other")
        for t in self._tensors:
            roles.assign(t, "other")
        for p in self._fsdp:
            roles.assign(p.local, "sharded_params")
            if p.sharded_param.grad is not None:
                roles.assign(p.sharded_param.grad, "sharded_grads")
        self._plain = self._walk_plain_params(roles)
        self._roles = roles.of
        self._pending_other = []
        self._forget_volatile(volatile)
        self._register_walked(roles)
        self._refresh_records(roles.of)
        self._drain()

    def _walk_unsharded(self, roles: _Roles) -> set[int]:
        """The ids of the ``fully_shard`` parameters' unsharded storages (volatile: counted by
        ``_refresh_fsdp`` at every sample, kept in ``roles.live`` but given no role); the
        rows kept after forward (``reshard_after_forward=k``) are unsharded parameters."""
        volatile = set()
        for p in self._fsdp:
            if p.storage is not None:
                s = p.storage.tensor.untyped_storage()
                volatile.add(id(s))
                roles.live.append(s)
            kept = getattr(p.group, "_kept_rows", None) if p.group is not None else None
            if kept is not None:
                roles.assign(kept, "unsharded_params")
        return volatile

    def _walk_plain_params(self, roles: _Roles) -> list:
        """The tracked modules' parameters that ``fully_shard`` does not manage, each given
        the role of a sharded parameter and its gradient that of a sharded gradient."""
        plain = []
        for root in self._modules:
            for param in root.parameters():
                if unsharded_of(param) is not None or is_managed(param):
                    continue  # fully_shard's: walked above, refreshed at every sample
                plain.append(param)
                if param.grad is not None:
                    roles.assign(param.grad, "sharded_grads")
                roles.assign(param, "sharded_params")
        return plain

    def _forget_volatile(self, volatile: set[int]) -> None:
        """Drop the records of storages that just became volatile, and remember the set."""
        for key in volatile - self._volatile_ids:
            rec = self._records.pop(key, None)
            if rec is not None:
                self._totals[(rec.device, rec.category)] -= rec.nbytes
        self._volatile_ids = volatile

    def _register_walked(self, roles: _Roles) -> None:
        """Register every storage the walk reached (but the volatile ones) under its role."""
        for storage in roles.live:
            key = id(storage)
            if key in self._volatile_ids:
                continue
            if key not in self._records:
                self._register(storage, "forward", inputs=True)
            self._set_category(key, roles.of[key])

    def _refresh_records(self, roles: dict[int, str]) -> None:
        """Return the records no walk reached to their birth category, queue the freed ones,
        and count a resized storage at its new size."""
        for key, rec in list(self._records.items()):
            if key not in roles and rec.category != rec.birth:
                self._set_category(key, rec.birth)  # no longer what it was (a grad set to None)
            storage = rec.ref()
            if storage is None:  # freed, its callback not run yet
                self._dead.append((key, rec.ref))
                continue
            nbytes = storage.nbytes()
            if nbytes != rec.nbytes:
                self._totals[(rec.device, rec.category)] += nbytes - rec.nbytes
                rec.nbytes = nbytes

    def _refresh_fsdp(self) -> None:
        """The parts that change between walks: unsharded parameters (their memory comes and
        goes), the page bank, and the gradients ``fully_shard`` creates and takes."""
        vol: dict[tuple[str, str], int] = defaultdict(int)
        for p in self._fsdp:
            st = p.storage
            if st is None:
                continue
            dev = str(st.tensor.device)
            if isinstance(st, MappedStorage):
                n = st.region.nbytes if st.region.resident else 0
            else:
                n = st.tensor.untyped_storage().nbytes()
            vol[(dev, "unsharded_params")] += n
            up = p.unsharded_param
            grad = up.grad if up is not None and up is not p.sharded_param else None
            for g in (grad, p.accumulated_grad):
                s = _storage_of(g)
                if s is not None:
                    key = id(s)
                    if key not in self._records:
                        self._register(s, self.phase)
                    self._set_category(key, "unsharded_grads")
            sg = p.sharded_param.grad
            s = _storage_of(sg)
            if s is not None:
                if id(s) not in self._records:
                    self._register(s, self.phase)
                self._set_category(id(s), "sharded_grads")
        for param in self._plain:  # plain parameters' gradients, as autograd makes them
            s = _storage_of(param.grad)
            if s is not None:
                if id(s) not in self._records:
                    self._register(s, self.phase)
                self._set_category(id(s), "sharded_grads")
        for bank in self._banks:
            vol[("cpu", "comm_buffers")] += bank.held_bytes
        self._volatile = dict(vol)

    # ------------------------------------------------------------------------- samples
    def _by_category_now(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for source in (self._totals, self._volatile):
            for (_, cat), n in source.items():
                out[cat] += n
        return out

    def _sample(self) -> None:
        self._drain()
        if self._pending_other:  # a pool's new buffer is a view of a fresh host mapping
            comm = {id(c) for c in self._comm_now()}
            for key in [k for k in self._pending_other if k in comm]:
                self._set_category(key, "comm_buffers")
                self._pending_other.remove(key)
        self._refresh_fsdp()
        now = self._current()
        phase = self.phase
        if now > self._peak or not self._peak_by:
            self._peak = now
            self._peak_by = dict(self._totals)
            for k, v in self._volatile.items():
                self._peak_by[k] = self._peak_by.get(k, 0) + v
        best = self._phase_peaks.get(phase)
        if best is None or now > best[0]:
            self._phase_peaks[phase] = (now, self._by_category_now())
        if self._in_forward:
            self._in_forward = [(n, max(p, now)) for n, p in self._in_forward]
        for name in self._in_backward:
            self._in_backward[name] = max(self._in_backward[name], now)
        if self._keep_timeline:
            cats = self._by_category_now()
            self.timeline.append(
                Sample(self._ops, self._sample_step, phase, tuple(cats[c] for c in CATEGORIES))
            )
