"""Applying an ``AutoPlan`` to a model, and the in-process proof that the library built
what the plan predicts.

``apply_plan`` runs the plan's steps (``AutoPlan._steps``, the same ones ``calls()``
prints) with the library's own calls, in the order ``parallelize_transformer`` uses:
tensor parallelism (``dtensor.parallel.parallelize_module``), activation checkpointing
(``torch.distributed._composable.checkpoint``) on each planned block, ``fully_shard`` on
each block group, then on the root.

[Note: the in-process proof] After the calls, every rank compares each ``fully_shard``
group's local shard elements with the plan's prediction for its own mesh coordinate
(``AutoPlan.shard_numel_for``: ``torch.chunk`` sizes at the rank's tensor-parallel and
shard coordinates), checks that the same arithmetic at rank 0's coordinate gives the
planner's numbers stored in the plan, and that the groups' parameters (by FQN), their
``reshard_after_forward`` and the checkpointed blocks are the plan's. The ranks then agree
with one small all-reduce of a flag per rank, so a mismatch anywhere raises
``PlanMismatchError`` on every rank.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)
_API = "AutoPlan.apply"


class PlanMismatchError(RuntimeError):
    """What the library built, or what the dry run issued, differs from the plan.

    Attributes:
        mismatches: one line per difference (this rank's, or the dry run's).

    Example:
        >>> try:
        ...     plan.apply(model, mesh)
        ... except PlanMismatchError as e:
        ...     print(e.mismatches)
    """

    def __init__(self, message: str, mismatches: list[str] | None = None) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches or [])


def apply_plan(plan, model: nn.Module, mesh, *, tp_plan: dict | None = None, check: bool = True):
    """Lay ``model`` out over ``mesh`` as ``plan`` says; returns ``model`` (with the plan
    attached as ``model.auto_plan``).

    Args:
        plan: the ``AutoPlan``.
        model: the unsharded model: on the meta device (then ``model.to_empty(device=...)``
            and your initialization afterwards, as with ``fully_shard``), or on its device.
        mesh: a ``DeviceMesh`` of the plan's shape and dim names (``init_device_mesh(
            device, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)``).
        tp_plan: with tensor parallelism, the ``parallelize_module`` plan (default:
            ``fsdp2.plan.tp_plan_for(model)`` when the plan was made with it); its
            entries and style classes must be the plan's.
        check: prove the layout ([Note: the in-process proof]); one all-reduce over the
            default process group.

    Raises:
        ValueError: a mesh, model or tensor-parallel plan that does not match the plan
            (before anything changes and before any collective).
        PlanMismatchError: the built shards differ from the prediction (on every rank).

    Example:
        >>> mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
        >>> apply_plan(plan, model, mesh)
    """
    from device_mesh import as_device_mesh

    mesh = as_device_mesh(mesh, api=_API)
    tp_plan = _validate(plan, model, mesh, tp_plan)
    for step in plan._steps():
        _run_step(plan, model, mesh, step, tp_plan)
    logger.info("%s: laid out %s (%d fully_shard calls)", _API, plan.config.describe(),
                len(plan.groups))  # fmt: skip
    model.auto_plan = plan
    if check:
        agree_or_raise(check_layout(plan, model, mesh), mesh.device_type, what="the layout")
    return model


def _validate(plan, model, mesh, tp_plan) -> dict | None:
    """Everything ``apply_plan`` needs, checked without side effects; the tp plan to use."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: model must be an nn.Module, got {type(model).__name__}.")
    names, shape = tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)
    if names != tuple(plan.mesh_dim_names) or shape != tuple(plan.mesh_shape):
        raise ValueError(
            f"{_API}: mesh {dict(zip(names, shape))} is not the plan's "
            f"{dict(zip(plan.mesh_dim_names, plan.mesh_shape))}. Build it with "
            "init_device_mesh(device, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)."
        )
    if any("_fsdp_state" in m.__dict__ for m in model.modules()):
        raise ValueError(
            f"{_API}: model already has fully_shard applied; pass a fresh, unsharded model."
        )
    _check_model_is_the_plans(plan, model)
    if plan.tp <= 1:
        return None
    if tp_plan is None:
        if plan.tp_plan_source != "tp_plan_for":
            raise ValueError(
                f"{_API}: the plan uses a tensor-parallel plan of your own "
                f"({len(plan.tp_plan)} entries); pass it as tp_plan=."
            )
        from fsdp2.plan import tp_plan_for

        tp_plan = tp_plan_for(model)
    if not isinstance(tp_plan, dict):
        raise TypeError(f"{_API}: tp_plan must be a dict, got {type(tp_plan).__name__}.")
    got = {k: type(v).__name__ for k, v in tp_plan.items()}
    if got != dict(plan.tp_plan):
        diff = sorted(set(got.items()) ^ set(plan.tp_plan.items()))[:4]
        raise ValueError(
            f"{_API}: tp_plan's entries are not the plan's (differing: {diff}); pass the "
            "tensor-parallel plan the plan was made with."
        )
    return tp_plan


