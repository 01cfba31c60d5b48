"""``parallelize_module``: apply parallel styles to the modules a plan names."""

from __future__ import annotations

import difflib
import fnmatch
import inspect
import logging

from torch import nn

from device_mesh import as_device_mesh
from dtensor._workspace import collective_workspace
from dtensor.parallel.style import ParallelizeCall, ParallelStyle

logger = logging.getLogger(__name__)
_API = "parallelize_module"


def parallelize_module(
    module: nn.Module,
    device_mesh=None,
    parallelize_plan=None,
    *,
    src_data_rank: int | None = 0,
):
    """Lay ``module`` out over the 1-D tensor-parallel ``device_mesh`` as ``parallelize_plan``
    says, in place; returns ``module``.

    ``parallelize_plan`` is one ``ParallelStyle`` (applied to ``module`` itself) or a dict
    from module paths to styles. A path segment may be a pattern: ``*`` matches any one
    segment (``"blocks.*.mlp.fc"``). Every key is checked before anything changes: a key
    that matches no module is an error naming the closest real path, and a style given a
    module type it does not support names the type.

    ``src_data_rank`` (default 0) is the mesh rank whose parameter values every rank gets
    (its shards are scattered, its replicated parameters broadcast), so ranks that built the
    module with different seeds still agree. ``None`` skips that communication: each rank
    keeps its own values' slice (right when every rank built the same values, or will
    initialize after parallelizing). Parameters on the meta device are never communicated.

    The mesh's collectives then reuse their CPU buffers from step to step
    (``dtensor.collective_workspace``; [Note: collective workspace]).

    Example:
        >>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        >>> parallelize_module(model, mesh, {"blocks.*.mlp.fc": ColwiseParallel(),
        ...                                  "blocks.*.mlp.out": RowwiseParallel()})
    """
    mesh = _checked_mesh(module, device_mesh, src_data_rank)
    if parallelize_plan is None:
        logger.warning("%s: no parallelize_plan given; nothing to do", _API)
        return module
    targets = _resolve(module, parallelize_plan)
    for path, sub, style in targets:  # every module checked before any changes
        style._check(sub, path)
    call = ParallelizeCall(src_data_rank)
    result = module
    for _, sub, style in targets:
        if "call" in inspect.signature(style._apply).parameters:
            style._apply(sub, mesh, call)
        else:  # a style written for PyTorch: _apply(module, device_mesh), as PyTorch calls it
            style.src_data_rank = src_data_rank
            applied = style._apply(sub, mesh)
            if sub is module and isinstance(applied, nn.Module):
                result = applied  # PyTorch returns what a style on the root returns
    collective_workspace(mesh)  # activations cross this dim every step
    return result


def _checked_mesh(module, device_mesh, src_data_rank):
    """The 1-D tensor-parallel mesh, once ``module``, ``device_mesh`` and
    ``src_data_rank`` are checked (a clear error for each, before anything changes)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_API}: module must be an nn.Module, got {type(module).__name__}.")
    if device_mesh is None:
        raise ValueError(f"{_API}: device_mesh is required (the tensor-parallel mesh).")
    mesh = as_device_mesh(device_mesh, api=_API, argument="device_mesh")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names
        hint = f' such as mesh["{names[-1]}"]' if names else ""
        raise ValueError(
            f"{_API}: device_mesh must be 1-D (the tensor-parallel dim), got a {mesh.ndim}-D "
            f"mesh of shape {mesh.shape}. Pass a 1-D slice{hint}."
        )
    _check_src_data_rank(src_data_rank, mesh)
    return mesh


def _check_src_data_rank(src_data_rank, mesh) -> None:
    if src_data_rank is not None and (
        isinstance(src_data_rank, bool)
        or not isinstance(src_data_rank, int)
        or not 0 <= src_data_rank < mesh.size()
    ):
        raise ValueError(
            f"{_API}: src_data_rank must be in [0, {mesh.size()}) or None, got "
            f"{src_data_rank!r}: the rank of the tensor-parallel mesh whose values are sent."
        )


def _resolve(module: nn.Module, plan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """``(path, module, style)`` for every module the plan names, in plan order."""
    if isinstance(plan, ParallelStyle):
        return [("", module, plan)]
    if not isinstance(plan, dict):
        raise TypeError(
            f"{_API}: parallelize_plan must be a ParallelStyle or a dict of module path -> "
            f"ParallelStyle, got {type(plan).__name__}."
        )
    paths = dict(module.named_modules())
    out = []
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"{_API}: the plan entry {key!r} must be a ParallelStyle (ColwiseParallel(), "
                f"...), got {style!r}."
            )
        matches = [p for p in paths if p and _matches(key, p)]
        if not matches:
            raise ValueError(
                f"{_API}: the plan key {key!r} matches no module. {_closest(key, paths)}"
            )
        out.extend((p, paths[p], style) for p in matches)
    return out


def _matches(pattern: str, path: str) -> bool:
    pat, segs = pattern.split("."), path.split(".")
    return len(pat) == len(segs) and all(fnmatch.fnmatchcase(s, p) for s, p in zip(segs, pat))


def _closest(key: str, paths) -> str:
    real = [p for p in paths if p]

    # compare with '*' replaced by each candidate's segment, so patterns find their kin
    def score(p):
        segs, pat = p.split("."), key.split(".")
        filled = (
            ".".join(s if q == "*" else q for s, q in zip(segs, pat))
            if len(segs) == len(pat)
            else key
        )
        return difflib.SequenceMatcher(None, filled, p).ratio()

    best = sorted(real, key=score, reverse=True)[:3]
    if not best:
        return "The module has no submodules."
    return "Closest module paths: " + ", ".join(repr(p) for p in best) + "."
