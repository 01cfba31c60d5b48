"""Pooling, resampling, grid sampling and convolution layers (and their backward ops).

Every op here works on tensors laid out as ``(*leading, *spatial)``: ``(N, C, H, W)`` for a
2-d op, or ``(C, H, W)`` when a pooling op takes an unbatched input. What may stay sharded:

- Pooling (max, avg, adaptive, fractional), max-unpooling and interpolation (``upsample_*``)
  treat each ``(n, c)`` plane on its own: an output plane is computed from the same input
  plane only, and the indices max-pooling returns (or unpooling takes) count positions
  inside one plane. So a ``Shard`` of any leading dim passes through unchanged, on every
  input and output alike. A sharded spatial dim is gathered: a window, an interpolation
  stencil or an adaptive bin may straddle the block boundary, and we do no halo exchange.
- The ops linear in their first tensor (average pooling, interpolation, unpooling, every
  backward op in its incoming gradient, grid sampling in its input) also map a
  ``Partial("sum"/"avg")`` of that tensor to the same ``Partial`` of the output, with the
  other tensors (the forward input a backward op reads only for its shape, the indices,
  the grid) replicated.
- ``grid_sampler_{2,3}d(input, grid)``: batch sharded on both; channels of the input (the
  grid has none) with the grid replicated; or an output location dim through the grid's
  matching dim with the input replicated, since each output point reads only its own grid
  point. Their backward turns the dims summed over into ``Partial("sum")``: channels into
  the grid's gradient, output locations into the input's.
- ``convolution`` (and its transposed form): batch sharded on input and output with the
  weight replicated (the weight and bias gradients are then partial sums over the batch);
  with ``groups == 1``, output channels sharded through the weight's output-channel dim (and
  the bias), or input channels through the weight's input-channel dim with a partial-sum
  output when there is no bias (a bias would be added once per rank). Spatial dims are
  always gathered: a kernel straddles block boundaries, the case PyTorch's DTensor gets
  silently wrong.

Uneven splits leave some ranks an empty block (four channels over three ranks: 2, 2, 0), and
most of these kernels refuse an empty non-batch dim. Such a rank pads each empty dim of its
inputs to one zero entry, runs the kernel and cuts every output back to its local shape:
the zeros add nothing to an output that sums over the dim (a partial-sum gradient), an
output indexed by the dim loses the padded entry again, and an output that never reads the
dim (the replicated bias gradient of a channel-split convolution) comes out as usual.
"""

from __future__ import annotations

import re

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    register,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, Shard, local_shape_and_offset

aten = torch.ops.aten


def _ops(*names: str) -> list:
    """The functional overloads (``default``, and ``vec`` where there is one) of the aten ops
    ``names`` that this torch build has. Never the ``out=`` overloads: a write into a sharded
    ``out`` is left to dispatch's gather-compute-write-back path."""
    out = []
    for n in names:
        packet = getattr(aten, n, None)
        if packet is None:
            continue
        out += [getattr(packet, o) for o in ("default", "vec") if o in packet.overloads()]
    return out


def _spatial_rank(schema: OpSchema) -> int:
    """How many trailing spatial dims the op works over, read off its name (``..._2d...``)."""
    m = re.search(r"([123])d(?:_|$)", schema.name)
    if m is None:  # every op registered here names its rank
        raise AssertionError(f"{schema.func}: no spatial rank in its name")
    return int(m.group(1))


def _specs(schema: OpSchema) -> list[DTensorSpec]:
    return [schema.leaves[i] for i in schema.spec_indices()]


def _outs(schema: OpSchema, placement) -> tuple:
    """``placement`` for every tensor output, ``None`` for the others."""
    return tuple(placement if m is not None else None for m in schema.out_meta)


def _linear_partials(spec: DTensorSpec) -> list[Partial]:
    """The ``Partial`` placements of ``spec`` a linear op may pass through."""
    out = []
    for p in spec.placements:
        if type(p) is Partial and p.is_linear and p not in out:
            out.append(p)
    return out


# --------------------------------------------------------------------------- registration


def _register_layer(*ops):
    """Like ``register_per_mesh_dim``, plus the empty-block guard described in the module
    docstring and the local sizes of the interpolation backward ops."""

    def deco(fn):
        def rule(schema: OpSchema) -> OutputSharding:
            sharding = expand_per_mesh_dim(schema, list(fn(schema)))
            run = _local_sizes_fn(schema)
            sharding.local_fn = _empty_block_fn(schema, sharding, run or schema.func) or run
            return sharding

        rule.options = fn
        register(*ops)(rule)
        return fn

    return deco


