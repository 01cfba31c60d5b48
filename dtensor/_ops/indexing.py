"""Index ops: gather / scatter (``scatter``, ``scatter_add``, ``scatter_reduce``), the
``index_*`` family (``index_select``, ``index_add``, ``index_copy``, ``index_fill``,
``index_reduce``), ``index`` / ``index_put``, ``take`` / ``put``, ``bucketize`` /
``searchsorted`` and the ``select`` / ``slice`` / ``diagonal`` scatters.

Every rule lists, for one mesh dim, the ways the op can run ([Note: rules for one mesh
dim] in ``_common.py``); which of them is right depends on the role a tensor dim plays:

- A dim the op does not index (positions map one to one between input, index, source and
  output) keeps a ``Shard`` when every tensor that has it is split alike: same size on it,
  so the same ``torch.chunk`` blocks. Where the index is smaller than the input on such a dim
  (``gather``, ``scatter``) the input is narrowed to the index's block, and a check over
  every mesh coordinate makes sure that block lies inside the input's; when it does not (two
  mesh dims split the dim in another order) the op is run on gathered tensors instead.
- The indexed dim of the *input* may stay sharded when the index is replicated: a rank
  reads (``gather``, ``index_select``) only the rows it holds, answering zero elsewhere, so
  the output is ``Partial("sum")``; a rank writes (``scatter``, ``index_copy`` ...) only the
  rows that land in its block: the others are sent to one scratch row appended to the local
  block and dropped afterwards, so every reduction (overwrite, sum, prod, mean, amax, amin)
  sees on the owning rank exactly the values it sees on the full tensor, uneven and empty
  blocks included.
- A sharded *index* (with the source split alike) splits the work: reads give an output
  sharded like the index; additive writes (``scatter_add``, ``index_add``, ``put`` with
  ``accumulate``) give ``Partial("sum")``, each rank adding its own pairs into a partial of
  the input. Overwriting and non-linear writes cannot be split this way.
- Ops linear in their data (reads; additive writes, where the input and the source are both
  partial) keep ``Partial("sum")``. Partials of other kinds are reduced first.

Anything else is gathered (the all-replicated option is always there).
"""

from __future__ import annotations

import itertools

import torch

from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    register,
    register_per_mesh_dim,
    replicate_all,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, Shard, local_shape_and_offset

aten = torch.ops.aten

_R = Replicate()
_SUM = Partial("sum")


# --------------------------------------------------------------------------- helpers


def _arg(schema: OpSchema, pos: int, name: str, default=None):
    """Argument ``name`` of the op, passed at position ``pos`` (``self`` is 0) or by name."""
    if len(schema.args) > pos:
        return schema.args[pos]
    return schema.kwargs.get(name, default)


def _is_spec(x) -> bool:
    return isinstance(x, DTensorSpec)


def _opt(schema: OpSchema, out, *wanted) -> Option:
    """An option with output placement ``out`` and, per ``(spec, placement)`` of
    ``wanted``, that input's placement; every other DTensor input replicated."""
    want = {id(s): p for s, p in wanted if _is_spec(s)}
    ins = tuple(want.get(id(schema.leaves[i]), _R) for i in schema.spec_indices())
    return Option((out,), ins)


def _sums_ok(schema: OpSchema) -> bool:
    """Whether options with ``Partial("sum")`` inputs or outputs may be offered: not for
    bool data (a sum of flags is no flag), and not while an input is another kind of
    partial (it is reduced first, rather than turned into a sum)."""
    specs = [schema.leaves[i] for i in schema.spec_indices()]
    if schema.out_meta and schema.out_meta[0] is not None:
        if schema.out_meta[0].dtype == torch.bool:
            return False
    return not any(
        isinstance(p, Partial) and p.reduce_op != "sum" for s in specs for p in s.placements
    )


def _dim(d: int, ndim: int) -> int:
    return d % max(ndim, 1)


