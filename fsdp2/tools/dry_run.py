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

``dry_run_plan`` does the same for an ``fsdp2.auto.AutoPlan``: the layout is the plan's,
applied by the ``layout`` callable its caller passes (``fsdp2.auto.verify_plan`` passes
``plan.apply``, so groups of several blocks, per-group ``reshard_after_forward`` and
per-block checkpointing are the plan's; this module never imports ``fsdp2.auto``), and the
step runs at the plan's micro-batch and sequence length. ``fsdp2.auto.verify_plan``
compares the result with the plan (``python -m fsdp2.auto --plan plan.json --build-model
pkg.mod:fn`` for a plan file); ``auto_parallelize`` runs it in a fresh process, since the
fake group needs a process without a process group.

Each dry run restores ``sys.excepthook`` after it: ``init_process_group`` wraps it to prefix
tracebacks with ``[rank<r>]:``, and several dry runs in one process would stack the prefixes.

Example:
    >>> from examples.gpt import GPT, GPTConfig
    >>> report = dry_run(lambda: GPT(GPTConfig(dim=4096, n_layers=32, n_heads=32,
    ...                                       vocab_size=32000, max_seq_len=2048)),
    ...                  world_size=1024)
    >>> report.shard_numel["blocks[0]"], report.counts[("all_gather", "dp_shard")]
    (196660, 65)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "DryRunReport",
    "dry_run",
    "dry_run_plan",
    "mesh_for",
    "meta_copy",
    "built_groups",
    "is_checkpointed",
]


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
        layout: (``dry_run_plan``) ``{"reshard_after_forward": {group: value},
            "checkpointed": [block FQNs], "params": {group: [parameter FQNs]}}`` as built.

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
    layout: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """A JSON-ready ``dict`` (``from_dict`` reads it back).

        Example:
            >>> DryRunReport.from_dict(report.to_dict()) == report
            True
        """
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "mesh_shape": dict(self.mesh_shape),
            "shard_numel": dict(self.shard_numel),
            "collectives": [
                [k, d, self.counts[(k, d)], self.bytes.get((k, d), 0)]
                for (k, d) in sorted(self.counts)
            ],
            "seconds": self.seconds,
            "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, d: dict) -> DryRunReport:
        """The report of ``to_dict``'s output.

        Example:
            >>> DryRunReport.from_dict(json.loads(text)).counts
        """
        out = cls(int(d["world_size"]), int(d["rank"]), dict(d["mesh_shape"]))
        out.shard_numel = {k: int(v) for k, v in d["shard_numel"].items()}
        out.counts = {(k, dim): int(c) for k, dim, c, _ in d["collectives"]}
        out.bytes = {(k, dim): int(b) for k, dim, _, b in d["collectives"]}
        out.seconds = float(d["seconds"])
        out.layout = dict(d.get("layout", {}))
        return out


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
    t0 = time.perf_counter()
    shape, names = mesh_for(world_size, tp=tp, dp_replicate=dp_replicate)
    with _fake_world(rank, world_size):
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


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    """The fake default process group for the block, destroyed after it; and
    ``sys.excepthook`` restored: ``init_process_group`` wraps it (a ``[rank<r>]:`` prefix on
    every traceback line), and each further dry run in the process would wrap it again.
    Only torch's wrapper is undone."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if sys.excepthook is not hook and (
            getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook"
        ):
            sys.excepthook = hook


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


def _shard_numel(model, blocks=None) -> dict:
    """``{group name: elements of this rank's shards}`` of every ``fully_shard`` group,
    named as ``planner.group_layouts`` names them (``"root"``, ``"blocks[i]"``, and
    ``"blocks[i-j]"`` for a call on several blocks); ``blocks`` default to
    ``model.blocks`` / ``model.layers``."""
    from fsdp2._state import states_below

    if blocks is None:
        blocks = getattr(model, "blocks", None) or getattr(model, "layers", None)
    index = {id(b): i for i, b in enumerate(blocks or [])}
    out = {}
    for state in states_below([model]):
        if state.group is None:
            continue
        if state.modules[0] is model:
            name = "root"
        else:
            where = sorted(index[id(m)] for m in state.modules)
            lo, hi = where[0], where[-1]
            name = f"blocks[{lo}]" if lo == hi else f"blocks[{lo}-{hi}]"
        out[name] = sum(p.local.numel() for p in state.group.params)
    return out


# ---------------------------------------------------------------------------- plans
def meta_copy(model):
    """A copy of ``model`` on the meta device, made without copying any parameter or
    buffer data (each is replaced by a meta tensor of its shape and dtype before the deep
    copy; tied parameters stay tied).

    Example:
        >>> copy = meta_copy(model)                  # model on a GPU: nothing allocated
        >>> copy.head.weight.device
        device(type='meta')
    """
    import copy

    from torch import nn

    memo: dict = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    return copy.deepcopy(model, memo)


def build_on_meta(build_model):
    """The model of ``build_model`` on meta: a callable (called under
    ``torch.device("meta")``), a ``"module:function"`` string naming one, or a module
    (copied to meta with ``meta_copy``).

    Raises:
        ValueError: a string that does not name an importable callable.
        TypeError: anything else.

    Example:
        >>> build_on_meta("examples.gpt_builders:gpt_7b")
    """
    from torch import nn

    if isinstance(build_model, nn.Module):
        return meta_copy(build_model)
    if isinstance(build_model, str):
        build_model = import_builder(build_model)
    if not callable(build_model):
        raise TypeError(
            "dry run: build_model must be a callable returning the model, a "
            f"'module:function' string or a module, got {type(build_model).__name__}."
        )
    try:
        with torch.device("meta"):
            model = build_model()
    except Exception as e:
        raise RuntimeError(
            f"dry run: build_model ({getattr(build_model, '__qualname__', build_model)!r}) "
            f"raised {type(e).__name__}: {e}. It is called with no arguments under "
            'torch.device("meta") and must return the model.'
        ) from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"dry run: build_model returned {type(model).__name__}, not an nn.Module.")
    return model


def import_builder(spec: str, what: str = "build_model"):
    """The callable ``"package.module:function"`` names (``function`` may be dotted);
    ``what`` names the argument in the errors.

    Raises:
        ValueError: not of that form, not importable, or not callable.

    Example:
        >>> import_builder("examples.gpt:GPT")
        <class 'examples.gpt.GPT'>
    """
    import importlib

    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"{what}={spec!r}: expected 'package.module:function' (a callable importable "
            "in a fresh process)."
        )
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{what}={spec!r} is not importable ({e}); name a module-level function "
            "on the Python path."
        ) from None
    if not callable(obj):
        raise ValueError(f"{what}={spec!r} names {type(obj).__name__}, not a callable.")
    return obj


def is_checkpointed(module) -> bool:
    """Whether ``torch.distributed._composable.checkpoint`` wraps ``module``.

    Example:
        >>> is_checkpointed(model.blocks[0])
        True
    """
    from torch.distributed._composable.contract import _get_registry

    registry = _get_registry(module)
    return registry is not None and "checkpoint" in registry


def built_groups(model, names: dict | None = None) -> dict[str, dict]:
    """``{group name: {"numel": local shard elements, "reshard_after_forward": ...,
    "params": parameter FQNs}}`` of every ``fully_shard`` call below ``model`` that has
    parameters. A call is named ``names[module FQNs]`` (``names``: ``{tuple of the FQNs of
    the modules one call takes: name}``, ``""`` for the root), else
    ``"fully_shard(<fqns>)"``.

    Example:
        >>> built_groups(model, {("blocks.2",): "blocks[2]"})["blocks[2]"]["numel"]
        7068
    """
    from fsdp2._state import states_below

    names = names or {}
    fqn_of = {id(m): n for n, m in model.named_modules()}
    param_fqn = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for state in states_below([model]):
        if state.group is None:
            continue
        mods = tuple(fqn_of.get(id(m), "?") for m in state.modules)
        name = names.get(mods, f"fully_shard({', '.join(m or '<root>' for m in mods)})")
        out[name] = {
            "numel": sum(p.local.numel() for p in state.group.params),
            "reshard_after_forward": state.group.reshard_after_forward,
            "params": sorted(param_fqn.get(id(p.sharded_param), "?") for p in state.group.params),
        }
    return out


def dry_run_plan(
    plan, build_model, *, layout, rank: int = 0, loss_fn=None, collectives: bool = True
) -> DryRunReport:
    """Run ``plan`` (an ``fsdp2.auto.AutoPlan``) for rank ``rank`` of a simulated world of
    the plan's size: the model built on meta, laid out by ``layout(model, mesh)`` over a
    mesh of the plan's shape and dim names on the fake process group, one forward and
    backward at the plan's micro-batch and sequence length under ``CommDebugMode``.

    Args:
        plan: the plan (read: ``world_size``, ``mesh_shape``, ``mesh_dim_names``,
            ``groups``, ``blocks``, ``batch_size``, ``seq_len``).
        build_model: a callable returning the model (called under meta), a
            ``"module:function"`` string naming one, or the model (copied to meta).
        layout: ``layout(model, mesh)`` lays the model out as planned
            (``fsdp2.auto.verify_plan`` passes ``plan.apply`` without its check).
        rank: the simulated rank to play.
        loss_fn: ``loss_fn(model, idx) -> loss`` (default: the sum of the logits).
        collectives: run the step (False: shard sizes and layout only, no collectives).

    Raises:
        RuntimeError: a process group already exists here (run it in a fresh process).
        ValueError: a rank outside the world, or a model that is not the plan's.

    Example:
        >>> report = dry_run_plan(plan, lambda: GPT(cfg), rank=63,
        ...                       layout=functools.partial(plan.apply, check=False))
        >>> report.shard_numel, report.counts
    """
    _check_plan_run(plan, rank, layout)
    from device_mesh import init_device_mesh

    t0 = time.perf_counter()
    model = build_on_meta(build_model)
    shape, names = tuple(plan.mesh_shape), tuple(plan.mesh_dim_names)
    with _fake_world(rank, plan.world_size):
        layout(model, init_device_mesh("cpu", shape, mesh_dim_names=names))
        report = _plan_report(plan, model, rank)
        if collectives:
            report.counts, report.bytes = _step_collectives(
                model, loss_fn, plan.batch_size, max(plan.seq_len, 1)
            )
    report.seconds = time.perf_counter() - t0
    logger.info("dry run of the plan at rank %d of %d took %.1f s", rank, plan.world_size,
                report.seconds)  # fmt: skip
    return report


def _check_plan_run(plan, rank, layout) -> None:
    """What ``dry_run_plan`` needs, checked before the fake group exists."""
    _require_no_process_group()
    if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise ValueError(
            f"dry_run_plan: rank must be in [0, {plan.world_size}) for the plan's world, "
            f"got {rank!r}."
        )
    if not callable(layout):
        raise TypeError(
            f"dry_run_plan: layout must be a callable layout(model, mesh), such as "
            f"plan.apply, got {type(layout).__name__}."
        )


def _plan_report(plan, model, rank: int) -> DryRunReport:
    """The report of a laid-out model (its groups named as the plan's), without the step."""
    names = dict(zip(plan.mesh_dim_names, plan.mesh_shape, strict=True))
    report = DryRunReport(plan.world_size, rank, names)
    built = built_groups(model, {tuple(g.modules): g.name for g in plan.groups})
    report.shard_numel = {name: g["numel"] for name, g in built.items()}
    report.layout = {
        "reshard_after_forward": {n: g["reshard_after_forward"] for n, g in built.items()},
        "checkpointed": [f for f in plan.blocks if is_checkpointed(model.get_submodule(f))],
        "params": {n: g["params"] for n, g in built.items()},
    }
    return report
