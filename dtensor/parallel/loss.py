"""``loss_parallel``: cross-entropy on logits sharded over the class (vocabulary) dim.

Inside the context, ``F.cross_entropy(logits, target)`` with ``logits`` a DTensor sharded on
its class dim (``Shard(1)`` of ``(N, C)``) never gathers the vocabulary:

* ``log_softmax``: each rank's row maximum and sum of exponentials are combined with two
  all-reduces of ``N`` numbers (max, then sum), so every rank gets the log-softmax of its
  own columns;
* ``nll_loss``: each rank picks the targets that fall in its columns (zero elsewhere) and one
  all-reduce of ``N`` numbers sums the picks;
* backward: the log-softmax backward needs the per-row sum of the incoming gradient (one
  all-reduce of ``N`` numbers); the nll backward is local.

The loss comes out as a replicated DTensor. Only ``reduction`` "mean"/"sum"/"none",
``ignore_index`` and no class weights are supported; anything else raises.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from dtensor import _collectives as C
from dtensor._dispatch import custom, dispatch_by_rule
from dtensor._spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.placement import Partial, Replicate, Shard, chunk_offsets
from dtensor.tensor import DTensor

aten = torch.ops.aten
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


# [Note: loss_parallel is per context]
# The forward handlers below are registered once, at import, and act only while this context
# variable is set: entering loss_parallel in one thread changes nothing for another thread
# (a new thread starts with the default, False), and a nested or failed block restores the
# value it found. The backward handlers act whenever they are handed a class-sharded
# log-softmax output: only loss_parallel's forward makes one (the ordinary softmax rule
# replicates the softmax dim; the nll_loss rule gathers the class dim, and the nll backward
# handler leaves to it every call loss_parallel's forward would not make), so they need no
# flag, and the backward is right on whichever thread autograd runs it (a CUDA device thread
# does not see the caller's context variables).
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("loss_parallel", default=False)


@contextlib.contextmanager
def loss_parallel():
    """Compute cross-entropy on class-sharded logits without gathering them.

    Use it around both the loss and its backward. It affects only the thread (or asyncio
    task) that entered it; nesting is allowed.

    Example:
        >>> logits = model(idx)          # DTensor (B*T, vocab) sharded Shard(1) over mesh["tp"]
        >>> with loss_parallel():
        ...     loss = F.cross_entropy(logits, targets)
        ...     loss.backward()
    """
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _class_sharded(x, dim: int) -> bool:
    if not isinstance(x, DTensor) or x.device_mesh.ndim != 1:
        return False
    dim = dim % x.ndim
    return x.placements == (Shard(dim),) and x.ndim == 2 and dim == 1


def _wrap(local: torch.Tensor, like: DTensor, placements, shape=None) -> DTensor:
    shape = torch.Size(local.shape if shape is None else shape)
    meta = TensorMeta(shape, contiguous_stride(shape), local.dtype)
    return DTensor(
        local, DTensorSpec(like.device_mesh, tuple(placements), meta), requires_grad=False
    )


def _all_reduce(t: torch.Tensor, mesh, op: str) -> torch.Tensor:
    return C.all_reduce(t, mesh, 0, Partial(op)).wait()


def _column_offset(x: DTensor) -> int:
    mesh = x.device_mesh
    return chunk_offsets(x.shape[1], mesh.size())[mesh.get_local_rank()]


@custom(aten._log_softmax.default)
def _log_softmax(func, args, kwargs):
    x, dim, half_to_float = args
    if not (_ACTIVE.get() and _class_sharded(x, dim)):
        return dispatch_by_rule(func, args, kwargs)
    local, mesh = x._local(), x.device_mesh
    if half_to_float:
        local = local.float()
    row_max = _all_reduce(local.amax(1, keepdim=True), mesh, "max")
    shifted = local - row_max
    sum_exp = _all_reduce(shifted.exp().sum(1, keepdim=True), mesh, "sum")
    return _wrap(shifted - sum_exp.log(), x, x.placements, x.shape)


@custom(aten._log_softmax_backward_data.default)
def _log_softmax_backward(func, args, kwargs):
    grad, output, dim, dtype = args
    if not (_class_sharded(output, dim) and isinstance(grad, DTensor)):
        return dispatch_by_rule(func, args, kwargs)
    g, out = grad._local(), output._local()
    row_sum = _all_reduce(g.sum(1, keepdim=True), output.device_mesh, "sum")
    return _wrap((g - out.exp() * row_sum).to(dtype), output, output.placements, output.shape)


def _targets(target, logp: DTensor, ignore_index: int):
    """This rank's column of every target, and which targets are not in its columns."""
    t = target._local() if isinstance(target, DTensor) else target
    lo = _column_offset(logp)
    width = logp._local().shape[1]
    outside = (t < lo) | (t >= lo + width) | (t == ignore_index)
    return (t - lo).masked_fill(outside, 0), outside, t != ignore_index


def _replicated(x) -> bool:
    """A plain tensor or number, or a DTensor replicated on every mesh dim."""
    return not isinstance(x, DTensor) or all(p.is_replicate() for p in x.placements)


def _check_supported(weight, reduction: int) -> None:
    if weight is not None:
        raise NotImplementedError("loss_parallel: class weights are not supported.")
    if reduction not in _REDUCTIONS:
        raise NotImplementedError(f"loss_parallel: unknown reduction {reduction}.")


@custom(aten.nll_loss_forward.default)
def _nll_forward(func, args, kwargs):
    logp, target, weight, reduction, ignore_index = args
    if not (_ACTIVE.get() and _class_sharded(logp, 1)):
        return dispatch_by_rule(func, args, kwargs)
    _check_supported(weight, reduction)
    local = logp._local()
    cols, outside, counted = _targets(target, logp, ignore_index)
    picked = local.gather(1, cols.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
    picked = _all_reduce(picked, logp.device_mesh, "sum")
    losses = -picked
    total = counted.sum().to(local.dtype)
    if reduction == 1:
        loss = losses.sum() / total
    elif reduction == 2:
        loss = losses.sum()
    else:
        loss = losses
    rep = (Replicate(),)
    return _wrap(loss, logp, rep), _wrap(total, logp, rep)


@custom(aten.nll_loss_backward.default)
def _nll_backward(func, args, kwargs):
    grad_out, logp, target, weight, reduction, ignore_index, total_weight = args
    # Only loss_parallel's forward takes class-sharded log-probabilities with replicated
    # targets and no class weights; the nll_loss rule (dtensor/_ops/losses.py) takes them
    # too, gathering the class dim, and its backward is the rule's.
    if not (
        _class_sharded(logp, 1)
        and weight is None
        and reduction in _REDUCTIONS
        and _replicated(target)
        and _replicated(grad_out)
    ):
        return dispatch_by_rule(func, args, kwargs)
    local = logp._local()
    g = grad_out._local() if isinstance(grad_out, DTensor) else grad_out
    cols, outside, _ = _targets(target, logp, ignore_index)
    if reduction == 1:
        tw = total_weight._local() if isinstance(total_weight, DTensor) else total_weight
        g = g / tw
    per_row = (-g).expand(local.shape[0]) if g.ndim == 0 else -g
    per_row = per_row.masked_fill(outside, 0.0).to(local.dtype)
    grad = torch.zeros_like(local)
    grad.scatter_(1, cols.unsqueeze(1), per_row.unsqueeze(1))
    return _wrap(grad, logp, logp.placements, logp.shape)