class _Blocks:
    """Where each DTensor input's local block lies, under the placements a rule chose."""

    def __init__(self, schema: OpSchema, sharding: OutputSharding, coord):
        self.mesh_shape = schema.mesh.shape
        self.coord = coord
        self.placed = {id(schema.leaves[i]): p for i, p in sharding.input_placements.items()}

    def __call__(self, spec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(sizes, offsets) of ``spec``'s local block."""
        return local_shape_and_offset(
            spec.shape, self.mesh_shape, self.coord, self.placed[id(spec)]
        )


def _contains(outer, inner, dims) -> bool:
    """Whether on every dim of ``dims`` block ``inner`` ((sizes, offsets)) lies inside
    ``outer`` (an empty ``inner`` lies anywhere)."""
    (os_, oo), (is_, io) = outer, inner
    return all(is_[d] == 0 or (oo[d] <= io[d] and io[d] + is_[d] <= oo[d] + os_[d]) for d in dims)


def _narrowing(outer, inner, dims) -> list[tuple[int, int, int]]:
    """``(dim, start, length)`` that cut ``outer``'s local tensor down to ``inner``'s block
    on each dim of ``dims`` where the two differ."""
    (os_, oo), (is_, io) = outer, inner
    out = []
    for d in dims:
        start = io[d] - oo[d] if is_[d] else 0
        if (start, is_[d]) != (0, os_[d]):
            out.append((d, start, is_[d]))
    return out


def _narrow(t: torch.Tensor, cuts) -> torch.Tensor:
    for d, start, length in cuts:
        t = t.narrow(d, start, length)
    return t


def _finish(schema: OpSchema, options: list, check=None, make_local=None) -> OutputSharding:
    """Expand ``options`` to the mesh; when ``check(blocks)`` fails at any mesh coordinate
    (the chosen placements do not line the blocks up), run on gathered tensors instead;
    else attach ``make_local(blocks)`` (this rank's local function, or None for the op)."""
    sharding = expand_per_mesh_dim(schema, options)
    if all(
        not isinstance(p, (Shard, Partial)) for pl in sharding.input_placements.values() for p in pl
    ):
        return sharding
    mesh = schema.mesh
    if check is not None:
        for coord in itertools.product(*(range(n) for n in mesh.shape)):
            if not check(_Blocks(schema, sharding, coord)):
                return replicate_all(schema)
    if make_local is not None:
        sharding.local_fn = make_local(_Blocks(schema, sharding, mesh.get_coordinate()))
    return sharding


def _mask(idx: torch.Tensor, start: int, size: int):
    """Which entries of ``idx`` fall in ``[start, start + size)``."""
    return (idx >= start) & (idx < start + size)


def _read_own_rows(op, xl, d, il, start, size, empty_shape, spread, *args, **kwargs):
    """``op(xl, d, index)`` reading only this rank's rows ``[start, start + size)`` of dim
    ``d``: an index of another rank's row reads row 0 and its result is zeroed (``spread``
    shapes the mask like the output); an empty block gives zeros of ``empty_shape``. Summed
    over the ranks (the output is Partial), that is the op on the whole tensor."""
    if size == 0:
        return xl.new_zeros(empty_shape)
    mine = _mask(il, start, size)
    out = op(xl, d, torch.where(mine, il - start, 0), *args, **kwargs)
    return torch.where(spread(mine), out, 0)


def _wrapped(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``idx`` with negative entries counted from the end of a dim of size ``n`` (for the ops
    that accept them: ``index``, ``index_put``, ``index_fill``)."""
    return torch.where(idx < 0, idx + n, idx)


def _with_scratch_row(x: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy of ``x`` with one more (zero) row on ``dim``: where writes of other ranks go."""
    shape = list(x.shape)
    shape[dim] = 1
    return torch.cat([x, x.new_zeros(shape)], dim)


def _shape_of(t: torch.Tensor, ndim: int, dim: int) -> list[int]:
    """The shape that lays the 0- or 1-D ``t`` along ``dim`` of an ``ndim``-D tensor."""
    shape = [1] * ndim
    if t.ndim:
        shape[dim] = t.numel()
    return shape


# --------------------------------------------------------------------------- gather


@register(aten.gather.default)
def gather_rule(schema: OpSchema) -> OutputSharding:
    x, idx = schema.args[0], _arg(schema, 2, "index")
    dim = _dim(schema.args[1], x.ndim)
    if x.ndim == 0 or idx.ndim != x.ndim:
        return _finish(schema, [])
    opts = [
        _opt(schema, Shard(d), (x, Shard(d)), (idx, Shard(d)))
        for d in range(x.ndim)
        if d != dim and x.shape[d] == idx.shape[d]
    ]
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, Shard(dim)), (idx, _R)))
    opts += [_opt(schema, Shard(d), (x, _R), (idx, Shard(d))) for d in range(idx.ndim)]
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM), (idx, _R)))
    others = [d for d in range(x.ndim) if d != dim]

    def check(blocks):
        return _contains(blocks(x), blocks(idx), others)

    def make_local(blocks):
        (xs, xo), cuts = blocks(x), _narrowing(blocks(x), blocks(idx), others)
        masked = xs[dim] != x.shape[dim]
        if not masked and not cuts:
            return None
        start, size = xo[dim], xs[dim]

        def local(xl, d, il, *args, **kwargs):
            xl = _narrow(xl, cuts)
            if not masked:
                return aten.gather.default(xl, d, il, *args, **kwargs)
            return _read_own_rows(
                aten.gather.default, xl, d, il, start, size, il.shape, lambda m: m, *args, **kwargs
            )

        return local

    return _finish(schema, opts, check, make_local)


