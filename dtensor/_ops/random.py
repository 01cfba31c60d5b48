"""Random ops: in-place fills, fresh draws shaped like a tensor, and draws that read their
inputs' values.

One contract for all: every rank draws what a single process with the same seed would draw
for the *whole* tensor, and keeps its own block. Hence

- a sharded result is, block by block, one draw of the full tensor: the blocks of two ranks
  differ as two parts of one draw do (two ranks drawing their blocks each from the same
  seed would get the same numbers: correlated "random" blocks);
- a replicated result is the same on every rank;
- every rank's generator advances by the same amount, whatever the size of its block (an
  uneven split, an empty block), so the ranks' streams stay in step for the next draw.

It rests on the ranks sharing a seed (``torch.manual_seed(s)`` on each), as any replicated
random value does. The price is a full-size draw per rank, one op at a time. The ops:

- In-place fills (``normal_``, ``uniform_``, ...), as ``nn.init`` uses them: a model
  initialized after sharding (meta-device construction, then ``reset_parameters()``) gets
  exactly the values a single process with the same seed would draw. Partial targets are
  refused: a random partial sum has no meaning.
- Draws shaped like their input (``rand_like``, ``randn_like``, ``randint_like``,
  ``bernoulli(x, p=0.5)``): the input's values are never read, so no communication; the
  output is laid out as the input (a partial input gives a replicated output).
- ``bernoulli(p)`` with a tensor of probabilities: a full uniform draw ``u``, and each rank
  compares its block of ``u`` with its block of ``p``. No communication; on CPU this equals
  ``torch.bernoulli`` of the full tensor for float32/float64 (it too draws one uniform per
  element, in order); elsewhere it is equal in distribution.
- ``native_dropout`` (CUDA's dropout): the full keep-mask is drawn as CPU's kernel draws it
  (a boolean ``bernoulli_(1 - p)``), each rank applies its block: ``x * mask * 1/(1 - p)``.
- Draws whose use of the generator depends on the input values (``multinomial``, ``rrelu``
  in training, ``poisson``, ``binomial``, ``normal`` with tensor mean or std, ...): the
  inputs are gathered, the op runs on the full tensors, each rank keeps its block of the
  output (``multinomial`` keeps the input's batch-dim shards; its category dim is consumed).

On CPU a large full draw lives in its own anonymous memory mapping (`_scratch`), which goes
back to the operating system the moment the draw is dropped. From the ordinary allocator,
glibc would keep the freed block in the process heap, and it would show in the peak RSS of
the whole run (about 25 MB for the benchmark GPT's embedding, measured with mallinfo2).
"""

from __future__ import annotations

import math
import mmap

import torch

from dtensor._ops._common import OpSchema, OutputSharding, register
from dtensor._ops.pointwise import _out_of_place_output, pointwise_rule
from dtensor._redistribute import redistribute_local
from dtensor.placement import Partial, Replicate, is_shard_like, local_shape_and_offset

aten = torch.ops.aten

_RANDOM_INPLACE = (
    aten.normal_,
    aten.uniform_,
    aten.exponential_,
    aten.log_normal_,
    aten.cauchy_,
    aten.geometric_,
    aten.random_,
    aten.bernoulli_,
)


@register(*_RANDOM_INPLACE)
def random_inplace(schema: OpSchema) -> OutputSharding:
    spec = schema.leaves[0]
    if any(isinstance(p, Partial) for p in spec.placements):
        raise NotImplementedError(
            f"{schema.name}: cannot fill a Partial DTensor with random values; "
            "redistribute it to Shard or Replicate first."
        )
    # the target is drawn whole: a tensor of probabilities (bernoulli_) is needed whole
    whole = (Replicate(),) * spec.mesh.ndim
    keep = {i: spec.placements if i == 0 else whole for i in schema.spec_indices()}
    if not any(is_shard_like(p) for p in spec.placements):
        return OutputSharding([spec.placements], keep)
    shape, offset = spec.local_shape_and_offset()
    box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    func = schema.func

    def local_fn(local, *args, **kwargs):
        full = _scratch(spec.shape, local.dtype, local.device)
        func(full, *args, **kwargs)
        local.copy_(full[box])
        return local

    return OutputSharding([spec.placements], keep, local_fn)


def _box(mesh, placements, shape) -> tuple | None:
    """This rank's block of a tensor of ``shape`` laid out as ``placements`` (slices), or
    None when the rank holds all of it."""
    if not any(is_shard_like(p) for p in placements):
        return None
    size, offset = local_shape_and_offset(shape, mesh.shape, mesh.get_coordinate(), placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))


