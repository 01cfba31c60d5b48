"""CommDebugMode: count the collectives this library issues inside a ``with`` block; the
flight recorder: name the rank that fell out of step.

Every collective in ``dtensor`` (and in ``fsdp2``, which calls the same helpers) reports to
the active modes: its kind, the mesh dim it ran over, the group size, and ``bytes`` - the
size of the buffer each rank contributes (the all-gather input, the all-reduce or
reduce-scatter input, the all-to-all input, the broadcast/scatter source). Collectives that
``torch.compile`` put inside a compiled graph run there, outside Python, and are not counted.

The same calls feed the flight recorder (``dtensor/_flight.py``; docs/debugging.md): a
per-group sequence number and description of every collective, compared between ranks by a
watchdog thread over the c10d store. Configure it with ``set_collective_timeout``,
``set_flight_recorder`` or the environment variables ``DTENSOR_COLLECTIVE_TIMEOUT`` and
``DTENSOR_FLIGHT_RECORDER``.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

from dtensor import _flight

FLIGHT_EXIT_CODE = _flight.EXIT_CODE
OutOfStepError = _flight.OutOfStepError

_ACTIVE: list[CommDebugMode] = []
_LOCK = threading.Lock()


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: ``kind`` is e.g. ``"all_gather"``; ``mesh_dim`` may be None."""

    kind: str
    mesh_dim: int | str | None
    group_size: int
    bytes: int


class CommDebugMode:
    """Context manager that records every collective issued by this library.

    Example:
        >>> with CommDebugMode() as comm:
        ...     dt.full_tensor()
        >>> comm.get_comm_counts()
        {'all_gather': 1}
        >>> comm.get_total_counts(), comm.get_total_bytes()
    """

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def __enter__(self) -> CommDebugMode:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _ACTIVE.remove(self)

    def get_total_counts(self) -> int:
        """Number of collectives recorded."""
        return len(self.records)

    def get_comm_counts(self) -> dict[str, int]:
        """Number of collectives by kind."""
        return dict(Counter(r.kind for r in self.records))

    def get_counts_by_mesh_dim(self) -> dict[tuple[str, int | str | None], int]:
        """Number of collectives by ``(kind, mesh_dim)``."""
        return dict(Counter((r.kind, r.mesh_dim) for r in self.records))

    def get_total_bytes(self, kind: str | None = None) -> int:
        """Bytes contributed per rank, over all collectives or those of ``kind``."""
        return sum(r.bytes for r in self.records if kind is None or r.kind == kind)

    def __repr__(self) -> str:
        return f"CommDebugMode({self.get_comm_counts()}, bytes={self.get_total_bytes()})"


def record(kind: str, mesh_dim, group_size: int, nbytes: int, *, group=None) -> None:
    """Report one collective to every active mode and, with its ``group``, to the flight
    recorder (library-internal).

    Example::

        >>> record("all_reduce", "dp", 2, 4096, group=mesh.get_group("dp"))
    """
    if group is not None:
        _flight.note(kind, mesh_dim, group_size, nbytes, group)
    if not _ACTIVE:
        return
    rec = CollectiveRecord(kind, mesh_dim, group_size, int(nbytes))
    with _LOCK:
        for mode in _ACTIVE:
            mode.records.append(rec)


def note_collective(kind: str, group, nbytes: int, *, mesh_dim=None) -> None:
    """Report a collective to the flight recorder only (``CommDebugMode`` does not count
    it): the metadata exchanges of checkpoints and checks. ``group`` None: the default group.

    Example::

        >>> note_collective("all_gather_object", None, 0)
    """
    size = group.size() if group is not None else _world_size()
    _flight.note(kind, mesh_dim, size, nbytes, group)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


@contextmanager
def collective_scope(name: str):
    """Collectives issued inside carry ``name`` in the flight recorder (fsdp2 names the
    module whose parameters move, e.g. ``"fsdp layers.3"``); ranks whose collectives carry
    different scopes at the same sequence number are reported as out of step.

    Example::

        >>> with collective_scope("eval"):
        ...     dt.full_tensor()
    """
    prev = _flight.set_scope(name)
    try:
        yield
    finally:
        _flight.set_scope(prev)


