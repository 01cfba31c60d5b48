"""``AutoPlan``: one chosen layout, readable, serializable and replayable.

A plan is built from the planner's ``Estimate`` of the chosen layout (``from_estimate``)
and holds everything needed to lay a model out again without the planner: the mesh, the
tensor-parallel plan's entries, every ``fully_shard`` group (the module FQNs it covers, its
``reshard_after_forward``, its parameters' shapes, rank 0's shard size), the checkpointed
blocks, the mixed-precision dtypes and offload, and what the planner predicted (the peak by
category, the allocator's view, the step time, the collectives of one step).

``plan.calls()`` renders the layout as Python source; ``plan.apply(model, mesh)``
(``fsdp2/auto/_apply.py``) performs the same calls. Both come from one list of steps
(``_steps``), so what is printed is what runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from dtensor.placement import chunk_sizes
from fsdp2.auto._render import (
    plan_from_dict,
    plan_to_dict,
    render_calls,
    render_table,
)
from fsdp2.tools.planner import PlanConfig


@dataclass(frozen=True)
class PlannedParam:
    """One parameter of a ``fully_shard`` group: its FQN (a tied one under its first name),
    global shape, and the dim tensor parallelism shards (None: none).

    Example:
        >>> PlannedParam("blocks.0.mlp.fc.weight", (192, 48), None).numel
        9216
    """

    fqn: str
    shape: tuple[int, ...]
    tp_dim: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    def local_numel(self, tp: int, tp_rank: int, shard: int, shard_rank: int) -> int:
        """Elements one rank holds: ``torch.chunk`` of the tensor-parallel dim at
        ``tp_rank`` of ``tp``, then of dim 0 of that at ``shard_rank`` of ``shard`` (as
        ``fully_shard`` shards a tensor-parallel local tensor).

        Example:
            >>> PlannedParam("w", (67, 48)).local_numel(1, 0, 2, 1)    # 33 rows of 48
            1584
        """
        local = list(self.shape) or [1]
        if tp > 1 and self.tp_dim is not None:
            local[self.tp_dim] = chunk_sizes(local[self.tp_dim], tp)[tp_rank]
        return chunk_sizes(local[0], shard)[shard_rank] * math.prod(local[1:])


@dataclass(frozen=True)
class PlannedGroup:
    """One ``fully_shard`` call of a plan.

    Attributes:
        name: the planner's name: ``"root"``, ``"blocks[3]"``, ``"blocks[2-3]"``.
        modules: the FQNs of the modules the call takes (``""``: the root model).
        reshard_after_forward: the call's argument (None for the root: ``fully_shard``'s
            default, which keeps the root's parameters from forward to backward).
        shard_numel: rank 0's elements of the group's shards (the planner's prediction).
        unsharded_numel: the gathered (padded) elements.
        params: the group's parameters.

    Example:
        >>> [g.name for g in plan.groups]
        ['root', 'blocks[0-1]', 'blocks[2]']
    """

    name: str
    modules: tuple[str, ...]
    reshard_after_forward: bool | None
    shard_numel: int
    unsharded_numel: int
    params: tuple[PlannedParam, ...] = ()

    @property
    def is_root(self) -> bool:
        """Whether this is the call on the root model."""
        return self.modules == ("",)


@dataclass(frozen=True)
class Alternative:
    """A layout the search also considered: its label (``PlanConfig.describe()``),
    predicted peak and step time, whether it fits and whether it was chosen.

    Example:
        >>> [a.layout for a in plan.alternatives if a.chosen]
        ['fsdp 2 2blk keep-last1 ac1blk bf16']
    """

    layout: str
    peak_bytes: int
    step_s: float
    fits: bool
    chosen: bool = False


@dataclass
class AutoPlan:
    """The layout ``auto_parallelize`` chose (or one built by hand from an ``Estimate``),
    with what the planner predicted for it.

    ``str(plan)`` is a plain-text table; ``to_json`` / ``from_json`` round trip;
    ``calls()`` is the layout as Python source; ``apply(model, mesh)`` performs it.

    Attributes:
        config: the planner's ``PlanConfig`` (world size, degrees, wrapping, dtypes...).
        mesh_shape / mesh_dim_names: the mesh, dims named from ``("dp_replicate",
            "dp_shard", "tp")`` (``"dp"`` instead of ``"dp_shard"`` when the user's mesh
            names it so).
        device_type: ``"cuda"`` or ``"cpu"``: the mesh's device.
        blocks: the FQNs of the transformer blocks.
        groups: the ``fully_shard`` calls, the root's first (it runs last).
        checkpointed: the FQNs of the blocks wrapped in activation checkpointing.
        tp_plan: ``{module pattern: style class name}`` of the tensor-parallel plan (empty
            without tensor parallelism); ``tp_plan_source`` is ``"tp_plan_for"`` when it is
            ``fsdp2.plan.tp_plan_for(model)``'s, else ``"user"``.
        predicted_peak / peak_phase / categories: the planner's peak of live tensor bytes on
            rank 0 (the largest shards), its moment and its bytes by category.
        allocator_bytes: what the allocator is expected to hold at that peak.
        budget / margin: the per-rank budget (bytes, None: none) and the margin a layout was
            held to (``peak * (1 + margin) <= budget``).
        step_s / compute_s / comm_s: the predicted step time and its parts (seconds).
        collectives: ``{(kind, mesh dim): (count, bytes per rank)}`` of one step.
        global_batch / seq_len: sequences per optimizer step over all data-parallel ranks,
            and tokens per sequence, that the prediction is for.
        hardware: the name of the hardware model.
        alternatives: a few layouts the search also considered, fastest first.
        measured_peak: the peak measured after the first training step (None before).
        notes: what the proofs did not cover, and why (a dry run without the collectives,
            say); printed with the plan.
        mesh: the ``DeviceMesh`` the plan was applied over (``auto_parallelize`` sets it;
            None for a plan read from JSON; not serialized).
        first_step_check: the ``FirstStepCheck`` ``auto_parallelize`` installed (None:
            none); ``plan.first_step_check.remove()`` takes it off. Not serialized.

    Example:
        >>> plan = auto_parallelize(model, 8, memory_budget="80GB", batch=16, seq_len=2048)
        >>> print(plan)
        >>> dp_rank, dp_size = plan.data_parallel_rank(dist.get_rank())  # which rows to feed
        >>> plan.calls()[-1]
        'fully_shard(model, mesh=mesh["dp_shard"], mp_policy=MixedPrecisionPolicy(...))'
    """

    config: PlanConfig
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    device_type: str
    blocks: tuple[str, ...]
    groups: list[PlannedGroup]
    checkpointed: tuple[str, ...]
    tp_plan: dict = field(default_factory=dict)
    tp_plan_source: str = "tp_plan_for"
    predicted_peak: int = 0
    peak_phase: str = ""
    categories: dict = field(default_factory=dict)
    allocator_bytes: int = 0
    budget: int | None = None
    margin: float | None = None
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    collectives: dict = field(default_factory=dict)
    global_batch: int = 1
    seq_len: int = 0
    hardware: str = ""
    alternatives: list[Alternative] = field(default_factory=list)
    measured_peak: int | None = None
    notes: list[str] = field(default_factory=list)
    mesh: object = field(default=None, compare=False, repr=False)
    first_step_check: object = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_estimate(
        cls,
        est,
        profile,
        *,
        budget: int | None = None,
        margin: float | None = None,
        considered=(),
        mesh_shape: tuple[int, ...] | None = None,
        mesh_dim_names: tuple[str, ...] | None = None,
        device_type: str | None = None,
        tp_plan_source: str = "tp_plan_for",
        top: int = 5,
    ) -> AutoPlan:
        """The plan of the planner's estimate ``est`` of ``profile``'s model.

        Args:
            est: ``planner.estimate(profile, config, hardware)``.
            profile: the ``ModelProfile`` it was estimated from (the block FQNs, the
                tensor-parallel plan).
            budget / margin: recorded (``search_layouts``' result has them).
            considered: the search's other estimates; the first ``top`` are kept.
            mesh_shape / mesh_dim_names: a user's mesh (default ``dry_run.mesh_for``'s):
                dims from ``"dp_replicate"``, ``"dp_shard"`` (or ``"dp"``), ``"tp"`` in that
                order, of the configuration's sizes (those of size one left out or kept).
            device_type: ``"cuda"`` or ``"cpu"`` (default: the estimate's hardware's).

        Raises:
            ValueError: dim names that do not fit the configuration.

        Example:
            >>> est = estimate(profile, PlanConfig(world_size=2, blocks_per_group=2), CPU)
            >>> plan = AutoPlan.from_estimate(est, profile, budget=2**30)
        """
        from fsdp2.tools.dry_run import mesh_for

        cfg, hw = est.config, est.hardware
        shape, names = mesh_for(cfg.world_size, tp=cfg.tp, dp_replicate=cfg.dp_replicate)
        if mesh_dim_names is not None:
            shape, names = _user_mesh(tuple(mesh_shape or ()), tuple(mesh_dim_names), cfg)
        fqn_of = {id(m): n for n, m in profile.model.named_modules()}
        blocks = tuple(fqn_of[id(b)] for b in profile.blocks)
        return cls(
            config=cfg,
            mesh_shape=shape,
            mesh_dim_names=names,
            device_type=device_type or (hw.device if hw is not None else "cuda"),
            blocks=blocks,
            groups=_planned_groups(est, blocks),
            checkpointed=tuple(blocks[i] for i in sorted(cfg.checkpointed(len(blocks)))),
            tp_plan=_tp_entries(cfg, profile),
            tp_plan_source=tp_plan_source,
            budget=budget,
            margin=margin,
            global_batch=cfg.batch_size * cfg.dp,
            seq_len=int(profile.seq_len),
            hardware=hw.name if hw is not None else "",
            alternatives=_alternatives(est, list(considered)[:top], budget, margin),
            **_predictions(est, "dp" if "dp" in names else "dp_shard"),
        )

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        """Ranks of the mesh."""
        return self.config.world_size

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (1: none)."""
        return self.config.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas times shards)."""
        return self.config.dp

    @property
    def batch_size(self) -> int:
        """Sequences each data-parallel rank feeds one forward (``global_batch / dp``)."""
        return self.config.batch_size

    @property
    def shard_dim(self) -> str:
        """The name of the mesh dim ``fully_shard`` shards over."""
        return "dp" if "dp" in self.mesh_dim_names else "dp_shard"

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The mesh dims ``fully_shard`` takes (replicate and shard, in mesh order)."""
        sizes = dict(zip(self.mesh_dim_names, self.mesh_shape, strict=True))
        return tuple(
            n
            for n in self.mesh_dim_names
            if n != "tp" and not (n == "dp_replicate" and sizes[n] == 1)
        )

    @property
    def param_dtype(self) -> torch.dtype | None:
        """``MixedPrecisionPolicy.param_dtype`` (None: the parameters' own)."""
        return self.config.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """``MixedPrecisionPolicy.reduce_dtype`` (None: the param dtype)."""
        return self.config.reduce_dtype

    @property
    def offload(self) -> bool:
        """Whether every call gets ``CPUOffloadPolicy()``."""
        return self.config.offload

    def mp_policy(self):
        """The ``MixedPrecisionPolicy`` of every call (None: no mixed precision).

        Example:
            >>> plan.mp_policy()
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ...)
        """
        from fsdp2.api import MixedPrecisionPolicy

        if self.param_dtype is None and self.reduce_dtype is None:
            return None
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of global ``rank`` (row-major, as ``init_device_mesh``).

        Example:
            >>> plan.mesh_shape, plan.coordinate_of(5)
            ((2, 4), (1, 1))
        """
        coord = []
        for size in reversed(self.mesh_shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def data_parallel_rank(self, rank: int | None = None) -> tuple[int, int]:
        """``(index, size)`` of ``rank``'s data-parallel group: which ``plan.batch_size``
        rows of the global batch it feeds, of how many (``plan.dp``). The ranks of one
        tensor-parallel group share an index: they must feed the same rows. ``rank``
        defaults to this process's (``dist.get_rank()``).

        Example:
            >>> plan.mesh_shape, [plan.data_parallel_rank(r) for r in range(4)]
            ((2, 2), [(0, 2), (0, 2), (1, 2), (1, 2)])
            >>> index, size = plan.data_parallel_rank()
            >>> x = global_batch[index * plan.batch_size:(index + 1) * plan.batch_size]
        """
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"AutoPlan.data_parallel_rank: rank must be an int in [0, {self.world_size}) "
                f"(a global rank of the plan's world), got {rank!r}."
            )
        index = 0
        for name, size, c in zip(self.mesh_dim_names, self.mesh_shape, self.coordinate_of(rank)):
            if name != "tp":
                index = index * size + c
        return index, self.dp

    def shard_numel_for(self, rank: int | tuple[int, ...]) -> dict[str, int]:
        """``{group name: elements of its shards}`` on ``rank`` (a global rank or a mesh
        coordinate), from ``torch.chunk`` sizes at that rank's tensor-parallel and shard
        coordinates; groups without parameters are left out (``fully_shard`` makes no
        parameter group for them).

        Example:
            >>> plan.shard_numel_for(0) == {g.name: g.shard_numel for g in plan.groups}
            True
        """
        coord = self.coordinate_of(rank) if isinstance(rank, int) else tuple(rank)
        where = dict(zip(self.mesh_dim_names, coord, strict=True))
        t, s = where.get("tp", 0), where.get(self.shard_dim, 0)
        tp, shard = self.tp, self.config.dp_shard
        return {
            g.name: sum(p.local_numel(tp, t, shard, s) for p in g.params)
            for g in self.groups
            if g.params
        }

    # ------------------------------------------------------------------ the calls
    def _steps(self) -> list[tuple]:
        """The layout as steps, in order: ``("tp",)``, ``("checkpoint", fqn)``, ``("shard",
        fqns, reshard_after_forward)`` (the blocks' groups, then the root)."""
        steps: list[tuple] = []
        if self.tp > 1:
            steps.append(("tp",))
        steps += [("checkpoint", fqn) for fqn in self.checkpointed]
        root = [g for g in self.groups if g.is_root]
        for g in [g for g in self.groups if not g.is_root] + root:
            steps.append(("shard", g.modules, g.reshard_after_forward))
        return steps

    def calls(self) -> list[str]:
        """The Python source of the calls ``apply`` makes, imports first: executed with
        ``model`` and ``mesh`` bound (and ``tp_plan`` when the plan's tensor-parallel plan
        is not ``tp_plan_for(model)``'s), they lay a fresh model out the same way.

        Example:
            >>> print("\\n".join(plan.calls()))
            import torch
            from fsdp2 import MixedPrecisionPolicy, fully_shard
            from torch.distributed._composable import checkpoint
            checkpoint(model.blocks[0])
            fully_shard([model.blocks[0], model.blocks[1]], mesh=mesh["dp_shard"], ...)
            fully_shard(model.blocks[2], mesh=mesh["dp_shard"], reshard_after_forward=False, ...)
            fully_shard(model, mesh=mesh["dp_shard"], mp_policy=...)
        """
        return render_calls(self)

    def apply(self, model, mesh, *, tp_plan: dict | None = None, check: bool = True):
        """Lay ``model`` out as planned over ``mesh`` with the library's calls (those
        ``calls()`` prints); returns ``model``, the plan attached as ``model.auto_plan``.

        Args:
            model: the unsharded model, on meta (then ``model.to_empty(device=...)`` and
                your initialization, as with ``fully_shard``; on the host when
                ``offload``) or on its device.
            mesh: a ``DeviceMesh`` of ``mesh_shape`` and ``mesh_dim_names``.
            tp_plan: with tensor parallelism, the ``parallelize_module`` plan (default:
                ``fsdp2.plan.tp_plan_for(model)`` when the plan was made with it); its
                entries and style classes must be the plan's.
            check: prove the layout ([Note: the in-process proof] in
                ``fsdp2/auto/_apply.py``): one all-reduce over the default process group.

        Raises:
            ValueError: a mesh, model or tensor-parallel plan that is not the plan's
                (before anything changes and before any collective).
            PlanMismatchError: the shards built differ from the prediction (every rank).

        Example:
            >>> plan = AutoPlan.from_json(open("plan.json").read())
            >>> with torch.device("meta"):
            ...     model = GPT(cfg)
            >>> plan.apply(model, init_device_mesh("cuda", plan.mesh_shape,
            ...                                    mesh_dim_names=plan.mesh_dim_names))
            >>> model.to_empty(device="cuda"); model.reset_parameters()
        """
        from fsdp2.auto._apply import apply_plan

        return apply_plan(self, model, mesh, tp_plan=tp_plan, check=check)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """A JSON-ready ``dict`` of the plan (``from_dict`` reads it back).

        Example:
            >>> AutoPlan.from_dict(plan.to_dict()) == plan
            True
        """
        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> AutoPlan:
        """The plan of ``to_dict``'s output.

        Raises:
            ValueError: not a plan of this format.

        Example:
            >>> AutoPlan.from_dict(plan.to_dict()) == plan
            True
        """
        return plan_from_dict(cls, d, PlannedGroup, PlannedParam, Alternative)

    def to_json(self, indent: int | None = 1) -> str:
        """The plan as JSON text.

        Example:
            >>> Path("plan.json").write_text(plan.to_json())
        """
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> AutoPlan:
        """The plan of ``to_json``'s text.

        Raises:
            ValueError: not JSON, or not a plan.

        Example:
            >>> AutoPlan.from_json(plan.to_json()) == plan
            True
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"AutoPlan.from_json: not JSON text ({e}).") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ text
    def __str__(self) -> str:
        return render_table(self)


def _planned_groups(est, blocks: tuple[str, ...]) -> list[PlannedGroup]:
    """The ``fully_shard`` calls of the estimate, the root's first (an empty one when the
    root holds no parameters: it is always sharded, it runs the iteration)."""
    cfg = est.config
    n_block_groups = sum(g.name != "root" for g in est.groups)
    root, groups = PlannedGroup("root", ("",), None, 0, 0, ()), []
    for g in est.groups:
        params = tuple(
            PlannedParam(p.fqn, tuple(p.shape), p.tp_dim if cfg.tp > 1 else None) for p in g.params
        )
        if g.name == "root":
            root = PlannedGroup("root", ("",), None, g.shard_numel, g.unsharded_numel, params)
            continue
        raf = cfg.reshards(len(groups), n_block_groups)
        modules = tuple(blocks[i] for i in g.blocks)
        groups.append(PlannedGroup(g.name, modules, raf, g.shard_numel, g.unsharded_numel, params))
    return [root, *groups]


def _tp_entries(cfg, profile) -> dict:
    """``{module pattern: style class name}`` of the profile's tensor-parallel plan, where
    the layout uses it."""
    if cfg.tp <= 1 or not profile.tp_plan:
        return {}
    return {k: type(v).__name__ for k, v in profile.tp_plan.items()}


def _alternatives(est, considered: list, budget, margin) -> list[Alternative]:
    """The layouts ``considered`` as ``Alternative``s, the chosen one included."""
    cfg = est.config
    limit = None if budget is None else budget / (1 + (margin or 0.0))
    out = [
        Alternative(
            e.config.describe(),
            int(e.peak_bytes),
            float(e.step_s),
            limit is None or e.peak_bytes <= limit,
            e.config == cfg,
        )
        for e in considered
    ]
    if considered and not any(a.chosen for a in out):
        out.insert(0, Alternative(cfg.describe(), est.peak_bytes, est.step_s, True, True))
    return out


def _predictions(est, shard_dim: str) -> dict:
    """The planner's predictions of the estimate, as ``AutoPlan`` fields (collectives on
    the shard dim named ``shard_dim``)."""
    return dict(
        predicted_peak=int(est.peak_bytes),
        peak_phase=est.peak_phase,
        categories={k: int(v) for k, v in est.categories.items()},
        allocator_bytes=int(est.allocator_bytes),
        step_s=float(est.step_s),
        compute_s=float(est.compute_s),
        comm_s=float(est.comm_s),
        collectives={
            (kind, shard_dim if dim == "dp_shard" else dim): (int(c), int(b))
            for (kind, dim), (c, b) in est.collectives.items()
        },
    )


def _user_mesh(shape: tuple[int, ...], names: tuple[str, ...], cfg: PlanConfig):
    """``(shape, names)`` of a user's mesh, checked against ``cfg``'s degrees."""
    order = ("dp_replicate", "dp_shard", "dp", "tp")
    want = {"dp_replicate": cfg.dp_replicate, "dp_shard": cfg.dp_shard, "dp": cfg.dp_shard,
            "tp": cfg.tp}  # fmt: skip
    ok = (
        len(shape) == len(names)
        and len(set(names)) == len(names)
        and all(n in order for n in names)
        and [order.index(n) for n in names] == sorted(order.index(n) for n in names)
        and sum(n in ("dp_shard", "dp") for n in names) == 1
        and all(want[n] == s for n, s in zip(names, shape))
        and all(n in names for n, v in want.items() if v > 1 and n not in ("dp_shard", "dp"))
    )
    if not ok:
        raise ValueError(
            f"AutoPlan: mesh {dict(zip(names, shape))} does not fit the layout "
            f"{cfg.describe()!r} (dp_replicate={cfg.dp_replicate}, dp_shard={cfg.dp_shard}, "
            f"tp={cfg.tp}); dims must be named from {order} in that order, with one shard "
            "dim ('dp_shard' or 'dp')."
        )
    return shape, names