def _block(full: torch.Tensor, box) -> torch.Tensor:
    """``full``'s block; a copy, so the full draw is freed when the caller drops it."""
    return full if box is None else full[box].clone()


def _no_partial(placements) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _overloads(*packets):
    """The overloads of ``packets`` that write no ``out=`` tensor (those stay without a
    rule: refused on DTensors)."""
    for packet in packets:
        for name in packet.overloads():
            op = getattr(packet, name)
            if not any(a.alias_info is not None for a in op._schema.arguments):
                yield op


def _arg(schema: OpSchema, i: int, name: str, default):
    if len(schema.args) > i:
        return schema.args[i]
    return schema.kwargs.get(name, default)


@register(*_overloads(aten.rand_like, aten.randn_like, aten.randint_like), aten.bernoulli.p)
def like_draw(schema: OpSchema) -> OutputSharding:
    """A fresh draw of the input's shape: the whole draw, this rank's block kept."""
    x = schema.args[0]
    placements = _no_partial(x.placements)
    outs = [placements]
    # the input's values are never read; a tensor bound (randint_like's high) is used whole
    whole = (Replicate(),) * x.mesh.ndim
    inputs = {i: whole for i in schema.spec_indices()[1:]}
    box = _box(x.mesh, placements, x.shape)
    if box is None:
        return OutputSharding(outs, inputs)  # the local input has the full shape
    func, shape = schema.func, x.shape

    def local_fn(local, *args, **kwargs):
        # a stand-in of the full shape that holds one element
        full = func(local.new_empty(()).expand(shape), *args, **kwargs)
        fmt = kwargs.get("memory_format") or torch.preserve_format
        out = torch.empty_like(local, dtype=full.dtype, device=full.device, memory_format=fmt)
        return out.copy_(full[box])

    return OutputSharding(outs, inputs, local_fn)


@register(aten.bernoulli.default)
def bernoulli_rule(schema: OpSchema) -> OutputSharding:
    """``bernoulli(p)``: a full uniform draw, compared block by block with ``p``."""
    p = schema.args[0]
    placements = _no_partial(p.placements)
    inputs = {schema.leaf_index(p): placements}
    box = _box(p.mesh, placements, p.shape)
    if box is None:
        return OutputSharding([placements], inputs)
    shape = p.shape
    reduced = p.meta.dtype in (torch.float16, torch.bfloat16) or not p.meta.dtype.is_floating_point
    u_dtype = torch.float32 if reduced else p.meta.dtype

    def local_fn(local, generator=None):
        # as torch.bernoulli checks it, without waiting for the device
        torch._assert_async(((local >= 0) & (local <= 1)).all(), "bernoulli: p not in [0, 1]")
        u = _scratch(shape, u_dtype, local.device).uniform_(0, 1, generator=generator)
        return torch.empty_like(local).copy_(u[box] < local)

    return OutputSharding([placements], inputs, local_fn)


@register(aten.native_dropout.default)
def native_dropout_rule(schema: OpSchema) -> OutputSharding:
    """Dropout's fused op (CUDA's path): the full keep-mask drawn, this rank's block used."""
    x = schema.args[0]
    train = _arg(schema, 2, "train", None)
    placements = _no_partial(x.placements)
    inputs = {schema.leaf_index(x): placements}
    outs = [placements, placements]
    box = _box(x.mesh, placements, x.shape)
    if box is None or train is False or x.shape.numel() == 0:
        return OutputSharding(outs, inputs)  # the whole draw, or no draw at all
    shape = x.shape

    def local_fn(local, p, train=None):
        keep = 1.0 - p
        mask = _scratch(shape, torch.bool, local.device).bernoulli_(keep)[box].clone()
        return local.mul(mask).mul_(0.0 if keep == 0 else 1.0 / keep), mask

    return OutputSharding(outs, inputs, local_fn)


def _drawn_whole(schema: OpSchema, out_placements: tuple):
    """Every input gathered, the op run on the full tensors, each tensor output cut to this
    rank's block of ``out_placements``."""
    mesh = schema.mesh
    inputs = {i: (Replicate(),) * mesh.ndim for i in schema.spec_indices()}
    outs = [out_placements if m is not None else None for m in schema.out_meta]
    boxes = [
        _box(mesh, out_placements, m.shape) if m is not None else None for m in schema.out_meta
    ]
    if all(b is None for b in boxes):
        return OutputSharding(outs, inputs)
    func = schema.func

    def local_fn(*args, **kwargs):
        full = func(*args, **kwargs)
        if isinstance(full, torch.Tensor):
            return _block(full, boxes[0])
        return tuple(_block(t, b) for t, b in zip(full, boxes, strict=True))

    return OutputSharding(outs, inputs, local_fn)


