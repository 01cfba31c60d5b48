"""CommDebugMode: count the collectives this library issues inside a ``with`` block.

Every collective in ``dtensor`` (and in ``fsdp2``, which calls the same helpers) reports to
the active modes: its kind, the mesh dim it ran over, the group size, and ``bytes`` - the
size of the buffer each rank contributes (the all-gather input, the all-reduce or
reduce-scatter input, the all-to-all input, the broadcast/scatter source). Collectives that
``torch.compile`` put inside a compiled graph run there, outside Python, and are not counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

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


def record(kind: str, mesh_dim, group_size: int, nbytes: int) -> None:
    """Report one collective to every active mode (library-internal)."""
    if not _ACTIVE:
        return
    rec = CollectiveRecord(kind, mesh_dim, group_size, int(nbytes))
    with _LOCK:
        for mode in _ACTIVE:
            mode.records.append(rec)
