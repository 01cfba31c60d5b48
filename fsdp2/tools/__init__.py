"""fsdp2.tools: see inside a sharded run, and plan one.

* ``MemoryTracker`` - live tensor bytes by category (sharded and unsharded parameters and
  gradients, optimizer state, activations, communication buffers), per module and per phase,
  current and peak (``fsdp2/tools/memory.py``).
* ``CommLedger`` - each step's collectives (count and bytes per kind and mesh dim) beside the
  analytic expectation ``expected_step_comms`` computes from the model's structure
  (``fsdp2/tools/ledger.py``, ``fsdp2/tools/comm_model.py``).
* ``profile_model`` / ``estimate`` / ``rank_configs`` - the memory planner
  (``fsdp2/tools/planner.py``; ``python -m fsdp2.plan``), and ``dry_run``, the real library
  over a simulated world on PyTorch's fake process group (``fsdp2/tools/dry_run.py``).

Library code here logs and never prints; ``fsdp2.tools.tables`` renders summaries as rich
tables for command lines and examples, ``fsdp2.tools.chart`` writes memory over a step as a
self-contained SVG. See docs/tools.md.

Example:
    >>> from fsdp2.tools import CommLedger, MemoryTracker, expected_step_comms
    >>> ledger = CommLedger(expected_step_comms(model))
    >>> with MemoryTracker(model, opt) as tracker, ledger.step():
    ...     loss_fn(model(x), y).backward(); opt.step()
    >>> tracker.peak, tracker.by_category("peak")["activations"], ledger.mismatched_steps
"""

from fsdp2.tools.comm_model import (
    CommExpectation,
    GroupSpec,
    ParamSpec,
    TransformerTP,
    expected_step_comms,
    groups_of,
)
from fsdp2.tools.dry_run import DryRunReport, dry_run
from fsdp2.tools.ledger import CommLedger, LedgerRow, StepEntry, format_ledger
from fsdp2.tools.memory import CATEGORIES, PHASES, MemoryTracker, ModuleStats, Sample
from fsdp2.tools.planner import PlanConfig, estimate, profile_model, rank_configs

__all__ = [
    "CATEGORIES",
    "PHASES",
    "MemoryTracker",
    "ModuleStats",
    "Sample",
    "CommLedger",
    "LedgerRow",
    "StepEntry",
    "format_ledger",
    "CommExpectation",
    "GroupSpec",
    "ParamSpec",
    "TransformerTP",
    "expected_step_comms",
    "groups_of",
    "PlanConfig",
    "estimate",
    "profile_model",
    "rank_configs",
    "DryRunReport",
    "dry_run",
]
