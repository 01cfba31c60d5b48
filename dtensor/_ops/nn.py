"""Neural-network ops: embedding, layer / batch / group norm, softmax.

- embedding: a replicated table follows the indices' sharding; a table sharded on the
  embedding dim gives an output sharded on its last dim; a table sharded on the vocabulary
  (``Shard(0)``) looks up only its own rows and returns ``Partial("sum")``.
- layer norm / softmax (``_safe_softmax`` too): shards on dims that are not normalized pass
  through; the others are gathered. Layer-norm weight and bias gradients are partial sums
  over sharded rows.
- batch norm: statistics are per channel (dim 1), over the batch and spatial dims. A shard of
  the channels is therefore a complete, independent batch norm of those channels (input
  ``Shard(1)``, every per-channel tensor ``Shard(0)``: the same ``torch.chunk`` blocks of the
  same size). In evaluation mode the op is an affine map per channel with fixed statistics,
  so any other dim of the input may stay sharded (per-channel tensors replicated); the
  backward's weight and bias gradients are then partial sums. Training over a sharded batch
  or spatial dim gathers the input (the statistics need every element). Running statistics
  written in training are never redistributed (the write would land in a temporary copy):
  ``Shard(0)`` running stats force the channel layout on that mesh dim, replicated ones the
  replicated layout, anything else is refused.
- group norm: statistics are per sample and group, so the batch dim may stay sharded (the
  op's ``N`` argument becomes the local batch size); weight and bias gradients are then
  partial sums. Any other sharded dim is gathered.
- The backwards of batch and group norm are linear in the incoming gradient: a
  ``Partial("sum")`` gradient with replicated activations gives partial gradients.
"""

from __future__ import annotations

import torch

from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    register,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, Shard, chunk_offsets, chunk_sizes, is_shard_like

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding_rule(schema: OpSchema) -> OutputSharding:
    weight, idx = schema.args[0], schema.args[1]
    out_nd = idx.ndim + 1
    outs, need_w, need_i = [], [], []
    vocab_dim = None
    for i, (pw, pi) in enumerate(zip(weight.placements, idx.placements)):
        # a plain Shard only: a _StridedShard's rows or columns are not one contiguous block
        if type(pw) is Shard and pw.dim == 1:
            outs.append(Shard(out_nd - 1))
            need_w.append(pw)
            need_i.append(Replicate())
        elif type(pw) is Shard and pw.dim == 0 and vocab_dim is None:
            vocab_dim = i
            outs.append(Partial())
            need_w.append(pw)
            need_i.append(Replicate())
        else:
            pi = pi if is_shard_like(pi) else Replicate()
            outs.append(pi)
            need_w.append(Replicate())
            need_i.append(pi)
    local_fn = None
    if vocab_dim is not None:
        mesh = weight.mesh
        k, r = mesh.size(vocab_dim), mesh.get_local_rank(vocab_dim)
        start = chunk_offsets(weight.shape[0], k)[r]
        rows = chunk_sizes(weight.shape[0], k)[r]

        def local_fn(w, indices, *args, **kwargs):
            mine = (indices >= start) & (indices < start + rows)
            local_idx = torch.where(mine, indices - start, torch.zeros_like(indices))
            out = (
                aten.embedding.default(w, local_idx, *args, **kwargs)
                if rows
                else w.new_zeros((*indices.shape, w.shape[1]))
            )
            return out * mine.unsqueeze(-1).to(out.dtype)

    return OutputSharding(
        [tuple(outs)],
        {schema.leaf_index(weight): tuple(need_w), schema.leaf_index(idx): tuple(need_i)},
        local_fn,
    )


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(schema: OpSchema) -> OutputSharding:
    grad, idx = schema.args[0], schema.args[1]
    outs, need_g, need_i = [], [], []
    for pg, pi in zip(grad.placements, idx.placements):
        if is_shard_like(pg) and pg.dim == grad.ndim - 1 and not is_shard_like(pi):
            outs.append(Shard(1))
            need_g.append(pg)
            need_i.append(Replicate())
        elif is_shard_like(pg) and pg.dim < grad.ndim - 1 and pi == pg:
            outs.append(Partial())  # every rank scatters its own rows into the full table
            need_g.append(pg)
            need_i.append(pi)
        elif isinstance(pg, Partial) and pg.is_linear and not is_shard_like(pi):
            outs.append(pg)
            need_g.append(pg)
            need_i.append(Replicate())
        else:
            outs.append(Replicate())
            need_g.append(Replicate())
            need_i.append(Replicate())
    return OutputSharding(
        [tuple(outs)],
        {schema.leaf_index(grad): tuple(need_g), schema.leaf_index(idx): tuple(need_i)},
    )


def _leading_ok(p, n_lead: int) -> bool:
    return is_shard_like(p) and p.dim < n_lead


