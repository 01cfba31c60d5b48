"""CommLedger: per step, what was sent - count and bytes of each collective per mesh dim -
beside what the configuration should send (``fsdp2.tools.comm_model``), mismatches flagged.

It is built on ``dtensor.debug.CommDebugMode``: every collective of ``dtensor``,
``dtensor.parallel`` and ``fsdp2`` reports its kind, mesh dim, group size and the bytes each
rank contributes, so the ledger sees the library's own traffic, whatever route (collective,
all-to-all or point-to-point on gloo) carried it. Collectives issued straight through
``torch.distributed`` by user code, or inside a ``torch.compile``d graph, are not seen.

A mismatch is a field on the step's entry (``StepEntry.ok``, ``LedgerRow.matches``) and a
logged warning (logger ``fsdp2.tools.ledger``); nothing is printed. ``format_ledger``
renders a step as plain text; ``fsdp2.tools.tables`` (when present) or your own code can
render ``rows`` richer.

Example:
    >>> from fsdp2.tools import CommLedger, expected_step_comms
    >>> ledger = CommLedger(expected_step_comms(model))
    >>> for step in range(3):
    ...     with ledger.step():
    ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    >>> ledger.last.ok
    True
    >>> print(format_ledger(ledger.last))
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from dtensor.debug import CollectiveRecord, CommDebugMode
from fsdp2.tools.comm_model import CommExpectation, expected_step_comms, summarize

__all__ = ["CommLedger", "LedgerRow", "StepEntry", "format_ledger"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerRow:
    """One ``(kind, mesh_dim)`` line of a step: what ran, what was expected (None without an
    expectation), and whether both count and bytes agree.

    Example:
        >>> row = ledger.last.rows[0]
        >>> row.kind, row.mesh_dim, row.count, row.bytes, row.matches
        ('all_gather', 'dp', 5, 60160, True)
    """

    kind: str
    mesh_dim: str | int | None
    count: int
    bytes: int
    expected_count: int | None = None
    expected_bytes: int | None = None

    @property
    def matches(self) -> bool | None:
        """True when count and bytes equal the expectation; None without one."""
        if self.expected_count is None:
            return None
        return self.count == self.expected_count and self.bytes == self.expected_bytes


@dataclass
class StepEntry:
    """The ledger's record of one step.

    ``rows`` has one ``LedgerRow`` per ``(kind, mesh_dim)`` seen or expected; ``records``
    are the raw ``CollectiveRecord``s in issue order; ``mismatches`` the rows that differ
    from the expectation.

    Example:
        >>> entry = ledger.last
        >>> entry.ok, [r.kind for r in entry.mismatches]
        (True, [])
    """

    index: int
    rows: list[LedgerRow]
    records: list[CollectiveRecord] = field(repr=False, default_factory=list)
    has_expectation: bool = False

    @property
    def mismatches(self) -> list[LedgerRow]:
        return [r for r in self.rows if r.matches is False]

    @property
    def ok(self) -> bool | None:
        """True when every row matches the expectation; None without an expectation."""
        if not self.has_expectation:
            return None
        return not self.mismatches

    def counts(self) -> dict[tuple[str, str | int | None], tuple[int, int]]:
        """``{(kind, mesh_dim): (count, bytes)}`` of what ran (rows that ran only)."""
        return {(r.kind, r.mesh_dim): (r.count, r.bytes) for r in self.rows if r.count}

    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)


Expected = CommExpectation | Callable[[], CommExpectation] | None


class CommLedger:
    """Record the collectives of each step beside the expected ones.

    Args:
        expected: a ``CommExpectation`` (``expected_step_comms(...)``), a callable
            returning one (evaluated at the end of each step, so settings changed between
            steps are followed), a module wrapped by ``fully_shard`` (shorthand for
            ``expected_step_comms(module)``, FSDP only), or None to record without
            comparing.
        name: what the log lines call a step.

    Use ``with ledger.step(): ...`` around each step (forward, backward, optimizer step), or
    the ledger itself as a context manager for a single step. Entries accumulate in
    ``steps``; ``last`` is the latest.

    Example:
        >>> ledger = CommLedger(expected_step_comms(model))
        >>> with ledger.step():
        ...     loss_fn(model(x), y).backward(); opt.step()
        >>> ledger.last.ok, ledger.last.counts()[("all_gather", "dp")]
        (True, (5, 60160))
    """

    def __init__(self, expected=None, *, name: str = "step") -> None:
        import torch

        if isinstance(expected, torch.nn.Module):
            module = expected
            expected = lambda: expected_step_comms(module)  # noqa: E731
        if expected is not None and not (
            isinstance(expected, CommExpectation) or callable(expected)
        ):
            raise TypeError(
                "CommLedger: expected must be a CommExpectation, a callable returning one, a "
                f"fully_shard module or None, got {type(expected).__name__}. Build one with "
                "fsdp2.tools.expected_step_comms(model)."
            )
        self.expected = expected
        self.name = name
        self.steps: list[StepEntry] = []
        self._open: contextlib.ExitStack | None = None

    @property
    def last(self) -> StepEntry | None:
        return self.steps[-1] if self.steps else None

    @contextlib.contextmanager
    def step(self):
        """Record one step; on exit its entry is compared, stored and (on mismatch) logged."""
        with CommDebugMode() as mode:
            yield self
        self._finish(mode.records)

    def __enter__(self) -> CommLedger:
        if self._open is not None:
            raise RuntimeError("CommLedger: a step is already open; close it first.")
        self._open = contextlib.ExitStack()
        self._open.enter_context(self.step())
        return self

    def __exit__(self, *exc) -> None:
        stack, self._open = self._open, None
        stack.__exit__(*exc)

    def _expectation(self) -> CommExpectation | None:
        if self.expected is None or isinstance(self.expected, CommExpectation):
            return self.expected
        return self.expected()

    def _finish(self, records: list[CollectiveRecord]) -> StepEntry:
        expected = self._expectation()
        entry = compare(records, expected, index=len(self.steps))
        self.steps.append(entry)
        if entry.ok is False:
            lines = "; ".join(
                f"{r.kind} over {r.mesh_dim!r}: {r.count} ({r.bytes} B) ran, "
                f"{r.expected_count} ({r.expected_bytes} B) expected"
                for r in entry.mismatches
            )
            logger.warning("%s %d: collectives differ from the expectation: %s",
                           self.name, entry.index, lines)  # fmt: skip
        else:
            logger.debug("%s %d: %d collectives, %d bytes per rank", self.name, entry.index,
                         len(records), entry.total_bytes())  # fmt: skip
        return entry


def compare(
    records: list[CollectiveRecord], expected: CommExpectation | None, *, index: int = 0
) -> StepEntry:
    """A ``StepEntry`` for ``records`` (what ran) against ``expected`` (or None).

    Example:
        >>> with CommDebugMode() as mode:
        ...     step()
        >>> compare(mode.records, expected_step_comms(model)).ok
        True
    """
    ran = summarize(records)
    want = expected.by_mesh_dim() if expected is not None else {}
    rows = []
    for key in [*ran, *(k for k in want if k not in ran)]:
        count, nbytes = ran.get(key, (0, 0))
        exp = want.get(key, (0, 0)) if expected is not None else (None, None)
        rows.append(LedgerRow(key[0], key[1], count, nbytes, *exp))
    return StepEntry(index, rows, list(records), has_expectation=expected is not None)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_ledger(entry: StepEntry) -> str:
    """``entry`` as a fixed-width plain-text table (for logs and examples).

    Example:
        >>> print(format_ledger(ledger.last))
        step 0            count  bytes/rank   expected          ok
        all_gather  dp        5    58.8 KiB   5   58.8 KiB      yes
    """
    head = f"{'step ' + str(entry.index):<28}{'count':>6} {'bytes/rank':>11}   {'expected':<20}ok"
    lines = [head]
    for r in entry.rows:
        exp = (
            "-"
            if r.expected_count is None
            else f"{r.expected_count:>3} {_human(r.expected_bytes):>10}"
        )
        ok = {True: "yes", False: "NO", None: "-"}[r.matches]
        lines.append(
            f"{r.kind:<16}{str(r.mesh_dim):<12}{r.count:>6} {_human(r.bytes):>11}   {exp:<20}{ok}"
        )
    return "\n".join(lines)
