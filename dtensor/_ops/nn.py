"""Neural-network ops for sequence and tensor parallelism: embedding, layer norm, softmax.

- embedding: a replicated table follows the indices' sharding; a table sharded on the
  embedding dim gives an output sharded on its last dim; a table sharded on the vocabulary
  (``Shard(0)``) looks up only its own rows and returns ``Partial("sum")``.
- layer norm / softmax: shards on dims that are not normalized pass through; the others are
  gathered. Layer-norm weight and bias gradients are partial sums over sharded rows.
"""

from __future__ import annotations

import torch

from dtensor._ops._common import OpSchema, OutputSharding, register
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


@register(aten._softmax.default, aten._log_softmax.default)
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
