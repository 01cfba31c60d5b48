"""Losses: negative log-likelihood, binary cross-entropy, and the norm of differences that
``pairwise_distance`` and the triplet losses compute.

- ``nll_loss`` (and ``nll_loss2d``): each sample's loss reads its own row of the input and its
  own target, so any dim but the class dim may stay sharded, the target sharded alike and
  the class weights replicated. ``reduction="none"`` keeps the shard; ``"sum"`` gives
  ``Partial("sum")`` losses and total weights. ``"mean"`` divides by the total weight of the
  whole batch, which depends on the targets of every rank: each rank sums its own losses,
  the ranks all-reduce the (one-number) total weight, and each divides by it, so the loss is
  ``Partial("sum")`` of exact shares and the total weight is replicated - right for uneven
  shards, ignored targets and class weights alike (an average of per-rank means is not).
  The class dim is gathered (``log_softmax`` gathers it anyway; ``loss_parallel`` is the
  way to keep it sharded). The backward is local for a sharded batch: the mean's divisor
  is the replicated total weight, and the sum ignores it. ``loss_parallel``'s backward
  handler (``dtensor/parallel/loss.py``) takes only the calls its own forward makes
  (class-sharded log-probabilities, replicated target, no class weights) and leaves every
  other one to this rule.
- binary cross-entropy (with logits too): elementwise, so any dim may stay sharded with the
  weights broadcast alike; a sum is ``Partial("sum")``, a mean is each rank's sum divided by
  the global element count (never the local one).
- every backward here is linear in the incoming gradient: a ``Partial("sum")`` gradient with
  replicated inputs gives a partial gradient.
- ``norm(x, p, dim)``: a p-norm over a sharded dim is ``NormPartial(p)`` (the p-norm of the
  per-rank norms is the norm), as ``linalg_vector_norm``; shards on other dims pass through.
"""

from __future__ import annotations

import math

import torch

from dtensor import _collectives as C
from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    map_to,
    register,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import NormPartial, Partial, Replicate, Shard, is_shard_like

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _arg(schema: OpSchema, i: int, name: str, default=None):
    """Argument ``name`` at position ``i``, passed by position or by keyword."""
    return schema.args[i] if i < len(schema.args) else schema.kwargs.get(name, default)


def _specs(schema: OpSchema) -> list[DTensorSpec]:
    return [schema.leaves[i] for i in schema.spec_indices()]


def _inputs(schema: OpSchema, chosen: list) -> tuple:
    """One placement per DTensor input, in argument order: the one paired with it in
    ``chosen`` (``(spec or None, placement)`` pairs, matched by identity), else
    ``Replicate()``."""
    return tuple(next((p for s, p in chosen if s is spec), Replicate()) for spec in _specs(schema))


# --------------------------------------------------------------------------- nll_loss


def _target_dim(d: int, class_dim: int) -> int:
    return d if d < class_dim else d - 1


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward_rule(schema: OpSchema) -> OutputSharding:
    x, target = schema.args[0], schema.args[1]
    reduction = _arg(schema, 3, "reduction", _MEAN)
    cdim = 1 if x.ndim >= 2 else 0
    options = []
    for d in range(x.ndim):
        if d == cdim:
            continue
        td = _target_dim(d, cdim)
        ins = _inputs(schema, [(x, Shard(d)), (target, Shard(td))])
        if reduction == _NONE:
            outs = (Shard(td), Replicate())  # the total weight is 0 on every rank
        elif reduction == _SUM:
            outs = (Partial(), Partial())
        else:
            outs = (Partial(), Replicate())  # local_fn below: global total weight
        options.append(Option(outs, ins))
    # linear in the input; the total weight comes from the replicated targets
    options.append(Option((Partial(), Replicate()), _inputs(schema, [(x, Partial())])))
    out = expand_per_mesh_dim(schema, options)
    if reduction == _MEAN:
        need_x = out.input_placements[schema.leaf_index(x)]
        dims = [i for i, p in enumerate(need_x) if is_shard_like(p)]
        if dims:
            out.local_fn = _nll_mean_local(schema.func, x.mesh, dims)
    return out


def _nll_mean_local(func, mesh, mesh_dims: list[int]):
    """Mean over a batch sharded on ``mesh_dims``: this rank's summed loss divided by the
    total weight of every rank's targets (all-reduced), which is also returned."""
    summed = _with_reduction(func, _SUM, 3)

    def local(*args, **kwargs):
        total_loss, total_weight = summed(*args, **kwargs)
        for md in mesh_dims:
            total_weight = C.all_reduce(total_weight, mesh, md, Partial("sum")).wait()
        return total_loss / total_weight, total_weight

    return local