def _check_model_is_the_plans(plan, model) -> None:
    """The plan's modules exist in ``model`` and its parameters are the plan's (names and
    shapes), none of them a DTensor yet."""
    fqns = set(plan.blocks) | set(plan.checkpointed) | {f for g in plan.groups for f in g.modules}
    for fqn in sorted(fqns):
        try:
            model.get_submodule(fqn)
        except AttributeError:
            raise ValueError(
                f"{_API}: the plan names module {fqn!r}, which model "
                f"({type(model).__name__}) does not have; apply the plan to the model it "
                "was made for."
            ) from None
    params = {}
    for name, p in model.named_parameters():
        if _is_dtensor(p):
            raise ValueError(
                f"{_API}: parameter {name!r} is already a DTensor (tensor parallelism or "
                "sharding applied); apply the plan to a fresh model."
            )
        params[name] = tuple(p.shape)
    planned = {p.fqn: p.shape for g in plan.groups for p in g.params}
    wrong = [
        f"{f}: model {params.get(f)}, plan {s}" for f, s in planned.items() if params.get(f) != s
    ]
    if wrong or len(params) != len(planned):
        extra = sorted(set(params) - set(planned))[:3]
        raise ValueError(
            f"{_API}: model's parameters are not the plan's ({len(params)} in the model, "
            f"{len(planned)} in the plan; differing: {wrong[:3]}{', not planned: ' if extra else ''}"
            f"{extra if extra else ''}); apply the plan to the model it was made for."
        )


def _is_dtensor(t) -> bool:
    from dtensor import DTensor

    if isinstance(t, DTensor):
        return True
    try:
        from torch.distributed.tensor import DTensor as TorchDTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return False
    return isinstance(t, TorchDTensor)


def _run_step(plan, model, mesh, step, tp_plan) -> None:
    from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy
    from fsdp2.fully_shard import fully_shard

    kind = step[0]
    if kind == "tp":
        from dtensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], tp_plan)
    elif kind == "checkpoint":
        from torch.distributed._composable import checkpoint

        checkpoint(model.get_submodule(step[1]))
    else:
        _, fqns, raf = step
        mods = [model.get_submodule(f) for f in fqns]
        kw = {"mesh": mesh[plan.dp_dims]}
        if raf is not None:
            kw["reshard_after_forward"] = raf
        mp = plan.mp_policy()
        kw["mp_policy"] = mp if mp is not None else MixedPrecisionPolicy()
        if plan.offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        fully_shard(mods[0] if len(mods) == 1 else mods, **kw)