@register(aten.native_layer_norm.default)
def layer_norm_rule(schema: OpSchema) -> OutputSharding:
    x, norm_shape = schema.args[0], schema.args[1]
    n_lead = x.ndim - len(norm_shape)
    p_in = tuple(p if _leading_ok(p, n_lead) else Replicate() for p in x.placements)
    inputs = {schema.leaf_index(x): p_in}
    for w in schema.args[2:4]:
        if w is not None and hasattr(w, "placements"):
            inputs[schema.leaf_index(w)] = (Replicate(),) * len(p_in)
    return OutputSharding([p_in, p_in, p_in], inputs)


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(schema: OpSchema) -> OutputSharding:
    grad, x, norm_shape, mean, rstd, weight, bias = schema.args[:7]
    n_lead = x.ndim - len(norm_shape)
    p_in = tuple(p if _leading_ok(p, n_lead) else Replicate() for p in x.placements)
    p_param = tuple(Partial() if _leading_ok(p, n_lead) else Replicate() for p in p_in)
    inputs = {schema.leaf_index(s): p_in for s in (grad, x, mean, rstd)}
    for w in (weight, bias):
        if w is not None and hasattr(w, "placements"):
            inputs[schema.leaf_index(w)] = (Replicate(),) * len(p_in)
    outs = [p_in, p_param, p_param]
    return OutputSharding(
        [o if m is not None else None for o, m in zip(outs, schema.out_meta)], inputs
    )


@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_rule(schema: OpSchema) -> OutputSharding:
    x, dim = schema.args[0], schema.args[1] % max(schema.args[0].ndim, 1)
    p = tuple(
        Replicate() if (is_shard_like(q) and q.dim == dim) or isinstance(q, Partial) else q
        for q in x.placements
    )
    return OutputSharding([p], {schema.leaf_index(x): p})


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(schema: OpSchema) -> OutputSharding:
    grad, out, dim = schema.args[0], schema.args[1], schema.args[2] % max(schema.args[1].ndim, 1)
    p = tuple(
        Replicate() if (is_shard_like(q) and q.dim == dim) or isinstance(q, Partial) else q
        for q in out.placements
    )
    return OutputSharding([p], {schema.leaf_index(grad): p, schema.leaf_index(out): p})


# --------------------------------------------------------------------------- batch norm


def _arg(schema: OpSchema, i: int, name: str, default=None):
    """Argument ``name`` at position ``i``, passed by position or by keyword."""
    return schema.args[i] if i < len(schema.args) else schema.kwargs.get(name, default)


def _specs(schema: OpSchema) -> list[DTensorSpec]:
    return [schema.leaves[i] for i in schema.spec_indices()]


def _assemble(schema: OpSchema, chosen: list[Option]) -> OutputSharding:
    """The ``OutputSharding`` of one already chosen option per mesh dim."""
    outs = [
        tuple(opt.outputs[k] for opt in chosen) if m is not None else None
        for k, m in enumerate(schema.out_meta)
    ]
    ins = {i: tuple(opt.inputs[j] for opt in chosen) for j, i in enumerate(schema.spec_indices())}
    return OutputSharding(outs, ins)