# --------------------------------------------------------------------------- scatter

# the op on local tensors, in place on a region of a copy of the input
_SCATTER_INPLACE = {
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter.reduce: aten.scatter_.reduce,
    aten.scatter.value_reduce: aten.scatter_.value_reduce,
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.scatter_reduce.two: aten.scatter_reduce_.two,
}


def _scatter_adds(schema: OpSchema) -> bool:
    """Whether the scatter adds into its input (so it is linear in input and source)."""
    if schema.func is aten.scatter_add.default:
        return True
    if schema.func is aten.scatter_reduce.two:
        return _arg(schema, 4, "reduce") == "sum" and schema.kwargs.get("include_self", True)
    return False


@register(*_SCATTER_INPLACE)
def scatter_rule(schema: OpSchema) -> OutputSharding:
    x, idx = schema.args[0], _arg(schema, 2, "index")
    src = _arg(schema, 3, "src")
    src = src if _is_spec(src) else None
    dim = _dim(schema.args[1], x.ndim)
    if x.ndim == 0 or idx.ndim != x.ndim or (src is not None and src.ndim != x.ndim):
        return _finish(schema, [])
    opts = []
    for d in range(x.ndim):
        if d != dim and x.shape[d] == idx.shape[d]:
            if src is not None and src.shape[d] == idx.shape[d]:
                opts.append(_opt(schema, Shard(d), (x, Shard(d)), (idx, Shard(d)), (src, Shard(d))))
            opts.append(_opt(schema, Shard(d), (x, Shard(d)), (idx, Shard(d))))
    opts.append(_opt(schema, Shard(dim), (x, Shard(dim))))
    if _scatter_adds(schema) and _sums_ok(schema):
        for d in range(x.ndim):
            if src.shape[d] == idx.shape[d]:
                opts.append(_opt(schema, _SUM, (x, _SUM), (idx, Shard(d)), (src, Shard(d))))
            opts.append(_opt(schema, _SUM, (x, _SUM), (idx, Shard(d))))
        opts.append(_opt(schema, _SUM, (x, _SUM), (src, _SUM)))
    others = [d for d in range(x.ndim) if d != dim]
    every = list(range(x.ndim))

    def check(blocks):
        ok = _contains(blocks(x), blocks(idx), others)
        return ok and (src is None or _contains(blocks(src), blocks(idx), every))

    inplace = _SCATTER_INPLACE[schema.func]

    def make_local(blocks):
        (xs, xo), ib = blocks(x), blocks(idx)
        region = _narrowing(blocks(x), ib, others)
        src_cuts = _narrowing(blocks(src), ib, every) if src is not None else []
        masked = xs[dim] != x.shape[dim]
        if not (masked or region or src_cuts):
            return None
        start, size = xo[dim], xs[dim]

        def local(xl, d, il, *args, **kwargs):
            if src is not None:
                args = (_narrow(args[0], src_cuts), *args[1:])
            if masked:
                out = _with_scratch_row(xl, dim)
                il = torch.where(_mask(il, start, size), il - start, size)
            else:
                out = xl.clone()
            inplace(_narrow(out, region), d, il, *args, **kwargs)
            return out.narrow(dim, 0, size).contiguous() if masked else out

        return local

    return _finish(schema, opts, check, make_local)


# --------------------------------------------------------------------------- index_* ops


@register(aten.index_select.default)
def index_select_rule(schema: OpSchema) -> OutputSharding:
    x, idx = schema.args[0], _arg(schema, 2, "index")
    dim = _dim(schema.args[1], x.ndim)
    if x.ndim == 0:
        return _finish(schema, [])
    opts = [_opt(schema, Shard(d), (x, Shard(d))) for d in range(x.ndim) if d != dim]
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, Shard(dim))))
    if idx.ndim == 1:
        opts.append(_opt(schema, Shard(dim), (idx, Shard(0))))
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM)))

    def make_local(blocks):
        xs, xo = blocks(x)
        if xs[dim] == x.shape[dim]:
            return None
        start, size = xo[dim], xs[dim]

        def local(xl, d, il):
            empty = [*xl.shape[:dim], il.numel(), *xl.shape[dim + 1 :]]

            def spread(mine):
                return mine.reshape(_shape_of(mine, xl.ndim, dim))

            return _read_own_rows(aten.index_select.default, xl, d, il, start, size, empty, spread)

        return local

    return _finish(schema, opts, None, make_local)