@register(aten.multinomial.default)
def multinomial_rule(schema: OpSchema) -> OutputSharding:
    """Rows are drawn whole; a shard of the batch dim of a 2-D input stays on the output."""
    x = schema.args[0]
    out = tuple(p if is_shard_like(p) and p.dim < x.ndim - 1 else Replicate() for p in x.placements)
    return _drawn_whole(schema, out)


@register(
    aten.poisson.default,
    aten.binomial.default,
    aten._standard_gamma.default,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.bernoulli.Tensor,
)
def elementwise_drawn_whole(schema: OpSchema) -> OutputSharding:
    """Elementwise draws that read their inputs: gathered, drawn whole, cut to the layout
    an elementwise op would give (the first input's shard on a dim that is not broadcast)."""
    specs = [schema.leaves[i] for i in schema.spec_indices()]
    shape = schema.out_meta[0].shape
    out = tuple(
        _out_of_place_output(schema.name, list(schema.args), specs, i, shape)
        for i in range(schema.mesh.ndim)
    )
    return _drawn_whole(schema, _no_partial(out))


@register(
    aten.rrelu_with_noise.default,
    aten.rrelu_with_noise_.default,
    aten.rrelu_with_noise_functional.default,
)
def rrelu_rule(schema: OpSchema) -> OutputSharding:
    """``rrelu``: in evaluation an elementwise op; in training each negative element draws
    its slope (how many numbers a block draws depends on its values): the whole draw is made
    from the gathered input, and the slopes written into ``noise``, block by block."""
    if not _arg(schema, 4, "training", False):
        return pointwise_rule(schema)
    x, noise = schema.args[0], schema.args[1]
    if tuple(x.shape) != tuple(noise.shape):
        raise NotImplementedError(
            f"{schema.func}: a noise tensor of another shape than the input "
            f"({tuple(noise.shape)} vs {tuple(x.shape)}) is not supported on DTensors."
        )
    func = schema.func
    if func is aten.rrelu_with_noise_functional.default:  # noise is not written
        return _drawn_whole(schema, _no_partial(x.placements))
    inplace = func is aten.rrelu_with_noise_.default
    written = [x, noise] if inplace else [noise]
    for w in written:
        if any(isinstance(p, Partial) for p in w.placements):
            raise NotImplementedError(
                f"{func}: cannot write random slopes into a Partial DTensor; "
                "redistribute it to Shard or Replicate first."
            )
    out = x.placements if inplace else noise.placements
    out_box = _box(x.mesh, out, x.shape)
    noise_box = _box(x.mesh, noise.placements, x.shape)
    keep = {schema.leaf_index(noise): noise.placements}
    if inplace:
        keep[schema.leaf_index(x)] = x.placements
    else:
        keep[schema.leaf_index(x)] = (Replicate(),) * x.mesh.ndim
    shape = x.shape
    whole = (Replicate(),) * x.mesh.ndim

    def local_fn(x_local, noise_local, *args, **kwargs):
        x_full = x_local
        if inplace and out_box is not None:
            x_full = redistribute_local(x_local, x, whole).wait()
        noise_full = torch.empty(shape, dtype=noise_local.dtype, device=noise_local.device)
        y = aten.rrelu_with_noise.default(x_full, noise_full, *args, **kwargs)
        noise_local.copy_(noise_full if noise_box is None else noise_full[noise_box])
        if inplace:
            return x_local.copy_(y if out_box is None else y[out_box])
        return _block(y, out_box)

    return OutputSharding([out] if not inplace else [], keep, local_fn)


# Below this size a draw is served from the allocator's small-block pools and costs nothing
# that lasts; above it, a private mapping is worth the system call.
_MAPPED_MIN_BYTES = 1 << 20


def _scratch(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor for a throw-away full draw.

    On CPU, when it is large, its memory is an anonymous ``mmap`` rather than a heap block,
    so dropping the tensor unmaps it. The values a random fill writes do not depend on where
    the memory lives.

    Example::

        >>> buf = _scratch(torch.Size([1024, 1024]), torch.float32, torch.device("cpu"))
        >>> buf.shape
        torch.Size([1024, 1024])
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive through the buffer protocol; the mapping is
    # released when the last view of the tensor goes.
    region = mmap.mmap(-1, nbytes)
    return torch.frombuffer(region, dtype=dtype).view(shape)