def _empty_like_meta(meta, shape, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(shape, dtype=meta.dtype, device=like.device)


# op -> (position of running_mean or None, training: the flag's position, a constant, or None
# for "training exactly when there are no running statistics")
_BN_FORWARD = {
    aten.native_batch_norm.default: (3, 5),
    aten._native_batch_norm_legit.default: (3, 5),
    aten._native_batch_norm_legit.no_stats: (None, 3),
    aten._native_batch_norm_legit_no_training.default: (3, False),
    aten._batch_norm_with_update.default: (3, True),
    aten._batch_norm_no_update.default: (3, None),
}


def _bn_training(schema: OpSchema, running_mean) -> bool:
    flag = _BN_FORWARD[schema.func][1]
    if flag is None:
        return running_mean is None
    if isinstance(flag, bool):
        return flag
    return bool(_arg(schema, flag, "training"))


@register(*_BN_FORWARD)
def batch_norm_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    stats_at = _BN_FORWARD[schema.func][0]
    rm = rv = None
    if stats_at is not None:
        rm = _arg(schema, stats_at, "running_mean")
        rv = _arg(schema, stats_at + 1, "running_var")
    training = _bn_training(schema, rm)
    if not training:
        # The CPU and CUDA kernels return empty saved statistics in evaluation mode; the
        # meta kernel says (C,). The global metadata must be what the op really returns.
        for k in (1, 2):
            m = schema.out_meta[k]
            if m is not None and m.numel():
                schema.out_meta[k] = torch.empty((0,), dtype=m.dtype, device="meta")
    n_params = len(_specs(schema)) - 1
    n_out = len(schema.out_meta)
    saved = Shard(0) if training else Replicate()
    channel = Option(
        (Shard(1), saved, saved, *[Replicate()] * (n_out - 3)),
        (Shard(1), *[Shard(0)] * n_params),
    )
    replicated = Option((Replicate(),) * n_out, (Replicate(),) * (n_params + 1))
    local_fn = _bn_forward_local(schema, training)
    if training and isinstance(rm, DTensorSpec):
        # The running statistics are written in place: each mesh dim must run the layout
        # their placement already has.
        chosen = []
        for i in range(x.mesh.ndim):
            p = rm.placements[i]
            q = rv.placements[i] if isinstance(rv, DTensorSpec) else p
            if p != q or not (p == Shard(0) or isinstance(p, Replicate)):
                raise NotImplementedError(
                    f"{schema.func}: the running statistics are updated in place, which "
                    f"needs them Shard(0) or Replicate() on every mesh dim, alike; they are "
                    f"{rm.placements} and {rv.placements}. Redistribute them first."
                )
            chosen.append(channel if p == Shard(0) else replicated)
        out = _assemble(schema, chosen)
    else:
        options = [channel]
        if not training:  # an affine map per channel: any other dim stays sharded
            options += [
                Option(
                    (Shard(d), *[Replicate()] * (n_out - 1)),
                    (Shard(d), *[Replicate()] * n_params),
                )
                for d in range(x.ndim)
                if d != 1
            ]
        out = expand_per_mesh_dim(schema, options)
    out.local_fn = local_fn
    return out


def _bn_forward_local(schema: OpSchema, training: bool):
    """The op, except on an empty block (the CPU kernels refuse or crash on those)."""
    func, metas = schema.func, list(schema.out_meta)

    def local(x, *args, **kwargs):
        if x.numel():
            return func(x, *args, **kwargs)
        c = x.shape[1] if training else 0
        outs = [x.clone(), _empty_like_meta(metas[1], (c,), x), _empty_like_meta(metas[2], (c,), x)]
        outs += [_empty_like_meta(m, (0,), x) for m in metas[3:]]
        return tuple(outs)

    return local


@register(aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)
def batch_norm_backward_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[1]
    training = bool(_arg(schema, 7, "train" if schema.name.startswith("native") else "update"))
    c = x.shape[1]
    rest = _specs(schema)[2:]  # weight, running stats, saved stats, reserve (if tensors)

    def per_channel(p):
        return tuple(p if s.ndim == 1 and s.shape[0] == c else Replicate() for s in rest)

    options = [Option((Shard(1), Shard(0), Shard(0)), (Shard(1), Shard(1), *per_channel(Shard(0))))]
    if not training:
        options += [
            Option(
                (Shard(d), Partial(), Partial()), (Shard(d), Shard(d), *per_channel(Replicate()))
            )
            for d in range(x.ndim)
            if d != 1
        ]
    # linear in the incoming gradient (the batch statistics' terms included)
    options.append(Option((Partial(),) * 3, (Partial(), Replicate(), *per_channel(Replicate()))))
    out = expand_per_mesh_dim(schema, options)
    metas = list(schema.out_meta)

    def local_fn(g, inp, *args, **kwargs):
        if inp.numel():
            return schema.func(g, inp, *args, **kwargs)
        # an empty block (the CPU kernel divides by its size): no gradient to give
        ch = (inp.shape[1],)
        return tuple(
            None if m is None else (inp.clone() if k == 0 else _empty_like_meta(m, ch, inp))
            for k, m in enumerate(metas)
        )

    out.local_fn = local_fn
    return out


# --------------------------------------------------------------------------- group norm


@register(aten.native_group_norm.default)
def group_norm_rule(schema: OpSchema) -> OutputSharding:
    n_params = len(_specs(schema)) - 1
    batch = Option((Shard(0),) * 3, (Shard(0), *[Replicate()] * n_params))
    out = expand_per_mesh_dim(schema, [batch])
    out.local_fn = _with_local_batch(schema.func, 0, 3)
    return out


def _with_local_batch(func, x_at: int, n_at: int):
    """``func`` with its ``N`` argument (at ``n_at``) set to the local batch size of the
    tensor at ``x_at``: the kernel reads the sizes from ``N``, ``C`` and ``HxW``."""

    def local(*args, **kwargs):
        x = args[x_at]
        if n_at < len(args):
            args = (*args[:n_at], x.shape[0], *args[n_at + 1 :])
        else:
            kwargs = {**kwargs, "N": x.shape[0]}
        return func(*args, **kwargs)

    return local


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(schema: OpSchema) -> OutputSharding:
    n_params = len(_specs(schema)) - 4  # the weight, if a tensor
    batch = Option((Shard(0), Partial(), Partial()), (Shard(0),) * 4 + (Replicate(),) * n_params)
    linear = Option((Partial(),) * 3, (Partial(),) + (Replicate(),) * (3 + n_params))
    out = expand_per_mesh_dim(schema, [batch, linear])
    out.local_fn = _with_local_batch(schema.func, 1, 5)
    return out