# the op on local tensors, in place on a copy of the input
_INDEX_WRITE_INPLACE = {
    aten.index_add.default: aten.index_add_.default,
    aten.index_copy.default: aten.index_copy_.default,
    aten.index_fill.int_Scalar: aten.index_fill_.int_Scalar,
    aten.index_fill.int_Tensor: aten.index_fill_.int_Tensor,
    aten.index_reduce.default: aten.index_reduce_.default,
}
_WITH_SOURCE = (aten.index_add.default, aten.index_copy.default, aten.index_reduce.default)


def _index_write_options(schema: OpSchema, x, idx, src, dim: int) -> list:
    opts = [
        _opt(schema, Shard(d), (x, Shard(d)), (src, Shard(d))) for d in range(x.ndim) if d != dim
    ]
    opts.append(_opt(schema, Shard(dim), (x, Shard(dim))))
    if schema.func is aten.index_add.default and _sums_ok(schema):
        if idx.ndim == 1:
            opts.append(_opt(schema, _SUM, (x, _SUM), (idx, Shard(0)), (src, Shard(dim))))
            opts.append(_opt(schema, _SUM, (x, _SUM), (idx, Shard(0))))
        opts.append(_opt(schema, _SUM, (x, _SUM), (src, _SUM)))
    return opts


@register(*_INDEX_WRITE_INPLACE)
def index_write_rule(schema: OpSchema) -> OutputSharding:
    x, idx = schema.args[0], _arg(schema, 2, "index")
    dim = _dim(schema.args[1], x.ndim)
    src = _arg(schema, 3, "source") if schema.func in _WITH_SOURCE else None
    if x.ndim == 0 or (src is not None and src.ndim != x.ndim):
        return _finish(schema, [])
    opts = _index_write_options(schema, x, idx, src, dim)
    others = [d for d in range(x.ndim) if d != dim]

    def check(blocks):
        if src is None:
            return True
        (ss, so), (xs, xo) = blocks(src), blocks(x)
        if any(ss[d] != xs[d] or so[d] != xo[d] for d in others):
            return False
        if idx.ndim == 0:
            return True
        # the source's rows along dim follow the index's entries
        (is_,), (io,) = blocks(idx)
        return is_ == 0 or (so[dim] <= io and io + is_ <= so[dim] + ss[dim])

    inplace = _INDEX_WRITE_INPLACE[schema.func]

    def make_local(blocks):
        xs, xo = blocks(x)
        masked = xs[dim] != x.shape[dim]
        cut = None
        if src is not None and idx.ndim == 1:
            (ss, so), (is_, io) = blocks(src), blocks(idx)
            begin = io[0] - so[dim] if is_[0] else 0
            if (begin, is_[0]) != (0, ss[dim]):
                cut = (begin, is_[0])
        if not masked and cut is None:
            return None
        start, size, n = xo[dim], xs[dim], x.shape[dim]
        wraps = schema.func in (aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)

        def local(xl, d, il, *args, **kwargs):
            if wraps:
                il = _wrapped(il, n)
            if cut is not None:
                args = (args[0].narrow(dim, *cut), *args[1:])
            if masked:
                out = _with_scratch_row(xl, dim)
                il = torch.where(_mask(il, start, size), il - start, size)
            else:
                out = xl.clone()
            inplace(out, d, il, *args, **kwargs)
            return out.narrow(dim, 0, size).contiguous() if masked else out

        return local

    return _finish(schema, opts, check, make_local)


# --------------------------------------------------------------------------- take / put


@register_per_mesh_dim(aten.take.default)
def take_options(schema: OpSchema) -> list:
    x, idx = schema.args[0], schema.args[1]
    opts = [_opt(schema, Shard(d), (idx, Shard(d))) for d in range(idx.ndim)]
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM)))
    return opts


