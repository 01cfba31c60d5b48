"""``auto_parallelize``: profile, search, apply, prove."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from fsdp2.auto._apply import PlanMismatchError
from fsdp2.auto._plan import AutoPlan

logger = logging.getLogger("fsdp2.auto")
_API = "auto_parallelize"
_DIM_ORDER = ("dp_replicate", "dp_shard", "dp", "tp")
_OPTIMIZERS = ("adamw", "sgd", "sgd-nomomentum")


def auto_parallelize(
    model: nn.Module,
    mesh_or_world,
    *,
    memory_budget,
    batch: int,
    seq_len: int,
    blocks=None,
    tp_plan: dict | None = None,
    forward_fn=None,
    hardware=None,
    margin: float | None = None,
    param_dtypes=None,
    offload="last-resort",
    optimizer: str = "adamw",
    dry_run: bool = True,
    check_first_step: bool = True,
    build_model=None,
) -> AutoPlan:
    """Choose the fastest layout of ``model`` that fits ``memory_budget`` per rank, apply
    it with ``fully_shard`` / ``parallelize_module`` / activation checkpointing, prove it,
    and return the ``AutoPlan``.

    The model is profiled on meta (``planner.profile_model``), the layouts of the world
    are searched (``search.search_layouts``: tensor-parallel and HSDP degrees, blocks per
    ``fully_shard`` call, which groups keep their parameters after forward, the fewest
    checkpointed blocks, then lower precision, then CPU offload), and the fastest that
    fits ``peak * (1 + margin) <= memory_budget`` is applied (``AutoPlan.apply``). Every
    rank must call it with the same arguments and an equal model; they check that they
    chose the same plan.

    Proofs, each an error on every rank when it fails (``PlanMismatchError``):

    * the dry run (``dry_run=True``): rank 0 plays the plan on the fake process group in a
      fresh process at the plan's world size (the first and the last rank) and compares
      shard sizes, the layout and the collectives of one step with the plan
      (``verify_plan``), before the model is touched;
    * in process, after the calls: every rank's shard sizes against the plan's
      prediction for its mesh coordinate ([Note: the in-process proof]).

    Args:
        model: the unsharded model: built under ``torch.device("meta")`` (then, after this
            returns, ``model.to_empty(device=...)`` and your initialization, as with
            ``fully_shard``; or load a checkpoint), or on its device (its values are
            sharded as they are). When the plan offloads (``plan.offload``), materialize
            on the host: ``model.to_empty(device="cpu")``.
        mesh_or_world: a ``DeviceMesh`` whose dims are named from ``"dp_replicate"``,
            ``"dp_shard"`` (or ``"dp"``) and ``"tp"``, in that order, one shard dim
            required: its sizes fix the degrees. Or the world size (an int, equal to the
            initialized default group's): the search picks the degrees and the mesh is
            built with ``init_device_mesh(device, plan.mesh_shape,
            mesh_dim_names=plan.mesh_dim_names)``.
        memory_budget: bytes one rank may hold (an int, or a string: ``"80GB"``,
            ``"24GiB"``).
        batch: the global batch: sequences per optimizer step over all data-parallel
            ranks, the number that every layout keeps (it defines the training run). Each
            data-parallel rank feeds ``plan.batch_size = batch / plan.dp`` of them per
            step (with tensor parallelism, the ranks of a ``tp`` group feed the same ones).
        seq_len: tokens per sequence.
        blocks: the transformer blocks (default ``model.blocks`` / ``model.layers`` /
            ``model.model.layers`` / ``model.transformer.h``).
        tp_plan: the ``parallelize_module`` plan for tensor-parallel layouts (default:
            ``fsdp2.plan.tp_plan_for(model)``; None there: no tensor parallelism).
        forward_fn: ``forward_fn(model, idx) -> loss`` for the activation trace (default:
            cross-entropy of the logits); the dry run's step uses the sum of the logits
            (the collectives do not depend on the loss).
        hardware: a ``planner.Hardware`` (default: ``CPU`` on a CPU mesh, else ``H100``
            with this device's memory).
        margin: the headroom a layout must leave: ``peak * (1 + margin) <= budget``
            (default: the hardware's allocator overhead, ``search.default_margin``).
        param_dtypes: the mixed-precision ladder the search may climb (see
            ``search_layouts``).
        offload: ``"last-resort"`` (CPU offload only when nothing fits), True or False.
        optimizer: ``"adamw"``, ``"sgd"`` or ``"sgd-nomomentum"``: the state the
            prediction counts.
        dry_run: run the dry-run proof (a fresh Python process on rank 0, a few seconds).
        check_first_step: measure the first steady-state training step and warn (once)
            when its peak is further from the prediction than the margin
            ([Note: the first-step check]; on CPU that step runs under the memory
            tracker).
        build_model: how the dry run's fresh process rebuilds the model: a
            ``"package.module:function"`` string or a module-level function (called under
            ``torch.device("meta")``). Default: a pickled meta copy of ``model`` (its
            classes must be importable, not defined in ``__main__``).

    Returns:
        The ``AutoPlan`` applied, also attached as ``model.auto_plan``: ``print(plan)``
        for the table, ``plan.calls()`` for the calls as source, ``plan.to_json()``.

    Raises:
        ValueError / TypeError: bad arguments (naming the argument and the fix), raised on
            every rank before any collective.
        search.NothingFitsError: no layout fits (a ValueError; it says what would fit).
        PlanMismatchError: ranks chose different plans, or a proof failed (every rank).

    Example:
        >>> dist.init_process_group("nccl"); torch.cuda.set_device(local_rank)
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
        ...                           fused_qkv=False))
        >>> plan = auto_parallelize(model, dist.get_world_size(), memory_budget="70GiB",
        ...                         batch=64, seq_len=2048)
        >>> model.to_empty(device="cpu" if plan.offload else "cuda"); model.reset_parameters()
        >>> x = batch_for(rank, plan.batch_size)          # plan.batch_size rows a dp rank
    """
    from fsdp2.tools.planner import profile_model

    # 1. validate: local and deterministic, so every rank fails alike, before any collective
    args = _validate(
        model, mesh_or_world, memory_budget, batch, seq_len, blocks, tp_plan, forward_fn,
        hardware, margin, optimizer, dry_run, check_first_step, build_model,
    )  # fmt: skip
    mesh, world, device_type, budget = args
    tp_given = tp_plan is not None
    if tp_plan is None:
        from fsdp2.plan import tp_plan_for

        tp_plan = tp_plan_for(model)
    tp, rep = _mesh_degrees(mesh)
    if tp > 1:
        _check_tp(model, tp, tp_plan)
    hardware = hardware or _default_hardware(device_type)
    source = _dry_run_source(model, build_model) if dry_run else None
    # 2. profile and search (local)
    profile = profile_model(
        model, seq_len=seq_len, blocks=blocks, tp_plan=tp_plan, forward_fn=forward_fn
    )
    result = _search(profile, world, budget, hardware, batch, margin, tp, rep, mesh,
                     param_dtypes, offload, optimizer)  # fmt: skip
    plan = AutoPlan.from_estimate(
        result.best,
        profile,
        budget=result.budget,
        margin=result.margin,
        considered=result.considered,
        mesh_shape=tuple(mesh.shape) if mesh is not None else None,
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh is not None else None,
        device_type=device_type,
        tp_plan_source="user" if tp_given else "tp_plan_for",
    )
    # 3. the mesh, and every rank on the same plan
    if mesh is None:
        from device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    _agree_on_plan(plan, device_type)
    # 4. the dry run, before the model changes
    if dry_run:
        _dry_run_proof(plan, source, tp_plan if plan.tp > 1 and tp_given else None)
    # 5. apply, with the in-process proof
    plan.apply(model, mesh, tp_plan=tp_plan if plan.tp > 1 else None, check=True)
    if check_first_step:
        from fsdp2.auto._first_step import FirstStepCheck

        FirstStepCheck(plan, model, device_type)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("%s chose:\n%s", _API, plan)
    return plan


# ---------------------------------------------------------------------------- validation
def _validate(model, mesh_or_world, memory_budget, batch, seq_len, blocks, tp_plan,
              forward_fn, hardware, margin, optimizer, dry_run, check_first_step,
              build_model):  # fmt: skip
    """``(mesh or None, world size, device type, budget bytes)``; raises on bad input."""
    from fsdp2.tools.planner import parse_bytes

    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: model must be an nn.Module, got {type(model).__name__}.")
    if any("_fsdp_state" in m.__dict__ for m in model.modules()):
        raise ValueError(
            f"{_API}: model already has fully_shard applied; pass a fresh, unsharded model."
        )
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, str)):
        raise TypeError(
            f"{_API}: memory_budget must be bytes (an int) or a string such as '80GB' or "
            f"'24GiB', got {memory_budget!r}."
        )
    budget = parse_bytes(memory_budget) if isinstance(memory_budget, str) else memory_budget
    if budget <= 0:
        raise ValueError(f"{_API}: memory_budget must be positive, got {memory_budget!r}.")
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_API}: {name} must be a positive int, got {value!r}.")
    if margin is not None and (
        isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 10
    ):
        raise ValueError(
            f"{_API}: margin must be a fraction >= 0 (0.1: keep 10% free), got {margin!r}."
        )
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"{_API}: optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}.")
    _check_types(tp_plan, forward_fn, hardware, dry_run, check_first_step, blocks)
    if dry_run and build_model is not None:
        _builder_name(build_model)
    mesh, world = _mesh_or_world(mesh_or_world)
    device_type = _device_type(model, mesh)
    if mesh is not None:
        tp, rep = _mesh_degrees(mesh)
        dp = world // tp
        if batch % dp:
            raise ValueError(
                f"{_API}: batch={batch} (the global batch) is not divisible by the mesh's "
                f"{dp} data-parallel ranks; pick a multiple of {dp}."
            )
    return mesh, world, device_type, int(budget)


def _check_types(tp_plan, forward_fn, hardware, dry_run, check_first_step, blocks) -> None:
    from fsdp2.tools.planner import Hardware

    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(
            f"{_API}: hardware must be a fsdp2.tools.planner.Hardware (H100, CPU, or "
            f"replace(H100, ...)), got {type(hardware).__name__}."
        )
    if tp_plan is not None and not isinstance(tp_plan, dict):
        raise TypeError(f"{_API}: tp_plan must be a dict, got {type(tp_plan).__name__}.")
    if forward_fn is not None and not callable(forward_fn):
        raise TypeError(f"{_API}: forward_fn must be callable, got {type(forward_fn).__name__}.")
    for name, value in (("dry_run", dry_run), ("check_first_step", check_first_step)):
        if not isinstance(value, bool):
            raise TypeError(f"{_API}: {name} must be True or False, got {value!r}.")
    if blocks is not None and not all(isinstance(b, nn.Module) for b in blocks):
        raise TypeError(f"{_API}: blocks must be a list of modules.")


def _mesh_or_world(mesh_or_world):
    """``(mesh or None, world size)``."""
    from device_mesh import DeviceMesh, as_device_mesh

    initialized = dist.is_available() and dist.is_initialized()
    if isinstance(mesh_or_world, bool) or not isinstance(mesh_or_world, int):
        if not isinstance(mesh_or_world, DeviceMesh) and not hasattr(
            mesh_or_world, "mesh_dim_names"
        ):
            raise TypeError(
                f"{_API}: mesh_or_world must be a DeviceMesh or the world size (an int), "
                f"got {type(mesh_or_world).__name__}."
            )
        mesh = as_device_mesh(mesh_or_world, api=_API)
        names = tuple(mesh.mesh_dim_names or ())
        ok = (
            len(names) == mesh.ndim
            and all(n in _DIM_ORDER for n in names)
            and list(names) == sorted(names, key=_DIM_ORDER.index)
            and sum(n in ("dp_shard", "dp") for n in names) == 1
        )
        if not ok:
            raise ValueError(
                f"{_API}: the mesh's dims must be named from {_DIM_ORDER} in that order, "
                f"with one shard dim ('dp_shard' or 'dp'); got {names or None}. Build it "
                'with init_device_mesh(device, (2, 4), mesh_dim_names=("dp_shard", "tp")), '
                "or pass the world size and let the search pick the degrees."
            )
        world = mesh.size()
        if initialized and world != dist.get_world_size():
            raise ValueError(
                f"{_API}: the mesh has {world} ranks but the world has "
                f"{dist.get_world_size()}; give a mesh over every rank."
            )
        return mesh, world
    world = mesh_or_world
    if world < 1:
        raise ValueError(f"{_API}: the world size must be >= 1, got {world}.")
    if not initialized:
        raise ValueError(
            f"{_API}: mesh_or_world={world} needs the default process group initialized "
            "(torchrun and dist.init_process_group(...)) to build the mesh."
        )
    if world != dist.get_world_size():
        raise ValueError(
            f"{_API}: mesh_or_world={world}, but the default process group has "
            f"{dist.get_world_size()} ranks; pass dist.get_world_size()."
        )
    return None, world


def _device_type(model: nn.Module, mesh) -> str:
    """The compute device: the mesh's; else the model's; else the process group's."""
    kinds = {p.device.type for p in model.parameters()} - {"meta"}
    if mesh is not None:
        dev = mesh.device_type
        if kinds and kinds != {dev} and not (dev == "cuda" and kinds == {"cpu"}):
            raise ValueError(
                f"{_API}: the model is on {sorted(kinds)} but the mesh on {dev!r}; build "
                "the model on meta or on the mesh's device."
            )
        return dev
    if "cuda" in kinds:
        return "cuda"
    if kinds - {"cpu"}:
        raise ValueError(f"{_API}: the model is on {sorted(kinds)}; supported: meta, cpu and cuda.")
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    return "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"


def _mesh_degrees(mesh) -> tuple[int, int]:
    """``(tp, dp_replicate)`` of a user mesh (1, 1 without one)."""
    if mesh is None:
        return 1, 1
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    return sizes.get("tp", 1), sizes.get("dp_replicate", 1)


def _check_tp(model: nn.Module, tp: int, tp_plan) -> None:
    from fsdp2.recipe import _check_divisible

    if not tp_plan:
        raise ValueError(
            f"{_API}: the mesh has a 'tp' dim of size {tp} but there is no tensor-parallel "
            f"plan for {type(model).__name__} (tp_plan_for found none); pass tp_plan=."
        )
    _check_divisible(model, tp)


def _default_hardware(device_type: str):
    from fsdp2.tools.planner import CPU, H100

    if device_type != "cuda":
        return CPU
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return replace(H100, memory=int(props.total_memory))
    return H100


def _builder_name(build_model) -> str:
    """``"module:function"`` of ``build_model`` for a fresh process; raises when it has none."""
    from fsdp2.auto._proof import importable_name
    from fsdp2.tools.dry_run import import_builder

    if isinstance(build_model, str):
        import_builder(build_model)  # raises a ValueError naming the problem
        return build_model
    if callable(build_model):
        name = importable_name(build_model)
        if name is None:
            raise ValueError(
                f"{_API}: build_model={build_model!r} cannot be imported by name in a fresh "
                "process (a lambda, a local function or one in __main__); pass a "
                "module-level function, or its name as 'package.module:function'."
            )
        return name
    raise TypeError(
        f"{_API}: build_model must be None, a 'package.module:function' string or a "
        f"function, got {type(build_model).__name__}."
    )


def _dry_run_source(model: nn.Module, build_model) -> dict:
    """How the fresh process gets the model: ``{"build_model": "module:function"}`` or
    ``{"model_bytes": pickled meta copy}``; raises when neither works."""
    from fsdp2.auto._proof import model_payload

    if build_model is None:
        return {"model_bytes": model_payload(model)}
    return {"build_model": _builder_name(build_model)}


def _search(profile, world, budget, hardware, batch, margin, tp, rep, mesh, param_dtypes,
            offload, optimizer):  # fmt: skip
    from fsdp2.tools.search import search_layouts

    fixed = mesh is not None
    return search_layouts(
        profile,
        world,
        budget,
        hardware=hardware,
        global_batch=batch,
        margin=margin,
        tp_degrees=(tp,) if fixed else None,
        replicate_degrees=(rep,) if fixed else None,
        param_dtypes=param_dtypes,
        offload=offload,
        optimizer=optimizer,
    )


# ---------------------------------------------------------------------------- agreement
def _plan_digest(plan: AutoPlan) -> int:
    return int.from_bytes(hashlib.sha256(plan.to_json().encode()).digest()[:7], "big")


def _agree_on_plan(plan: AutoPlan, device_type: str) -> None:
    """Every rank chose the same plan (one all-reduce of the plan's digest), else raise
    on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from fsdp2.auto._apply import _flag_device

    d = _plan_digest(plan)
    t = torch.tensor([d, -d], dtype=torch.int64, device=_flag_device(device_type))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    high, low = int(t[0]), -int(t[1])
    if high != low:
        raise PlanMismatchError(
            f"{_API}: the ranks chose different plans (this rank: {plan.config.describe()}); "
            "call it with the same arguments and an equal model on every rank (a "
            "different GPU per rank changes the default hardware: pass hardware=)."
        )


def _dry_run_proof(plan: AutoPlan, source: dict, tp_plan) -> None:
    """Rank 0 runs the dry run in a fresh process; every rank gets the verdict."""
    from fsdp2.auto._proof import run_in_fresh_process

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    verdict = [None]
    if rank0:
        try:
            check = run_in_fresh_process(plan, tp_plan=tp_plan, **source)
            verdict = [(check.ok, check.summary(), check.mismatches)]
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
            verdict = [(False, f"the dry run could not run: {type(e).__name__}: {e}", [])]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    ok, summary, mismatches = verdict[0]
    if not ok:
        raise PlanMismatchError(f"{_API}: the dry run (rank 0) says: {summary}", mismatches)
    logger.info("%s: %s", _API, summary)
