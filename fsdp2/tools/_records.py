"""The records of the analytic expectation: one expected collective, a step's worth of
them, and their summary per ``(kind, mesh_dim)`` (``dtensor.debug``'s conventions).

Example:
    >>> from fsdp2.tools.comm_model import CommExpectation, ExpectedCollective
    >>> CommExpectation([ExpectedCollective("all_gather", "dp", 2, 64)]).by_mesh_dim()
    {('all_gather', 'dp'): (1, 64)}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b) if a else 0


@dataclass(frozen=True)
class ExpectedCollective:
    """One collective the model expects: as ``dtensor.debug.CollectiveRecord``, plus the
    ``phase`` (``"forward"`` / ``"backward"``) and ``where`` (the group or module) it
    belongs to.

    Example:
        >>> ExpectedCollective("all_gather", "dp", 2, 64, "forward", "blocks.0")
    """

    kind: str
    mesh_dim: str | int | None
    group_size: int
    bytes: int
    phase: str = ""
    where: str = ""


@dataclass
class CommExpectation:
    """The collectives of one step, with the views ``CommDebugMode`` offers.

    Example:
        >>> exp = expected_step_comms(model)    # the GPT of docs/tools.md over 2 ranks
        >>> exp.get_comm_counts()
        {'all_gather': 5, 'reduce_scatter': 3}
        >>> exp.by_mesh_dim()[("reduce_scatter", "dp")]   # (count, bytes per rank)
        (3, 439528)
    """

    records: list[ExpectedCollective] = field(default_factory=list)

    def get_total_counts(self) -> int:
        """Number of collectives."""
        return len(self.records)

    def get_comm_counts(self) -> dict[str, int]:
        """Number of collectives by kind."""
        return dict(Counter(r.kind for r in self.records))

    def get_total_bytes(self, kind: str | None = None) -> int:
        """Bytes contributed per rank, over all collectives or those of ``kind``."""
        return sum(r.bytes for r in self.records if kind is None or r.kind == kind)

    def by_mesh_dim(self) -> dict[tuple[str, str | int | None], tuple[int, int]]:
        """``{(kind, mesh_dim): (count, bytes)}``."""
        return summarize(self.records)

    def __add__(self, other: CommExpectation) -> CommExpectation:
        return CommExpectation([*self.records, *other.records])

    def __repr__(self) -> str:
        return f"CommExpectation({self.get_comm_counts()}, bytes={self.get_total_bytes()})"


def summarize(records: Iterable) -> dict[tuple[str, str | int | None], tuple[int, int]]:
    """``{(kind, mesh_dim): (count, bytes)}`` of records with ``kind``, ``mesh_dim`` and
    ``bytes`` (ours or ``dtensor.debug``'s), in first-seen order.

    Example:
        >>> with CommDebugMode() as mode:
        ...     gpt_loss(model, x, y).backward()
        >>> summarize(mode.records)[("all_gather", "dp")]
        (5, 419584)
    """
    out: dict[tuple[str, str | int | None], list[int]] = {}
    for r in records:
        entry = out.setdefault((r.kind, r.mesh_dim), [0, 0])
        entry[0] += 1
        entry[1] += r.bytes
    return {k: (c, b) for k, (c, b) in out.items()}