@register_per_mesh_dim(aten.put.default)
def put_options(schema: OpSchema) -> list:
    x, idx, src = schema.args[0], schema.args[1], schema.args[2]
    if not _arg(schema, 3, "accumulate", False) or not _sums_ok(schema) or not _is_spec(src):
        return []
    opts = []
    if tuple(idx.shape) == tuple(src.shape):
        opts += [
            _opt(schema, _SUM, (x, _SUM), (idx, Shard(d)), (src, Shard(d))) for d in range(idx.ndim)
        ]
    opts.append(_opt(schema, _SUM, (x, _SUM), (src, _SUM)))
    return opts


# --------------------------------------------------------------------------- bucketize


@register_per_mesh_dim(aten.bucketize.Tensor)
def bucketize_options(schema: OpSchema) -> list:
    # each rank counting the boundaries of its block below a value, the counts sum up
    x, bounds = schema.args[0], schema.args[1]
    opts = [_opt(schema, Shard(d), (x, Shard(d))) for d in range(x.ndim)]
    return [*opts, _opt(schema, _SUM, (bounds, Shard(0)))]


@register_per_mesh_dim(aten.bucketize.Scalar)
def bucketize_scalar_options(schema: OpSchema) -> list:
    return [_opt(schema, _SUM, (schema.args[1], Shard(0)))]


@register_per_mesh_dim(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted_options(schema: OpSchema) -> list:
    seq, x = schema.args[0], schema.args[1]
    if schema.kwargs.get("sorter") is not None:
        return []
    last = seq.ndim - 1
    opts = []
    if _is_spec(x):
        if seq.ndim == 1:
            opts += [_opt(schema, Shard(d), (x, Shard(d))) for d in range(x.ndim)]
        else:  # one sorted row per leading position of x
            opts += [
                _opt(schema, Shard(d), (seq, Shard(d)), (x, Shard(d)))
                for d in range(last)
                if seq.shape[d] == x.shape[d]
            ]
    return [*opts, _opt(schema, _SUM, (seq, Shard(last)))]


# --------------------------------------------------------------------------- index / index_put


def _index_layout(x, indices):
    """For ``x[indices]`` with integer indices: (position of the indexed block, number of
    dims it covers, the indices' broadcast shape, the result's dim of each input dim not
    indexed), or None where this is not simple (masks, indices apart)."""
    where = [i for i, t in enumerate(indices) if t is not None]
    if not where or where != list(range(where[0], where[-1] + 1)):
        return None
    if any(t.meta.dtype in (torch.bool, torch.uint8) for t in indices if t is not None):
        return None
    bshape = torch.broadcast_shapes(*(tuple(indices[i].shape) for i in where))
    first, covered = where[0], len(where)
    out_dim = {}
    for d in range(x.ndim):
        if d < first:
            out_dim[d] = d
        elif d >= first + covered:
            out_dim[d] = d - covered + len(bshape)
    return first, covered, bshape, out_dim


@register(aten.index.Tensor)
def index_rule(schema: OpSchema) -> OutputSharding:
    x, indices = schema.args[0], list(schema.args[1])
    layout = _index_layout(x, indices)
    if layout is None:
        return _finish(schema, [])
    first, covered, bshape, out_dim = layout
    idx = [t for t in indices if t is not None]
    opts = [_opt(schema, Shard(o), (x, Shard(d))) for d, o in out_dim.items()]
    if covered == 1 and _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, Shard(first))))
    if all(tuple(t.shape) == tuple(bshape) for t in idx):
        for j in range(len(bshape)):
            opts.append(_opt(schema, Shard(first + j), *((t, Shard(j)) for t in idx)))
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM)))

    def make_local(blocks):
        xs, xo = blocks(x)
        if covered != 1 or xs[first] == x.shape[first]:
            return None
        start, size = xo[first], xs[first]

        def local(xl, ind):
            il = _wrapped(ind[first], x.shape[first])
            before, after = xl.shape[:first], xl.shape[first + 1 :]
            if size == 0:
                return xl.new_zeros((*before, *il.shape, *after))
            mine = _mask(il, start, size)
            moved = [None] * first + [torch.where(mine, il - start, 0)]
            out = aten.index.Tensor(xl, moved)
            keep = mine.reshape((1,) * first + tuple(il.shape) + (1,) * len(after))
            return torch.where(keep, out, 0)

        return local

    return _finish(schema, opts, None, make_local)