# ---------------------------------------------------------------------------- the proof
def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``torch.distributed._composable.checkpoint`` wraps ``module``
    (``fsdp2.tools.dry_run.is_checkpointed``).

    Example:
        >>> is_checkpointed(model.blocks[0])
        True
    """
    from fsdp2.tools.dry_run import is_checkpointed as _is_checkpointed

    return _is_checkpointed(module)


def built_groups(plan, model: nn.Module) -> dict[str, dict]:
    """``{group name: {"numel": local shard elements, "reshard_after_forward": ...,
    "params": parameter FQNs}}`` of every ``fully_shard`` call below ``model`` that has
    parameters, named as the plan names the call with the same modules (else
    ``"fully_shard(<fqns>)"``; ``fsdp2.tools.dry_run.built_groups``).

    Example:
        >>> built_groups(plan, model)["blocks[2]"]["numel"]
        7068
    """
    from fsdp2.tools.dry_run import built_groups as _built_groups

    return _built_groups(model, {tuple(g.modules): g.name for g in plan.groups})


def check_layout(plan, model: nn.Module, mesh=None, coordinate=None) -> list[str]:
    """This rank's differences between ``model`` as laid out and ``plan`` (empty: none):
    each group's shard elements against ``plan.shard_numel_for`` at this rank's mesh
    coordinate, the plan's rank-0 sizes against the same arithmetic, each block group's
    ``reshard_after_forward``, and the checkpointed blocks.

    Example:
        >>> check_layout(plan, model, mesh)
        []
    """
    if coordinate is None:
        coordinate = mesh.get_coordinate()
    out = []
    rank0 = plan.shard_numel_for(tuple(0 for _ in plan.mesh_shape))
    for g in plan.groups:
        if g.params and rank0[g.name] != g.shard_numel:
            out.append(
                f"{g.name}: the plan says rank 0 holds {g.shard_numel} elements, its "
                f"parameters' shapes give {rank0[g.name]}"
            )
    expected = plan.shard_numel_for(tuple(coordinate))
    built = built_groups(plan, model)
    for name in sorted(set(expected) | set(built)):
        want = expected.get(name)
        got = built.get(name, {}).get("numel")
        if want != got:
            out.append(
                f"{name}: built {got if got is not None else 'no group'} local elements at "
                f"mesh coordinate {tuple(coordinate)}, the plan predicts "
                f"{want if want is not None else 'no such group'}"
            )
    out += membership_mismatches(plan, {n: b["params"] for n, b in built.items()})
    for g in plan.groups:
        if g.reshard_after_forward is None or g.name not in built:
            continue
        got = built[g.name]["reshard_after_forward"]
        if got != g.reshard_after_forward:
            out.append(f"{g.name}: reshard_after_forward={got}, planned {g.reshard_after_forward}")
    planned_ac = set(plan.checkpointed)
    for fqn in plan.blocks:
        got = is_checkpointed(model.get_submodule(fqn))
        if got != (fqn in planned_ac):
            out.append(f"{fqn}: checkpointed={got}, planned {fqn in planned_ac}")
    return out


def membership_mismatches(plan, built: dict[str, list[str]]) -> list[str]:
    """The groups whose parameters (``{group: FQNs}`` as built) are not the plan's.

    Example:
        >>> membership_mismatches(plan, {"blocks[2]": ["blocks.2.ln1.weight", ...]})
        []
    """
    out = []
    for g in plan.groups:
        want = sorted(p.fqn for p in g.params)
        got = sorted(built.get(g.name, []))
        if want != got:
            moved = sorted(set(want) ^ set(got))
            out.append(
                f"{g.name}: holds {len(got)} parameters, the plan {len(want)}; differing: "
                f"{moved[:4]}{' ...' if len(moved) > 4 else ''}"
            )
    return out


def _flag_device(device_type: str) -> torch.device:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_or_raise(mismatches: list[str], device_type: str, *, what: str) -> None:
    """Raise ``PlanMismatchError`` on every rank when any rank found ``mismatches``: one
    all-reduce of a flag per rank over the default process group (none without one).

    Example:
        >>> agree_or_raise(check_layout(plan, model, mesh), "cpu", what="the layout")
    """
    failed = [0] if mismatches else []
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flags = torch.zeros(
            dist.get_world_size(), dtype=torch.int32, device=_flag_device(device_type)
        )
        flags[dist.get_rank()] = int(bool(mismatches))
        dist.all_reduce(flags)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    if mismatches:
        body = "".join(f"\n  - {m}" for m in mismatches[:20])
        message = (
            f"{what} differs from the plan on rank(s) {failed}; this rank's differences:{body}"
        )
    else:
        message = (
            f"{what} differs from the plan on rank(s) {failed} (their errors list the "
            "differences); this rank matches."
        )
    raise PlanMismatchError(message, mismatches)
