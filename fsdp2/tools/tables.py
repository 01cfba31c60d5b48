"""Rich tables of the tools' summaries, for command lines and examples.

The only module of the library that imports rich (tests/test_layers.py exempts it by name):
the trackers themselves return plain data and log; this renders that data for a terminal.
Nothing in the library imports this module.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fsdp2.tools.memory import CATEGORIES, PHASES, MemoryTracker

__all__ = ["memory_tables", "print_memory_summary"]

_MIB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / _MIB:,.2f}"


def memory_tables(summary: dict, *, modules: int = 12, title: str = "memory") -> list[Table]:
    """Rich tables of a ``MemoryTracker.summary()``: by category (current, at the peak, and
    at each phase's peak), and the ``modules`` modules with the highest forward peak.

    Example:
        >>> for table in memory_tables(tracker.summary()):
        ...     Console().print(table)
    """
    phases = [p for p in PHASES if p in summary["by_phase"]]
    cats = Table(title=f"{title}: live tensor bytes by category (MiB)")
    cats.add_column("category", no_wrap=True)
    cats.add_column("current", justify="right")
    cats.add_column("at peak", justify="right")
    for phase in phases:
        cats.add_column(f"{phase} peak", justify="right")
    current, at_peak = summary["by_category"]["current"], summary["by_category"]["peak"]
    for cat in CATEGORIES:
        row = [current[cat], at_peak[cat]]
        row += [summary["by_phase"][p]["by_category"][cat] for p in phases]
        if any(row):
            cats.add_row(cat, *map(_mib, row))
    total = [summary["current"], summary["peak"]] + [summary["by_phase"][p]["peak"] for p in phases]
    cats.add_row("[bold]total[/bold]", *(f"[bold]{_mib(n)}[/bold]" for n in total))
    tables = [cats]
    stats = summary["by_module"]
    if stats and modules:
        ranked = sorted(stats.items(), key=lambda kv: -kv[1]["forward_peak"])[:modules]
        shown = {name for name, _ in ranked}
        mods = Table(title=f"{title}: per module (MiB, the highest over its calls)")
        for col in ("module", "calls", "forward peak", "left alive by forward", "backward peak"):
            mods.add_column(
                col, justify="left" if col == "module" else "right", no_wrap=col == "module"
            )
        for name, m in stats.items():  # in the order the modules first ran
            if name in shown:
                mods.add_row(
                    name,
                    str(m["calls"]),
                    _mib(m["forward_peak"]),
                    _mib(m["after_forward"] - m["before_forward"]),
                    _mib(m["backward_peak"]),
                )
        tables.append(mods)
    return tables


def print_memory_summary(
    tracker: MemoryTracker | dict, console: Console | None = None, *, modules: int = 12
) -> None:
    """Print a tracker's (or a summary's) tables on ``console`` (default: stdout).

    Example:
        >>> with MemoryTracker(model, opt) as tracker:
        ...     model(x).sum().backward(); opt.step()
        >>> print_memory_summary(tracker)
    """
    summary = tracker.summary() if isinstance(tracker, MemoryTracker) else tracker
    console = console or Console()
    for table in memory_tables(summary, modules=modules):
        console.print(table)
