"""Dry run at scale: the real library over a simulated world of many ranks, in one process.

``dry_run`` initializes PyTorch's fake process group (``dist.init_process_group("fake")``:
every collective returns at once, no data moves), builds the mesh with
``init_device_mesh``, builds the model on the meta device (no memory), lays it out with
``parallelize_transformer`` (tensor parallelism, activation checkpointing, ``fully_shard``
per block and on the root) and runs one forward and backward on meta inputs under
``CommDebugMode``. What it returns is what the library *built and issued* as seen by one
rank: each ``fully_shard`` group's shard sizes and the collectives of the step, by kind and
mesh dim. ``fsdp2.tools.planner`` predicts the same numbers analytically;
``tests/test_dry_run.py`` checks that they agree at 64 to 1024 ranks for 7B-70B models.

Two things make the library run there (both in the library, both tested): a mesh over the
fake group creates fake subgroups (``device_mesh.groups.simulated_world``), and a group
whose parameters are still on meta at the first forward gathers and computes on meta
([Note: dry run on meta] in ``fsdp2/_param_group.py``).

Example:
    >>> from examples.gpt import GPT, GPTConfig
    >>> report = dry_run(lambda: GPT(GPTConfig(dim=4096, n_layers=32, n_heads=32,
    ...                                       vocab_size=32000, max_seq_len=2048)),
    ...                  world_size=1024)
    >>> report.shard_numel["blocks[0]"], report.counts[("all_gather", "dp_shard")]
    (196660, 65)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["DryRunReport", "dry_run", "mesh_for"]


@dataclass
class DryRunReport:
    """What one rank of a simulated world saw.

    Attributes:
        world_size / rank: the simulated world and the rank this process played.
        mesh_shape: ``{dim name: size}``.
        shard_numel: ``{group: elements of this rank's shards}``, groups named ``"root"``
            and ``"blocks[i]"`` as ``planner.group_layouts`` names them.
        counts: ``{(kind, mesh dim): count}`` of one forward and backward.
        bytes: ``{(kind, mesh dim): bytes this rank contributed}``.
        seconds: wall time of the whole dry run (process groups, model, step).

    Example:
        >>> report.counts[("reduce_scatter", "dp_shard")]
        33
    """

    world_size: int
    rank: int
    mesh_shape: dict
    shard_numel: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    seconds: float = 0.0


def mesh_for(world_size: int, *, tp: int = 1, dp_replicate: int = 1):
    """``(shape, dim names)`` of the mesh ``parallelize_transformer`` takes for a layout:
    ``("dp_replicate", "dp_shard", "tp")``, the dims of size one left out (``dp_shard``
    always kept).

    Raises:
        ValueError: ``world_size`` not divisible by ``tp * dp_replicate``.

    Example:
        >>> mesh_for(1024, tp=8, dp_replicate=4)
        ((4, 32, 8), ('dp_replicate', 'dp_shard', 'tp'))
    """
    if world_size % (tp * dp_replicate):
        raise ValueError(
            f"mesh_for: world_size={world_size} is not divisible by tp * dp_replicate = "
            f"{tp} * {dp_replicate}."
        )
    shard = world_size // (tp * dp_replicate)
    dims = [("dp_replicate", dp_replicate), ("dp_shard", shard), ("tp", tp)]
    kept = [(n, s) for n, s in dims if s > 1 or n == "dp_shard"]
    return tuple(s for _, s in kept), tuple(n for n, _ in kept)


def dry_run(
    build_model,
    *,
    world_size: int,
    rank: int = 0,
    tp: int = 1,
    dp_replicate: int = 1,
    tp_plan: dict | None = None,
    activation_checkpointing: bool = False,
    mp_policy=None,
    reshard_after_forward: bool | None = None,
    batch_size: int = 1,
    seq_len: int = 16,
    loss_fn=None,
) -> DryRunReport:
    """Run the library for rank ``rank`` of a simulated world of ``world_size`` ranks.

    Args:
        build_model: a callable returning the model; called under
            ``torch.device("meta")``. The model needs ``blocks`` or ``layers``.
        world_size / rank: the simulated world and the rank this process plays.
        tp / dp_replicate: the mesh (``mesh_for``); ``tp > 1`` needs ``tp_plan``.
        activation_checkpointing / mp_policy / reshard_after_forward: passed to
            ``parallelize_transformer``.
        batch_size / seq_len: the meta input's shape (the collectives do not depend on it;
            with ``tp > 1`` the sequence must divide by ``tp``).
        loss_fn: ``loss_fn(model, idx) -> loss`` (default: the sum of the logits).

    Raises:
        RuntimeError: a default process group already exists (the dry run needs a fake one
            of its own; call it in a process that has not initialized torch.distributed).

    Example:
        >>> report = dry_run(build, world_size=256, tp=8, tp_plan=tp_plan())
        >>> report.counts
    """
    _require_no_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t0 = time.perf_counter()
    shape, names = mesh_for(world_size, tp=tp, dp_replicate=dp_replicate)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        model = _laid_out_meta_model(
            build_model,
            shape,
            names,
            tp_plan=tp_plan if tp > 1 else None,
            activation_checkpointing=activation_checkpointing,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
        )
        report = DryRunReport(world_size, rank, dict(zip(names, shape, strict=True)))
        report.shard_numel = _shard_numel(model)
        report.counts, report.bytes = _step_collectives(model, loss_fn, batch_size, seq_len)
    finally:
        dist.destroy_process_group()
    report.seconds = time.perf_counter() - t0
    logger.info("dry run of %d ranks took %.1f s", world_size, report.seconds)
    return report


def _require_no_process_group() -> None:
    """Raise unless this process can still create the dry run's fake default group."""
    if dist.is_initialized():
        raise RuntimeError(
            "dry_run: torch.distributed is already initialized in this process; the dry run "
            "needs a fake process group of its own. Run it in a fresh process."
        )