def _empty_block_fn(schema: OpSchema, sharding: OutputSharding, run):
    """``run`` made safe for this rank's empty blocks (see the module docstring), or None
    when this rank has none under the rule's input placements."""
    mesh = schema.mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    pads = {}  # leaf index -> local shape with the padded dims at 1
    for i in schema.spec_indices():
        spec = schema.leaves[i]
        want = sharding.input_placements.get(i, spec.placements)
        local, _ = local_shape_and_offset(spec.shape, mesh.shape, coord, want)
        if any(n == 0 and g != 0 for n, g in zip(local, spec.shape)):
            pads[i] = tuple(1 if n == 0 and g != 0 else n for n, g in zip(local, spec.shape))
    if not pads:
        return None
    shapes = []
    for meta, pl in zip(schema.out_meta, sharding.output_placements):
        if meta is None:
            shapes.append(None)
        else:
            shapes.append(local_shape_and_offset(meta.shape, mesh.shape, coord, pl)[0])

    def padded_run(*args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        for i, shape in pads.items():
            leaves[i] = leaves[i].new_zeros(shape)
        args, kwargs = tree_unflatten(leaves, spec)
        out = run(*args, **kwargs)
        flat, out_spec = tree_flatten(out)
        for k, (t, shape) in enumerate(zip(flat, shapes)):
            if shape is None or not isinstance(t, torch.Tensor) or tuple(t.shape) == shape:
                continue
            for d, (got, local) in enumerate(zip(t.shape, shape)):
                if got != local:
                    if local != 0:  # only a padded dim may differ
                        raise AssertionError(f"{schema.func}: output {k} has shape {t.shape}")
                    t = t.narrow(d, 0, 0)
            flat[k] = t
        return tree_unflatten(flat, out_spec)

    return padded_run


def _local_sizes_fn(schema: OpSchema):
    """The interpolation backward ops take the forward input's full size (``input_size``,
    leading dims included) as numbers, which dispatch passes on as they are: locally the
    leading dims must be the local gradient's (the spatial ones are never sharded)."""
    names = [a.name for a in schema.func._schema.arguments]
    if "input_size" not in names:
        return None
    pos = names.index("input_size")
    n_lead = len(schema.leaves[schema.spec_indices()[0]].shape) - _spatial_rank(schema)
    func = schema.func

    def with_local_sizes(*args, **kwargs):
        args = list(args)
        grad = args[0]
        local = [*grad.shape[:n_lead]]
        if pos < len(args):
            args[pos] = [*local, *args[pos][n_lead:]]
        else:
            kwargs["input_size"] = [*local, *kwargs["input_size"][n_lead:]]
        return func(*args, **kwargs)

    return with_local_sizes


# --------------------------------------------------------------------------- per-plane ops


def _plane_options(schema: OpSchema, linear: bool) -> list[Option]:
    """Every tensor shares the leading dims of the first one; each may stay sharded. A
    ``linear`` op also passes a ``Partial`` of its first tensor through, the others
    replicated."""
    specs = _specs(schema)
    n_lead = specs[0].ndim - _spatial_rank(schema)
    if any(s.ndim < n_lead for s in specs):
        return []
    opts = [Option(_outs(schema, Shard(d)), (Shard(d),) * len(specs)) for d in range(n_lead)]
    if linear:
        rest = (Replicate(),) * (len(specs) - 1)
        opts += [Option(_outs(schema, p), (p, *rest)) for p in _linear_partials(specs[0])]
    return opts


_NONLINEAR_PLANE_OPS = _ops(
    "max_pool1d_with_indices",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "fractional_max_pool2d_backward",
    "fractional_max_pool3d_backward",
)

_LINEAR_PLANE_OPS = _ops(
    # average pooling, forward and backward
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "avg_pool2d_backward",
    "avg_pool3d_backward",
    "adaptive_avg_pool1d",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d",
    "_adaptive_avg_pool2d_backward",
    "_adaptive_avg_pool3d_backward",
    # max pooling backward: a scatter of the gradient by the (replicated) indices
    "max_pool2d_with_indices_backward",
    "max_pool3d_with_indices_backward",
    "adaptive_max_pool2d_backward",
    "adaptive_max_pool3d_backward",
    # unpooling: a scatter of the input by the indices
    "max_unpool2d",
    "max_unpool3d",
    # interpolation, forward and backward
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_bicubic2d",
    "upsample_trilinear3d",
    "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa",
    "_upsample_lanczos2d_aa",
    "upsample_nearest1d_backward",
    "upsample_nearest2d_backward",
    "upsample_nearest3d_backward",
    "_upsample_nearest_exact1d_backward",
    "_upsample_nearest_exact2d_backward",
    "_upsample_nearest_exact3d_backward",
    "upsample_linear1d_backward",
    "upsample_bilinear2d_backward",
    "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward",
    "_upsample_bilinear2d_aa_backward",
    "_upsample_bicubic2d_aa_backward",
    "_upsample_lanczos2d_aa_backward",
)


@_register_layer(*_NONLINEAR_PLANE_OPS)
def plane_options(schema: OpSchema) -> list[Option]:
    return _plane_options(schema, linear=False)


@_register_layer(*_LINEAR_PLANE_OPS)
def linear_plane_options(schema: OpSchema) -> list[Option]:
    return _plane_options(schema, linear=True)


@_register_layer(*_ops("fractional_max_pool2d", "fractional_max_pool3d"))
def fractional_max_pool_options(schema: OpSchema) -> list[Option]:
    # (input, kernel_size, output_size, random_samples): the samples are (N, C, 2) for a
    # batched input, (1, C, 2) for an unbatched (C, *spatial) one.
    specs = _specs(schema)
    if len(specs) != 2:
        return []
    x = specs[0]
    batched = x.ndim == _spatial_rank(schema) + 2
    if batched:
        pairs = [(0, 0), (1, 1)]
    else:
        pairs = [(0, 1)]
    return [Option(_outs(schema, Shard(d)), (Shard(d), Shard(s))) for d, s in pairs]


# --------------------------------------------------------------------------- grid sampling


@_register_layer(*_ops("grid_sampler_2d", "grid_sampler_3d"))
def grid_sampler_options(schema: OpSchema) -> list[Option]:
    # input (N, C, *in_spatial), grid (N, *out_spatial, k) -> (N, C, *out_spatial)
    x = _specs(schema)[0]
    k = _spatial_rank(schema)
    r = Replicate()
    opts = [
        Option((Shard(0),), (Shard(0), Shard(0))),
        Option((Shard(1),), (Shard(1), r)),
    ]
    opts += [Option((Shard(j + 1),), (r, Shard(j))) for j in range(1, k + 1)]
    opts += [Option((p,), (p, r)) for p in _linear_partials(x)]
    return opts


@_register_layer(*_ops("grid_sampler_2d_backward", "grid_sampler_3d_backward"))
def grid_sampler_backward_options(schema: OpSchema) -> list[Option]:
    # (grad_out, input, grid, ...) -> (grad_input, grad_grid); either may be skipped.
    grad, _, _ = _specs(schema)
    k = _spatial_rank(schema)
    r, s = Replicate(), Partial()

    def outs(gi, gg):
        return tuple(p if m is not None else None for p, m in zip((gi, gg), schema.out_meta))

    opts = [
        Option(outs(Shard(0), Shard(0)), (Shard(0), Shard(0), Shard(0))),
        Option(outs(Shard(1), s), (Shard(1), Shard(1), r)),
    ]
    opts += [Option(outs(s, Shard(j)), (Shard(j + 1), r, Shard(j))) for j in range(1, k + 1)]
    opts += [Option(outs(p, p), (p, r, r)) for p in _linear_partials(grad)]
    return opts


# --------------------------------------------------------------------------- convolution


def _conv_weight_dims(transposed: bool) -> tuple[int, int]:
    """The weight's (output-channel, input-channel) dims."""
    return (1, 0) if transposed else (0, 1)


@_register_layer(aten.convolution.default, aten._convolution.default)
def convolution_options(schema: OpSchema) -> list[Option]:
    # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    x, w, bias = schema.args[0], schema.args[1], schema.args[2]
    transposed, groups = bool(schema.args[6]), schema.args[8]
    if not isinstance(x, DTensorSpec) or not isinstance(w, DTensorSpec) or x.ndim != w.ndim:
        return []
    has_bias = isinstance(bias, DTensorSpec)
    r = Replicate()
    wo, wi = _conv_weight_dims(transposed)

    def ins(px, pw, pb=r):
        return (px, pw, pb) if has_bias else (px, pw)

    opts = [Option((Shard(0),), ins(Shard(0), r))]
    if groups == 1:
        opts.append(Option((Shard(1),), ins(r, Shard(wo), Shard(0))))
        if not has_bias:
            opts.append(Option((Partial(),), ins(Shard(1), Shard(wi))))
    if not has_bias:
        opts += [Option((p,), ins(p, r)) for p in _linear_partials(x)]
        opts += [Option((p,), ins(r, p)) for p in _linear_partials(w)]
    return opts


@_register_layer(aten.convolution_backward.default)
def convolution_backward_options(schema: OpSchema) -> list[Option]:
    # (grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #  output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)
    grad, x, w = schema.args[0], schema.args[1], schema.args[2]
    transposed, groups = bool(schema.args[7]), schema.args[9]
    if x.ndim != w.ndim:
        return []
    r, s = Replicate(), Partial()
    wo, wi = _conv_weight_dims(transposed)

    def outs(gi, gw, gb):
        return tuple(p if m is not None else None for p, m in zip((gi, gw, gb), schema.out_meta))

    opts = [Option(outs(Shard(0), s, s), (Shard(0), Shard(0), r))]
    if groups == 1:
        opts.append(Option(outs(s, Shard(wo), Shard(0)), (Shard(1), r, Shard(wo))))
        opts.append(Option(outs(Shard(1), Shard(wi), r), (r, Shard(1), Shard(wi))))
    opts += [Option(outs(p, p, p), (p, r, r)) for p in _linear_partials(grad)]
    return opts
