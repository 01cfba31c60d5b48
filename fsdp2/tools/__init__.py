"""fsdp2.tools: see inside a sharded run.

* ``MemoryTracker`` - live tensor bytes by category (sharded and unsharded parameters and
  gradients, optimizer state, activations, communication buffers), per module and per phase,
  current and peak (``fsdp2/tools/memory.py``).

Library code here logs and never prints; ``fsdp2.tools.tables`` renders summaries as rich
tables for command lines and examples, ``fsdp2.tools.chart`` writes memory over a step as a
self-contained SVG. See docs/tools.md.

Example:
    >>> from fsdp2.tools import MemoryTracker
    >>> with MemoryTracker(model, opt) as tracker:
    ...     loss_fn(model(x), y).backward(); opt.step()
    >>> tracker.peak, tracker.by_category("peak")["activations"]
"""

from fsdp2.tools.memory import MemoryTracker, ModuleStats, Sample

# The category and phase names (plain tuples): ``fsdp2.tools.memory.CATEGORIES`` / ``PHASES``.
__all__ = ["MemoryTracker", "ModuleStats", "Sample"]
