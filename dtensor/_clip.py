"""Gradient clipping over parameters that may live on different meshes."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dtensor.placement import Replicate
from dtensor.tensor import DTensor


def get_total_norm(
    tensors: Iterable[torch.Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """The p-norm of all ``tensors`` as if concatenated, as a plain replicated tensor.

    Tensors are grouped by mesh; each group's norm is reduced on its own mesh, and the
    per-group norms are combined locally, so parameters on a 2-D mesh and on its 1-D
    sub-mesh (or plain tensors) can be clipped together.

    Example:
        >>> get_total_norm([p.grad for p in model.parameters()], 2.0)
    """
    norm_type = float(norm_type)
    groups: dict = {}
    plain = []
    for t in tensors:
        if isinstance(t, DTensor):
            groups.setdefault(t.device_mesh, []).append(t)
        elif t is not None:
            plain.append(t)
    partial_norms = []
    for mesh, ts in groups.items():
        norms = torch._foreach_norm(ts, norm_type)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        partial_norms.append(total.redistribute(placements=[Replicate()] * mesh.ndim).to_local())
    if plain:
        partial_norms.extend(torch._foreach_norm(plain, norm_type))
    if not partial_norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in partial_norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; set "
            "error_if_nonfinite=False to clip anyway."
        )
    return total


def clip_grad_norm_(
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients in place so their global norm is at most ``max_norm``; return the norm.

    Same contract as ``torch.nn.utils.clip_grad_norm_``, for DTensor parameters on any mix
    of meshes (the stock function requires one mesh).

    Example:
        >>> total = dtensor.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