def _with_reduction(func, reduction: int, at: int):
    """``func`` with its ``reduction`` argument (at position ``at``) replaced."""

    def local(*args, **kwargs):
        if at < len(args):
            args = (*args[:at], reduction, *args[at + 1 :])
        else:
            kwargs = {**kwargs, "reduction": reduction}
        return func(*args, **kwargs)

    return local


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward_rule(schema: OpSchema) -> OutputSharding:
    grad, x, target = schema.args[0], schema.args[1], schema.args[2]
    reduction = _arg(schema, 4, "reduction", _MEAN)
    total_weight = _arg(schema, 6, "total_weight")
    cdim = 1 if x.ndim >= 2 else 0
    # The sum and "none" kernels never read the total weight: whatever it holds will do.
    tw_choices = [Replicate()] if reduction == _MEAN else [Replicate(), Partial()]
    options = []
    for d in range(x.ndim):
        if d == cdim:
            continue
        td = _target_dim(d, cdim)
        g = Shard(td) if reduction == _NONE else Replicate()
        for tw in tw_choices:
            chosen = [(grad, g), (x, Shard(d)), (target, Shard(td)), (total_weight, tw)]
            options.append(Option((Shard(d),), _inputs(schema, chosen)))
    for tw in tw_choices:
        chosen = [(grad, Partial()), (total_weight, tw)]
        options.append(Option((Partial(),), _inputs(schema, chosen)))
    return expand_per_mesh_dim(schema, options)


# --------------------------------------------------------------------------- binary cross-entropy


def _elementwise_loss_options(schema: OpSchema, x, broadcast: list, grad, reduction) -> list:
    """Options of an elementwise loss of ``x`` (``broadcast``: tensors broadcast to its
    shape) reduced by ``reduction``; ``grad`` for a backward (same shape as ``x`` for
    "none", a number otherwise), None for a forward."""
    out_shape = tuple(x.shape)
    options = []
    for d in range(x.ndim):
        p = Shard(d)
        chosen = [(x, p)]
        chosen += [
            (t, map_to(p, x.ndim, tuple(t.shape), out_shape))
            for t in broadcast
            if isinstance(t, DTensorSpec)
        ]
        if grad is not None:
            chosen.append((grad, p if reduction == _NONE else Replicate()))
            outs = (p,)
        else:
            outs = (p if reduction == _NONE else Partial(),)
        options.append(Option(outs, _inputs(schema, chosen)))
    if grad is not None:  # linear in the incoming gradient
        options.append(Option((Partial(),), _inputs(schema, [(grad, Partial())])))
    return options


def _divide_sum_by(func, n: int, reduction_at: int):
    """The op with a sum in place of the mean, divided by the global element count ``n``."""
    summed = _with_reduction(func, _SUM, reduction_at)

    def local(*args, **kwargs):
        return summed(*args, **kwargs) / n

    return local


def _bce_rule(schema: OpSchema, x, broadcast, grad, reduction_at: int) -> OutputSharding:
    reduction = _arg(schema, reduction_at, "reduction", _MEAN)
    options = _elementwise_loss_options(schema, x, broadcast, grad, reduction)
    out = expand_per_mesh_dim(schema, options)
    need_x = out.input_placements[schema.leaf_index(x)]
    if reduction == _MEAN and any(is_shard_like(p) for p in need_x):
        out.local_fn = _divide_sum_by(schema.func, math.prod(x.shape), reduction_at)
    return out


@register(aten.binary_cross_entropy.default)
def binary_cross_entropy_rule(schema: OpSchema) -> OutputSharding:
    x, target = schema.args[0], schema.args[1]
    return _bce_rule(schema, x, [target, _arg(schema, 2, "weight")], None, 3)


@register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward_rule(schema: OpSchema) -> OutputSharding:
    grad, x, target = schema.args[0], schema.args[1], schema.args[2]
    return _bce_rule(schema, x, [target, _arg(schema, 3, "weight")], grad, 4)


@register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits_rule(schema: OpSchema) -> OutputSharding:
    x, target = schema.args[0], schema.args[1]
    weights = [_arg(schema, 2, "weight"), _arg(schema, 3, "pos_weight")]
    return _bce_rule(schema, x, [target, *weights], None, 4)


# --------------------------------------------------------------------------- norm


@register(aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype)
def norm_dim_rule(schema: OpSchema) -> OutputSharding:
    """``norm(x, p, dim, keepdim)``, what ``pairwise_distance`` reduces with."""
    x = schema.args[0]
    p = _arg(schema, 1, "p")
    p = 2.0 if p is None else float(p)
    dims = _arg(schema, 2, "dim")
    keepdim = bool(_arg(schema, 3, "keepdim", False))
    dims = [dims] if isinstance(dims, int) else list(dims)
    reduced = {d % max(x.ndim, 1) for d in dims} if dims else set(range(x.ndim))
    outs, need = [], []
    for q in x.placements:
        if is_shard_like(q) and q.dim in reduced:
            outs.append(NormPartial(p))
            need.append(q)
        elif is_shard_like(q) and q.dim not in reduced:
            shift = 0 if keepdim else sum(1 for d in reduced if d < q.dim)
            outs.append(Shard(q.dim - shift))
            need.append(q)
        else:
            outs.append(Replicate())
            need.append(Replicate())
    func = schema.func
    meta = schema.out_meta[0]
    # the norm of nothing: (sum of no |x|^p)^(1/p), 0 for p >= 0, inf for p < 0 (the
    # identity of the combination of per-rank norms either way)
    identity = 0.0 if p >= 0 else math.inf

    def local_fn(t, *args, **kwargs):
        if t.numel() == 0:  # the kernels refuse an empty block for some p
            shape = [1 if d in reduced else s for d, s in enumerate(t.shape)]
            if not keepdim:
                shape = [s for d, s in enumerate(shape) if d not in reduced]
            return torch.full(shape, identity, dtype=meta.dtype, device=t.device)
        return func(t, *args, **kwargs)

    return OutputSharding([tuple(outs)], {schema.leaf_index(x): tuple(need)}, local_fn)