def wait_collective(work, *, point_to_point: bool = False) -> None:
    """Wait for a collective's ``work`` (from ``async_op=True``) so that the flight
    recorder's verdict can interrupt the wait: when the ranks fall out of step, this raises
    ``OutOfStepError`` naming the rank, the collective and the module, instead of waiting
    for ever (gloo's collective work is waited on in slices of one watchdog poll;
    ``point_to_point=True`` for a send's or receive's work, which waits whole, as a timed
    wait cancels a gloo receive; docs/debugging.md).

    Example::

        >>> with annotate_failures():
        ...     wait_collective(dist.all_reduce(t, group=group, async_op=True))
    """
    _flight.wait(work, point_to_point=point_to_point)


def new_step(step: int | None = None) -> None:
    """Mark the start of a training step for the flight recorder: this thread's next
    collectives carry the step number, so a rank that runs an extra forward or skips a step
    is named when the next step begins, not when the job hangs at its end. ``fully_shard``'s
    root forward calls it with no number (it counts its forwards); a training loop that
    passes its own step number (``new_step(step)``) also catches a step skipped whole, and
    from then on its numbers are the ones recorded.

    Example::

        >>> for step in range(start, steps):
        ...     new_step(step)
        ...     loss = model(x).sum()
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"new_step: step must be an int or None, got {step!r}.")
    _flight.new_step(step)


def annotate_failures():
    """A context manager around a wait on a collective: a ``RuntimeError`` raised inside
    (a peer died, the backend timed out) keeps its type and gains a note with the flight
    recorder's analysis - which rank is behind or ahead, where the ranks' collectives
    differ, which peers on this host are no longer running - which is also logged.

    Example::

        >>> with annotate_failures():
        ...     dist.all_reduce(t, group=group)
    """
    return _flight.FAILING


def set_collective_timeout(seconds: float | None, *, grace=...) -> None:
    """How long the ranks of a group may disagree on their last collective, with none of
    them progressing, before the flight recorder's watchdog names the rank that is out of
    step. The verdict is logged on every rank and raised as ``OutOfStepError`` in the
    threads waiting on a collective (two ranks that issued different collectives are named
    at once, without waiting for the timeout). ``None``: the default process group's
    timeout (the default); ``0``: no watchdog (collectives are still recorded, and a failing
    collective's error still carries the record). The environment variable
    ``DTENSOR_COLLECTIVE_TIMEOUT`` sets the same (seconds, or ``off``).

    ``grace`` (opt-in; default None: nothing ends the process): for jobs under an elastic
    launcher, how long a verdict may go unreceived - the program is blocked where Python
    cannot interrupt it (a collective issued outside this library, a CUDA synchronization) -
    before the watchdog ends the process with exit code ``FLIGHT_EXIT_CODE`` (75) so that
    the launcher restarts the job; with it, a process that received a verdict also ends at
    exit without waiting for the interrupted collective's timeout. Also
    ``DTENSOR_VERDICT_GRACE`` (seconds). Call it on every rank.

    Example::

        >>> set_collective_timeout(120.0)
        >>> set_collective_timeout(120.0, grace=60.0)   # opt in: end a blocked process
    """
    if seconds is not None and (not isinstance(seconds, (int, float)) or seconds < 0):
        raise ValueError(
            f"set_collective_timeout: expected a number of seconds >= 0 or None, got {seconds!r}."
        )
    if (
        grace is not ...
        and grace is not None
        and (isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace <= 0)
    ):
        raise ValueError(
            f"set_collective_timeout: grace must be a number of seconds > 0 or None (never "
            f"end the process), got {grace!r}."
        )
    _flight.configure(
        timeout=None if seconds is None else float(seconds),
        grace=grace if grace is ... or grace is None else float(grace),
    )


def set_flight_recorder(enabled: bool, *, entries: int | None = None) -> None:
    """Turn the flight recorder on or off (``DTENSOR_FLIGHT_RECORDER=0`` starts with it
    off) and set how many collectives it keeps per group (``entries``, default 64; also
    ``DTENSOR_FLIGHT_ENTRIES``). Off, collectives are not recorded and there is no
    watchdog. Call it on every rank, between steps.

    Example::

        >>> set_flight_recorder(True, entries=256)
    """
    if entries is not None and (not isinstance(entries, int) or entries < 1):
        raise ValueError(f"set_flight_recorder: entries must be an int >= 1, got {entries!r}.")
    _flight.configure(enabled=bool(enabled), entries=entries)


def flight_record(group=None) -> list[str]:
    """This rank's last recorded collectives on ``group`` (None: the default group),
    oldest first, as the watchdog reports them.

    Example::

        >>> flight_record(mesh.get_group("dp"))[-1]
        '#42 all_gather(dp, 2 ranks, 1.2 MB, fsdp layers.3)'
    """
    return [_flight.describe(e) for e in _flight.entries(group)]