def _laid_out_meta_model(build_model, shape, names, **layout):
    """The model built on meta and laid out by ``parallelize_transformer`` (its keyword
    arguments ``layout``) over a CPU mesh of ``shape`` with dims ``names``."""
    from device_mesh import init_device_mesh
    from fsdp2.recipe import parallelize_transformer

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = build_model()
    parallelize_transformer(model, mesh, **layout)
    return model


def _step_collectives(model, loss_fn, batch_size: int, seq_len: int) -> tuple[dict, dict]:
    """``({(kind, mesh dim): count}, {(kind, mesh dim): bytes})`` of one forward and
    backward on a meta input of ``(batch_size, seq_len)`` token ids."""
    from dtensor.debug import CommDebugMode

    counts: dict = {}
    nbytes: dict = {}
    idx = torch.zeros((batch_size, seq_len), dtype=torch.long, device="meta")
    with CommDebugMode() as comm:
        out = (loss_fn or _sum_of_logits)(model, idx)
        out.backward()
    for r in comm.records:
        key = (r.kind, r.mesh_dim)
        counts[key] = counts.get(key, 0) + 1
        nbytes[key] = nbytes.get(key, 0) + r.bytes
    return counts, nbytes


def _sum_of_logits(model, idx):
    out = model(idx)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits.float().sum()


def _shard_numel(model) -> dict:
    """``{group name: elements of this rank's shards}`` of every ``fully_shard`` group."""
    from fsdp2._state import states_below

    blocks = getattr(model, "blocks", None) or getattr(model, "layers", None)
    index = {id(b): i for i, b in enumerate(blocks or [])}
    out = {}
    for state in states_below([model]):
        if state.group is None:
            continue
        m = state.modules[0]
        name = "root" if m is model else f"blocks[{index[id(m)]}]"
        out[name] = sum(p.local.numel() for p in state.group.params)
    return out
