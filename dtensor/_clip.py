"""Gradient clipping over parameters that may live on different meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dtensor.placement import Replicate, Shard, is_shard_like
from dtensor.tensor import DTensor


def get_total_norm(
    tensors: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """The p-norm of all ``tensors`` as if concatenated, as a plain replicated tensor.

    Tensors are grouped by mesh; each group's norm is reduced on its own mesh, and the
    per-group norms are combined locally, so parameters on a 2-D mesh and on its 1-D
    sub-mesh (or plain tensors) can be clipped together.

    ``deterministic=True`` (for ``fsdp2``'s ``set_deterministic_reduction``) gives the same
    bits whatever the shard boundaries: each rank sums ``|x|**p`` over every row (dim-0
    slice) it holds, the row sums are all-gathered in global order and added along
    ``dtensor.comm.tree_sum_into``'s pairwise tree. The default adds per-shard norms, so its
    last bits depend on the world size. Only ``Shard(0)`` and ``Replicate`` placements can be
    summed by rows; the max norms (``inf``) and ``0`` are exact either way.

    Raises:
        ValueError: ``deterministic`` with a tensor sharded along another dim or partial.

    Example:
        >>> get_total_norm([p.grad for p in model.parameters()], 2.0)
    """
    norm_type = float(norm_type)
    tensors = [t for t in tensors if t is not None]
    if deterministic and norm_type not in (0.0, math.inf, -math.inf):
        total = _rowwise_norm(tensors, norm_type)
        return _checked(total, norm_type, error_if_nonfinite)
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
    return _checked(total, norm_type, error_if_nonfinite)


def _checked(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; set "
            "error_if_nonfinite=False to clip anyway."
        )
    return total


def _row_sums(t: torch.Tensor, p: float) -> torch.Tensor:
    """``sum(|x|**p)`` of every dim-0 slice of ``t`` (one row for a 0-d tensor), in fp32 at
    least. Each row is reduced on its own by one kernel, the same wherever it lives."""
    rows = t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1)
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    if p == 2.0:
        return rows.square().sum(1)
    return rows.abs().sum(1) if p == 1.0 else rows.abs().pow(p).sum(1)


def _pairwise_total(values: torch.Tensor) -> torch.Tensor:
    """``tree_sum_into``'s tree over a 1-D tensor, a level at a time (neighbours added)."""
    while values.numel() > 1:
        even = values.numel() // 2 * 2
        values = torch.cat([values[0:even:2] + values[1:even:2], values[even:]])
    return values.sum() if values.numel() else values.new_zeros(())


def _rowwise_norm(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    for t in tensors:
        if isinstance(t, DTensor) and not all(
            pl.is_replicate() or (is_shard_like(pl) and pl.dim == 0) for pl in t.placements
        ):
            raise ValueError(
                "get_total_norm(deterministic=True): row sums need every tensor sharded "
                f"along dim 0 or replicated, got placements {tuple(t.placements)}; use "
                "deterministic=False for this layout."
            )
    pieces = []
    for t in tensors:
        if not isinstance(t, DTensor):
            pieces.append(_row_sums(t, p))
            continue
        sums = _row_sums(t.to_local(), p)
        placements = [Shard(0) if is_shard_like(pl) else Replicate() for pl in t.placements]
        rows = (t.shape[0] if t.dim() else 1,)
        full = DTensor.from_local(sums, t.device_mesh, placements, shape=rows, stride=(1,))
        pieces.append(full.full_tensor())
    if not pieces:
        return torch.tensor(0.0)
    return _pairwise_total(torch.cat(pieces)).pow(1.0 / p)


def clip_grad_norm_(
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Clip gradients in place so their global norm is at most ``max_norm``; return the norm.

    Same contract as ``torch.nn.utils.clip_grad_norm_``, for DTensor parameters on any mix
    of meshes (the stock function requires one mesh). ``deterministic=True``: the norm's
    bits do not depend on the shard boundaries (``get_total_norm``), so clipping keeps
    ``fsdp2``'s ``set_deterministic_reduction`` runs equal across world sizes.

    Example:
        >>> total = dtensor.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, deterministic=deterministic)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
