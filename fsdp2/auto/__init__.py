"""Automatic layouts: ``auto_parallelize(model, world, memory_budget=..., batch=...,
seq_len=...)`` profiles the model on meta, searches the layouts of the world for the
fastest that fits the per-rank budget with a margin (``fsdp2.tools.search``), applies it
with the library's own calls, proves it, and returns the ``AutoPlan``.

The plan is plain data: ``print(plan)`` is a table; ``plan.to_json()`` /
``AutoPlan.from_json`` round trip; ``plan.calls()`` is the layout as Python source
(``fully_shard([model.blocks[0], model.blocks[1]], mesh=mesh["dp_shard"], ...)``);
``plan.apply(model, mesh)`` lays a fresh model out the same way. ``verify_plan(plan,
build_model)`` plays a plan on PyTorch's fake process group at its world size (64 or 1024
simulated ranks in one process) and compares what the library builds and issues with it.

Modules: ``_plan.py`` (the plan), ``_apply.py`` (the calls and the in-process proof),
``_proof.py`` (the dry-run proof), ``_first_step.py`` (the check after the first step),
``_entry.py`` (``auto_parallelize``).

Example:
    >>> from fsdp2.auto import auto_parallelize
    >>> with torch.device("meta"):
    ...     model = GPT(cfg)
    >>> plan = auto_parallelize(model, dist.get_world_size(), memory_budget="70GiB",
    ...                         batch=64, seq_len=2048)
    >>> print(plan)
    >>> model.to_empty(device="cuda"); model.reset_parameters()
    >>> dp_rank, dp_size = plan.data_parallel_rank()      # which rows of the batch to feed
"""

from fsdp2.auto._apply import PlanMismatchError, check_layout
from fsdp2.auto._entry import auto_parallelize
from fsdp2.auto._plan import Alternative, AutoPlan, PlannedGroup, PlannedParam
from fsdp2.auto._proof import PlanCheck, compare_report, verify_plan
from fsdp2.tools.search import NothingFitsError

__all__ = [
    "auto_parallelize",
    "AutoPlan",
    "PlannedGroup",
    "PlannedParam",
    "Alternative",
    "PlanMismatchError",
    "NothingFitsError",
    "PlanCheck",
    "verify_plan",
    "compare_report",
    "check_layout",
]