@register(aten.index_put.default)
def index_put_rule(schema: OpSchema) -> OutputSharding:
    x, indices, values = schema.args[0], list(schema.args[1]), schema.args[2]
    accumulate = _arg(schema, 3, "accumulate", False)
    layout = _index_layout(x, indices)
    if layout is None or not _is_spec(values):
        return _finish(schema, [])
    first, covered, bshape, out_dim = layout
    res_ndim = x.ndim - covered + len(bshape)
    opts = []
    for d, o in out_dim.items():
        vd = o - (res_ndim - values.ndim)
        if vd < 0 or values.shape[vd] == 1:
            opts.append(_opt(schema, Shard(d), (x, Shard(d))))
        elif values.shape[vd] == x.shape[d]:
            opts.append(_opt(schema, Shard(d), (x, Shard(d)), (values, Shard(vd))))
    if covered == 1:
        opts.append(_opt(schema, Shard(first), (x, Shard(first))))
    if accumulate and _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM), (values, _SUM)))

    def make_local(blocks):
        xs, xo = blocks(x)
        if covered != 1 or xs[first] == x.shape[first]:
            return None
        start, size = xo[first], xs[first]

        def local(xl, ind, vals, *args, **kwargs):
            il = _wrapped(ind[first], x.shape[first])
            out = _with_scratch_row(xl, first)
            moved = [None] * first + [torch.where(_mask(il, start, size), il - start, size)]
            aten.index_put_.default(out, moved, vals, *args, **kwargs)
            return out.narrow(first, 0, size).contiguous()

        return local

    return _finish(schema, opts, None, make_local)


# --------------------------------------------------------------------------- *_scatter views


@register(aten.select_scatter.default)
def select_scatter_rule(schema: OpSchema) -> OutputSharding:
    x, src = schema.args[0], schema.args[1]
    dim = _dim(schema.args[2], x.ndim)
    index = schema.args[3] % x.shape[dim]
    opts = [
        _opt(schema, Shard(d), (x, Shard(d)), (src, Shard(d - (d > dim))))
        for d in range(x.ndim)
        if d != dim
    ]
    opts.append(_opt(schema, Shard(dim), (x, Shard(dim))))
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM), (src, _SUM)))

    def make_local(blocks):
        xs, xo = blocks(x)
        if xs[dim] == x.shape[dim]:
            return None
        start, size = xo[dim], xs[dim]
        if not start <= index < start + size:
            return lambda xl, *args, **kwargs: xl.clone()

        def local(xl, s, d, i):
            return aten.select_scatter.default(xl, s, d, index - start)

        return local

    return _finish(schema, opts, None, make_local)


@register(aten.slice_scatter.default)
def slice_scatter_rule(schema: OpSchema) -> OutputSharding:
    x, src = schema.args[0], schema.args[1]
    dim = _dim(_arg(schema, 2, "dim", 0), x.ndim)
    bounds = (_arg(schema, 3, "start"), _arg(schema, 4, "end"), _arg(schema, 5, "step", 1))
    opts = [
        _opt(schema, Shard(d), (x, Shard(d)), (src, Shard(d))) for d in range(x.ndim) if d != dim
    ]
    opts.append(_opt(schema, Shard(dim), (x, Shard(dim))))
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM), (src, _SUM)))

    def make_local(blocks):
        xs, xo = blocks(x)
        if xs[dim] == x.shape[dim]:
            return None
        start, size = xo[dim], xs[dim]
        rows = range(*slice(*bounds).indices(x.shape[dim]))
        mine = [k for k, r in enumerate(rows) if start <= r < start + size]
        if not mine:
            return lambda xl, *args, **kwargs: xl.clone()
        k0, k1 = mine[0], mine[-1] + 1
        first, last = rows[k0] - start, rows[k1 - 1] - start + 1

        def local(xl, s, *args, **kwargs):
            s = s.narrow(dim, k0, k1 - k0)
            return aten.slice_scatter.default(xl, s, dim, first, last, rows.step)

        return local

    return _finish(schema, opts, None, make_local)


@register_per_mesh_dim(aten.diagonal_scatter.default)
def diagonal_scatter_options(schema: OpSchema) -> list:
    x, src = schema.args[0], schema.args[1]
    d1 = _dim(_arg(schema, 3, "dim1", 0), x.ndim)
    d2 = _dim(_arg(schema, 4, "dim2", 1), x.ndim)
    opts = [
        _opt(schema, Shard(d), (x, Shard(d)), (src, Shard(d - (d > d1) - (d > d2))))
        for d in range(x.ndim)
        if d not in (d1, d2)
    ]
    if _sums_ok(schema):
        opts.append(_opt(schema, _SUM, (x, _SUM), (src, _SUM)))
    return opts
