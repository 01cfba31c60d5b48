"""``auto_parallelize``: profile, search, apply, prove.

[Note: auto_parallelize] The model is profiled on meta (``planner.profile_model``), the
layouts of the world are searched (``search.search_layouts``: tensor-parallel and HSDP
degrees, blocks per ``fully_shard`` call, which groups keep their parameters after
forward, the fewest checkpointed blocks, then lower precision, then CPU offload), and the
fastest that fits ``peak * (1 + margin) <= memory_budget`` is applied (``AutoPlan.apply``).

Every rank must call it with the same arguments and an equal model. Each checks its
arguments, profiles and searches on its own; then the ranks agree, before any process group
or mesh is created ([Note: failing together] at ``_together``): an error on any rank (a bad
argument, ``NothingFitsError`` for its budget) is raised on every rank, and ranks that chose
different plans all raise ``PlanMismatchError``. Only then is the mesh built (with an int
world: ``init_device_mesh(device, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)``,
kept as ``plan.mesh``).

Proofs, each an error on every rank when it fails (``PlanMismatchError``):

* the dry run (``dry_run=True``): rank 0 plays the plan on the fake process group in a
  fresh process at the plan's world size (the first and the last rank) and compares shard
  sizes, the layout and the collectives of one step with the plan (``verify_plan``;
  [Note: the dry-run proof]), before the model is touched. The fresh process rebuilds the
  model from ``build_model`` (``"package.module:function"`` or a module-level function,
  called under ``torch.device("meta")``), else from a pickled meta copy (its classes
  importable, not defined in ``__main__``). Its step's loss is ``forward_fn`` when that
  imports by name or pickles (not from ``__main__``); else the sum of the logits; for a
  model whose output has none, no collectives are compared (a warning and a line in
  ``plan.notes``). It may take ``DRY_RUN_TIMEOUT_S`` (240 s; ``FSDP2_DRY_RUN_TIMEOUT_S`` in
  the environment sets another: keep it below the process group's timeout, which the other
  ranks wait under);
* in process, after the calls: every rank's shard sizes against the plan's prediction for
  its mesh coordinate ([Note: the in-process proof]).

The arguments, beyond the docstring's lines: a mesh's dims are named from
``"dp_replicate"``, ``"dp_shard"`` (or ``"dp"``) and ``"tp"``, in that order, one shard dim
required, of size 2 or more. ``batch`` is the global batch, the number every layout keeps:
each data-parallel rank feeds ``plan.batch_size = batch / plan.dp`` sequences, and the ranks
of a ``tp`` group feed the same ones (``plan.data_parallel_rank()``). ``blocks`` default to
``model.blocks`` / ``model.layers`` / ``model.model.layers`` / ``model.transformer.h`` (a
generator is read once). ``param_dtypes`` is a list of ``torch.bfloat16`` /
``torch.float16`` / ``torch.float32`` or ``(param_dtype, reduce_dtype)`` pairs, tried in
order (``search_layouts``). ``check_first_step`` measures the first steady-state step and
warns once when its peak is further from the prediction than the margin ([Note: the
first-step check]: on CPU that step runs under the memory tracker; on CUDA it reads the
peak counters, and resets them only when an earlier peak hides the step's); it is
``plan.first_step_check``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, replace

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
    model: nn.Module, mesh_or_world, *, memory_budget, batch: int, seq_len: int,
    blocks=None, tp_plan: dict | None = None, forward_fn=None, hardware=None,
    margin: float | None = None, param_dtypes=None, offload="last-resort",
    optimizer: str = "adamw", dry_run: bool = True, check_first_step: bool = True,
    build_model=None,
) -> AutoPlan:  # fmt: skip
    """Choose the fastest layout of ``model`` that fits ``memory_budget`` per rank, apply
    it with ``fully_shard`` / ``parallelize_module`` / activation checkpointing, prove it,
    and return the ``AutoPlan`` (also ``model.auto_plan``). Every rank calls it with the
    same arguments and an equal model ([Note: auto_parallelize] in ``fsdp2/auto/_entry.py``).

    Args:
        model: the unsharded model, on meta (then ``model.to_empty(device=...)`` and your
            initialization; on the host when ``plan.offload``) or on its device.
        mesh_or_world: a ``DeviceMesh`` with dims from ``"dp_replicate"``, ``"dp_shard"``
            (or ``"dp"``), ``"tp"`` (its sizes fix the degrees), or the world size.
        memory_budget: bytes a rank may hold: an int, ``80e9``, ``"80GB"``, ``"74GiB"``.
        batch / seq_len: the global batch (sequences a step over all data-parallel ranks)
            and tokens a sequence (at most the model config's maximum).
        blocks / tp_plan: the transformer blocks (default: found) and the tensor-parallel
            plan (default ``fsdp2.plan.tp_plan_for(model)``; ``{}``: none).
        forward_fn: ``forward_fn(model, idx) -> loss`` for the trace and the dry run's step.
        hardware / margin: the cost model (default ``CPU``, or ``H100`` with the ranks'
            smallest device memory) and the headroom: ``peak * (1 + margin) <= budget``.
        param_dtypes / offload / optimizer: the dtype ladder, ``"last-resort"`` / True /
            False, and ``"adamw"`` / ``"sgd"`` / ``"sgd-nomomentum"``.
        dry_run / build_model / check_first_step: the dry-run proof in a fresh process
            (``build_model`` rebuilds the model there), the first-step memory check.

    Raises:
        ValueError / TypeError: a bad argument (named, with the fix). NothingFitsError: no
            layout fits. PlanMismatchError: another rank failed, the ranks chose different
            plans, or a proof failed. Every rank raises together.

    Example:
        >>> plan = auto_parallelize(model, dist.get_world_size(), memory_budget="70GiB",
        ...                         batch=64, seq_len=2048)
        >>> model.to_empty(device="cpu" if plan.offload else "cuda"); model.reset_parameters()
        >>> dp_rank, dp_size = plan.data_parallel_rank()   # a tp group shares its dp_rank
        >>> x = batch_for(dp_rank, plan.batch_size)        # plan.batch_size rows a dp rank
    """
    args, plan, proof = _plan_on_every_rank(
        model, mesh_or_world, memory_budget, batch, seq_len, blocks, tp_plan, forward_fn,
        hardware, margin, param_dtypes, offload, optimizer, dry_run, check_first_step,
        build_model,
    )  # fmt: skip
    return _lay_out(model, plan, args, proof, check_first_step)


def _plan_on_every_rank(model, mesh_or_world, memory_budget, batch, seq_len, blocks, tp_plan,
                        forward_fn, hardware, margin, param_dtypes, offload, optimizer, dry_run,
                        check_first_step, build_model):  # fmt: skip
    """``(arguments, plan, dry-run payload)``, the same on every rank, before any group
    exists ([Note: failing together])."""
    # 1. validate, locally; on CUDA with the default hardware, read this device's memory.
    #    Then one all-reduce: every rank learns whether any failed, and the smallest memory.
    error, args, memory = None, None, None
    try:
        args = _validate(
            model, mesh_or_world, memory_budget, batch, seq_len, blocks, tp_plan, forward_fn,
            hardware, margin, param_dtypes, offload, optimizer, dry_run, check_first_step,
            build_model,
        )  # fmt: skip
        memory = _device_memory(args.device_type) if hardware is None else None
    except Exception as e:  # noqa: BLE001 - shared with every rank, then raised
        error = e
    (least,) = _together("checking the arguments", error, [-(memory or _NO_MEMORY)])
    memory = None if -least >= _NO_MEMORY else -least
    # 2. profile and search (local, the same on every rank), then every rank on one plan
    plan, proof = None, None
    try:
        hw = hardware or _default_hardware(args.device_type, memory)
        plan, proof = _plan(model, args, hw, batch, seq_len, forward_fn, margin, offload,
                            optimizer, dry_run, build_model)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - shared with every rank, then raised
        error = e
    _agree_on_plan(plan, error)
    return args, plan, proof


def _lay_out(model, plan: AutoPlan, args, proof, check_first_step: bool) -> AutoPlan:
    """The mesh (groups are created only now), the dry run, the calls with the in-process
    proof, and the first-step check."""
    mesh = args.mesh
    if mesh is None:
        from device_mesh import init_device_mesh

        mesh = init_device_mesh(
            args.device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names
        )
    plan.mesh = mesh
    tp_plan = args.tp_plan if plan.tp > 1 else None
    if proof is not None:  # the dry run, before the model changes
        _dry_run_proof(plan, proof, tp_plan if args.tp_given else None)
    plan.apply(model, mesh, tp_plan=tp_plan, check=True)
    if check_first_step:
        from fsdp2.auto._first_step import FirstStepCheck

        plan.first_step_check = FirstStepCheck(plan, model, args.device_type)
    if _rank() == 0:
        logger.info("%s chose:\n%s", _API, plan)
    return plan


def _plan(model, args, hardware, batch, seq_len, forward_fn, margin, offload, optimizer,
          dry_run, build_model):  # fmt: skip
    """``(plan, how the dry run gets the model and the loss)``: the profile, the search and
    the plan, all local."""
    from fsdp2.tools.planner import profile_model

    proof = None
    if dry_run:
        proof = _dry_run_source(model, build_model)
        proof.update(_dry_run_loss(model, forward_fn, seq_len))
    profile = profile_model(
        model, seq_len=seq_len, blocks=args.blocks, tp_plan=args.tp_plan, forward_fn=forward_fn
    )
    result = _search(profile, args.world, args.budget, hardware, batch, margin, args.tp,
                     args.rep, args.mesh, args.param_dtypes, offload, optimizer)  # fmt: skip
    mesh = args.mesh
    plan = AutoPlan.from_estimate(
        result.best,
        profile,
        budget=result.budget,
        margin=result.margin,
        considered=result.considered,
        mesh_shape=tuple(mesh.shape) if mesh is not None else None,
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh is not None else None,
        device_type=args.device_type,
        tp_plan_source="user" if args.tp_given else "tp_plan_for",
    )
    if proof is not None and proof.get("note"):
        plan.notes.append(proof["note"])
    return plan, proof


# ---------------------------------------------------------------------------- validation
@dataclass
class _Args:
    """What ``_validate`` found: the user's mesh (None: build one), the world size, the
    compute device, the budget in bytes, the blocks (a list, or None: found by the
    profile), the dtype ladder, the tensor-parallel plan and the mesh's degrees."""

    mesh: object
    world: int
    device_type: str
    budget: int
    blocks: list | None
    param_dtypes: tuple | None
    tp_plan: dict | None
    tp_given: bool
    tp: int
    rep: int


def _validate(model, mesh_or_world, memory_budget, batch, seq_len, blocks, tp_plan,
              forward_fn, hardware, margin, param_dtypes, offload, optimizer, dry_run,
              check_first_step, build_model) -> _Args:  # fmt: skip
    """Everything checked, locally and without side effects; raises on bad input."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: model must be an nn.Module, got {type(model).__name__}.")
    if any("_fsdp_state" in m.__dict__ for m in model.modules()):
        raise ValueError(
            f"{_API}: model already has fully_shard applied; pass a fresh, unsharded model."
        )
    budget = _budget_bytes(memory_budget)
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_API}: {name} must be a positive int, got {value!r}.")
    _check_seq_len(model, seq_len)
    if margin is not None and (
        isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 10
    ):
        raise ValueError(
            f"{_API}: margin must be a fraction >= 0 (0.1: keep 10% free), got {margin!r}."
        )
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"{_API}: optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}.")
    if not (offload is True or offload is False or offload == "last-resort"):
        raise ValueError(
            f"{_API}: offload must be True, False or 'last-resort' (CPU offload only when "
            f"nothing fits on the device), got {offload!r}."
        )
    dtypes = _check_param_dtypes(param_dtypes)
    _check_types(tp_plan, forward_fn, hardware, dry_run, check_first_step)
    blocks = _check_blocks(model, blocks)
    if dry_run:
        if build_model is not None:
            _builder_name(build_model)
        from fsdp2.auto._proof import dry_run_timeout

        dry_run_timeout()  # raises on a bad FSDP2_DRY_RUN_TIMEOUT_S
    mesh, world = _mesh_or_world(mesh_or_world)
    device_type = _device_type(model, mesh)
    tp, rep = _mesh_degrees(mesh)
    if mesh is not None and batch % (world // tp):
        dp = world // tp
        raise ValueError(
            f"{_API}: batch={batch} (the global batch) is not divisible by the mesh's "
            f"{dp} data-parallel ranks; pick a multiple of {dp}."
        )
    tp_given = tp_plan is not None
    if tp_plan is None:
        from fsdp2.plan import tp_plan_for

        tp_plan = tp_plan_for(model)
    if tp > 1:
        _check_tp(model, tp, tp_plan)
    return _Args(mesh, world, device_type, budget, blocks, dtypes, tp_plan, tp_given, tp, rep)


def _budget_bytes(memory_budget) -> int:
    """The budget in bytes: an int, a float with an integral value (``80e9``) or a string."""
    from fsdp2.tools.planner import parse_bytes

    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float, str)):
        raise TypeError(
            f"{_API}: memory_budget must be bytes (an int, or a float of whole bytes such "
            f"as 80e9) or a string such as '80GB' or '24GiB', got {memory_budget!r}."
        )
    if isinstance(memory_budget, float) and not (
        math.isfinite(memory_budget) and memory_budget.is_integer()
    ):
        raise ValueError(
            f"{_API}: memory_budget={memory_budget!r} is not a whole number of bytes; pass "
            "an int (80e9 is fine) or a string such as '80GB'."
        )
    budget = memory_budget
    if isinstance(memory_budget, str):
        try:
            budget = parse_bytes(memory_budget)
        except ValueError:
            raise ValueError(
                f"{_API}: memory_budget={memory_budget!r} is not a size; pass bytes (an int) "
                "or a number with a unit, such as '80GB' (10^9 bytes) or '74GiB' (2^30)."
            ) from None
    if budget <= 0:
        raise ValueError(f"{_API}: memory_budget must be positive, got {memory_budget!r}.")
    return int(budget)


def _check_seq_len(model: nn.Module, seq_len: int) -> None:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
        limit = getattr(cfg, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            if seq_len > limit:
                raise ValueError(
                    f"{_API}: seq_len={seq_len} is longer than the model's {name}={limit}; "
                    f"pass seq_len <= {limit}, or build the model with a longer {name}."
                )
            return


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _check_param_dtypes(param_dtypes) -> tuple | None:
    """The ladder as a tuple of dtypes or ``(param_dtype, reduce_dtype)`` pairs."""
    if param_dtypes is None:
        return None
    fix = (
        "pass a list such as [torch.bfloat16] or [(torch.bfloat16, torch.float32)] (param "
        "and reduce dtype), tried in order; None for the default"
    )
    if isinstance(param_dtypes, (str, torch.dtype)) or not isinstance(param_dtypes, (list, tuple)):
        raise TypeError(
            f"{_API}: param_dtypes must be a list of dtypes, got {param_dtypes!r}; {fix}."
        )
    if not param_dtypes:
        raise ValueError(f"{_API}: param_dtypes is empty; {fix}.")
    for entry in param_dtypes:
        pair = entry if isinstance(entry, tuple) else (entry,)
        ok = len(pair) in (1, 2) and all(
            d in _DTYPE_NAMES or (d is None and isinstance(entry, tuple)) for d in pair
        )
        if not ok:
            raise ValueError(
                f"{_API}: param_dtypes entry {entry!r} is not a floating dtype of "
                f"{sorted(_DTYPE_NAMES.values())} (or a pair of them, None for the "
                f"parameters' own); {fix}."
            )
    return tuple(param_dtypes)


def _check_types(tp_plan, forward_fn, hardware, dry_run, check_first_step) -> None:
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


def _check_blocks(model: nn.Module, blocks) -> list | None:
    """``blocks`` as a list (a generator is read once, here), each a distinct submodule of
    ``model``; None stays None (the profile finds them)."""
    if blocks is None:
        return None
    fix = "pass a list of the model's blocks, such as list(model.layers), or None"
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"{_API}: blocks must be a list of modules, got one {type(blocks).__name__}; {fix}."
        )
    try:
        blocks = list(blocks)
    except TypeError:
        raise TypeError(
            f"{_API}: blocks must be a list of modules, got {type(blocks).__name__}; {fix}."
        ) from None
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise TypeError(f"{_API}: blocks must be a non-empty list of modules; {fix}.")
    mine = {id(m) for m in model.modules() if m is not model}
    strangers = [i for i, b in enumerate(blocks) if id(b) not in mine]
    if strangers:
        raise ValueError(
            f"{_API}: blocks[{strangers[0]}] ({type(blocks[strangers[0]]).__name__}) is not a "
            f"submodule of the model; {fix}."
        )
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError(f"{_API}: blocks lists a module twice; {fix}.")
    return blocks


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
        sizes = dict(zip(names, mesh.shape, strict=True))
        shard = sizes.get("dp_shard", sizes.get("dp"))
        if sizes.get("dp_replicate", 1) > 1 and shard < 2:
            raise ValueError(
                f"{_API}: the mesh replicates over {sizes['dp_replicate']} ranks but shards "
                f"over {shard} (mesh {sizes}); the layouts searched shard over at least 2 "
                "ranks (HSDP: replicas of sharded groups). Name that dim 'dp_shard' "
                "(init_device_mesh(device, (2,), mesh_dim_names=('dp_shard',))), or pass "
                "the world size."
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


# an all-reduce of memories by MAX of their negatives: a rank without one sends this
_NO_MEMORY = 1 << 62


def _device_memory(device_type: str) -> int | None:
    """This rank's device memory in bytes (CUDA), else None."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _default_hardware(device_type: str, memory: int | None):
    """``CPU`` on a CPU mesh, else ``H100`` with ``memory`` (the smallest device's of the
    ranks: they search alike)."""
    from fsdp2.tools.planner import CPU, H100

    if device_type != "cuda":
        return CPU
    return replace(H100, memory=int(memory)) if memory else H100


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


def _dry_run_loss(model: nn.Module, forward_fn, seq_len: int) -> dict:
    """How the dry run's step gets its loss: ``{"loss": loss_payload(forward_fn) or None,
    "collectives": whether to compare them, "note": what the plan says (or None)}``.

    ``forward_fn`` goes to the fresh process when it can; else the step uses the sum of
    the logits when the model's output has them; else the dry run compares no collectives
    (a warning): never a mismatch the loss made up."""
    from fsdp2.auto._proof import loss_payload

    if forward_fn is None:
        return {"loss": None, "collectives": True, "note": None}
    sent = loss_payload(forward_fn)
    if sent is not None:
        return {"loss": sent, "collectives": True, "note": None}
    name = getattr(forward_fn, "__qualname__", type(forward_fn).__name__)
    why = (
        f"forward_fn {name!r} cannot be sent to the dry run's fresh process (not importable "
        "by name and not picklable without __main__)"
    )
    if _has_logits(model, seq_len):
        note = f"the dry run's step used the sum of the logits: {why}"
        return {"loss": None, "collectives": True, "note": note}
    note = (
        f"the dry run compared no collectives: {why}, and the model's output has no logits "
        "for the default loss; pass a module-level forward_fn to have them compared"
    )
    if _rank() == 0:
        logger.warning("%s: %s.", _API, note)
    return {"loss": None, "collectives": False, "note": note}


def _has_logits(model: nn.Module, seq_len: int) -> bool:
    """Whether ``model(idx)`` on a meta copy gives a tensor or an output with ``.logits``
    (what the dry run's default loss sums)."""
    from fsdp2.tools.dry_run import meta_copy

    try:
        copy = meta_copy(model)
        idx = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
        with torch.no_grad():
            out = copy(idx)
    except Exception:  # noqa: BLE001 - any failure: the default loss does not work
        return False
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    return isinstance(logits, torch.Tensor)


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
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _group_device() -> torch.device:
    """Where the default group's collectives run: the CPU for gloo, else this GPU."""
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "nccl" not in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _together(stage: str, error: BaseException | None, values: list[int]) -> list[int]:
    """[Note: failing together] One all-reduce (MAX) over the default group of ``[this
    rank failed, *values]``, before any group is created: when any rank failed, every
    rank raises - the failing ones their own error, the others a ``PlanMismatchError``
    naming the ranks that failed and their errors (one ``all_gather_object`` of a short
    message, on that path only). Returns ``values`` reduced. Without a group of several
    ranks: ``error`` raised, ``values`` returned."""
    if _group_size() <= 1:
        if error is not None:
            raise error
        return list(values)
    t = torch.tensor([int(error is not None), *values], dtype=torch.int64, device=_group_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) == 0:
        return [int(v) for v in t[1:].tolist()]
    mine = None if error is None else f"{type(error).__name__}: {str(error)[:500]}"
    notes: list = [None] * _group_size()
    dist.all_gather_object(notes, mine)
    if error is not None:
        raise error
    failed = [r for r, n in enumerate(notes) if n is not None]
    raise PlanMismatchError(
        f"{_API}: rank(s) {failed} failed while {stage} (rank {failed[0]}: "
        f"{notes[failed[0]]}); this rank did not. Every rank must call it with the same "
        "arguments and an equal model; fix the error there.",
        [f"rank {r}: {notes[r]}" for r in failed],
    )


def _plan_digest(plan: AutoPlan) -> int:
    return int.from_bytes(hashlib.sha256(plan.to_json().encode()).digest()[:7], "big")


def _agree_on_plan(plan: AutoPlan | None, error: BaseException | None) -> None:
    """Every rank planned without error and chose the same plan (one all-reduce of a
    failure flag and the plan's digest), else raise on every rank ([Note: failing
    together])."""
    d = _plan_digest(plan) if plan is not None else 0
    high, low = _together("planning", error, [d, -d])
    if high != -low:
        raise PlanMismatchError(
            f"{_API}: the ranks chose different plans (this rank: {plan.config.describe()}); "
            "call it with the same arguments and an equal model on every rank (a "
            "different GPU per rank changes the default hardware: pass hardware=)."
        )


def _dry_run_proof(plan: AutoPlan, proof: dict, tp_plan) -> None:
    """Rank 0 runs the dry run in a fresh process; every rank gets the verdict."""
    from fsdp2.auto._proof import run_in_fresh_process

    rank0 = _rank() == 0
    verdict = [None]
    if rank0:
        try:
            source = {k: proof[k] for k in ("build_model", "model_bytes") if k in proof}
            check = run_in_fresh_process(
                plan, tp_plan=tp_plan, loss=proof["loss"], collectives=proof["collectives"],
                **source,
            )  # fmt: skip
            verdict = [(check.ok, check.summary(), check.mismatches)]
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
            verdict = [(False, f"the dry run could not run: {type(e).__name__}: {e}", [])]
    if _group_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    ok, summary, mismatches = verdict[0]
    if not ok:
        raise PlanMismatchError(f"{_API}: the dry run (rank 0) says: {summary}", mismatches)
    logger.info("%s: %s", _API, summary)
