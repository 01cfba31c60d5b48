"""In-place writes that the local shards alone cannot carry.

[Note: writes through gathered views] A view of a sharded DTensor is a view of the local
shard only when every rank's block maps onto a block of the view (``w.t()``, ``w.view(...)``
on whole chunks). Otherwise the view's rule gathers its input first (``weight[padding_idx]``
selects a row that one rank holds; ``dirac_`` indexes across the sharded dim), and the result
shares no memory with the shard: an in-place write into it would be lost silently. So a view
whose local result does not alias its input's local tensor - or that is a view of such a view
- records ``_view_of = (base, replay, detached)``, and an in-place write into it is carried
back: the base is gathered, ``replay`` (the same view op on the full tensor) selects the
region, the written values are copied in, and each rank keeps its block again. This is a
collective per link, which is why ordinary views (that alias) record nothing.

In-place and ``out=`` ops with no sharding rule (``index_put_``, ``eye(out=)``) are run the
same way: every DTensor operand gathered, the op run on full tensors, each written tensor's
block copied back. Index tensors may be plain tensors there: they must hold the same values
on every rank, as any replicated value does.
"""

from __future__ import annotations

import torch

from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, format_placements
from dtensor.tensor import DTensor, redistribute_dtensor

aten = torch.ops.aten

# Ops whose plain-tensor operands are indices (the same on every rank): taken as replicas.
INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten.index_select.default,
    aten.index_add_.default,
    aten.index_copy_.default,
    aten.index_fill_.int_Scalar,
}


def is_view_op(func) -> bool:
    """Whether ``func`` returns views of its first argument (``select``, ``view``, ...), read
    from its schema (dispatch asks once per op: ``_OpFacts`` in ``dtensor/_dispatch.py``).

    Example:
        >>> is_view_op(torch.ops.aten.select.int), is_view_op(torch.ops.aten.add.Tensor)
        (True, False)
    """
    schema = func._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    out = schema.returns[0].alias_info if schema.returns else None
    return bool(first is not None and out is not None and not first.is_write)


def written_dtensors(func, args, kwargs) -> list[DTensor]:
    """The DTensor arguments ``func`` writes (in-place target, ``out=`` tensors)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        out += [v for v in values if isinstance(v, DTensor)]
    return out


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    # storage identity, not data pointers: it also answers for the fake and functional
    # tensors torch.compile traces with, which have no data
    return torch._C._is_alias_of(a, b)


def record_view(func, args, get_kwargs, base: DTensor, outputs: list) -> None:
    """Link the DTensor ``outputs`` of view op ``func`` to ``base`` when a write into them
    could not reach ``base`` through shared memory ([Note: writes through gathered views]).
    ``get_kwargs()`` gives the op's keyword arguments (built only when a link is made)."""
    base_local = base._local()
    for j, out in enumerate(outputs):
        if not isinstance(out, DTensor):
            continue
        detached = not _shares_memory(out._local(), base_local)
        if detached or base._view_of is not None:
            how = (func, tuple(args[1:]), dict(get_kwargs()), j, len(outputs))
            out._view_of = (base, how, detached)


def _replay(full: torch.Tensor, how) -> torch.Tensor:
    func, rest, kwargs, j, n = how
    out = func(full, *rest, **kwargs)
    return out[j] if n > 1 or isinstance(out, (list, tuple)) else out


def write_back(target: DTensor) -> None:
    """Carry an in-place write into ``target`` up its chain of gathered views."""
    link = getattr(target, "_view_of", None)
    while link is not None:
        base, how, detached = link
        if detached:
            full = _full(base, "an in-place write into one of its views")
            region = _replay(full, how)
            region.copy_(_full(target, "a view written in place"))
            _keep_block(base, full)
        target, link = base, getattr(base, "_view_of", None)


def _full(dt: DTensor, why: str) -> torch.Tensor:
    if any(isinstance(p, Partial) for p in dt.placements):
        raise NotImplementedError(
            f"DTensor: {why} needs the full value of a DTensor with placements "
            f"{format_placements(dt.placements)}; reduce its Partial dims first "
            "(redistribute to Replicate())."
        )
    return redistribute_dtensor(dt, (Replicate(),) * dt.device_mesh.ndim)._local()


def _keep_block(dt: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's block of ``full`` into ``dt``'s local tensor."""
    spec: DTensorSpec = dt._spec
    shape, offset = spec.local_shape_and_offset()
    box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    dt._local().copy_(full[box])


def run_writing_op_on_full(func, args, kwargs, leaves, unflatten):
    """An in-place or ``out=`` op with no rule: run it on the full tensors, keep each written
    tensor's block. Returns what ``func`` returns, with the written DTensors in place of
    their full local copies."""
    written = written_dtensors(func, args, kwargs)
    full_leaves = [
        _full(x, f"{func} (no sharding rule)") if isinstance(x, DTensor) else x for x in leaves
    ]
    full_args, full_kwargs = unflatten(full_leaves)
    func(*full_args, **full_kwargs)
    by_id = {id(x): f for x, f in zip(leaves, full_leaves, strict=True) if isinstance(x, DTensor)}
    for t in written:
        _keep_block(t, by_id[id(t)])
        write_back(t)
    if not func._schema.returns:
        return None
    return written[0] if len(written) == 1 else tuple(written)


def out_of_place_view(func):
    """For an op that changes a tensor's shape in place (``t_``, ``transpose_``,
    ``squeeze_``...: PyTorch's ``inplace_view`` tag), its out-of-place view; None otherwise
    (dispatch asks once per op: ``_OpFacts`` in ``dtensor/_dispatch.py``).

    Raises:
        NotImplementedError: an in-place view with no out-of-place counterpart.

    Example:
        >>> out_of_place_view(torch.ops.aten.t_.default)
        <OpOverload(op='aten.t', overload='default')>
    """
    if torch.Tag.inplace_view not in func.tags:
        return None
    packet = getattr(aten, func.overloadpacket.__name__.rstrip("_"), None)
    view = getattr(packet, func._overloadname, None) if packet is not None else None
    if view is None or torch.Tag.inplace_view in view.tags:
        raise NotImplementedError(f"DTensor: {func} (an in-place view) is not supported.")
    return view


def change_shape_in_place(func, view, args, kwargs) -> DTensor:
    """Run ``func`` (e.g. ``t_``) on a DTensor: its out-of-place ``view`` gives the new local
    tensor and spec, and the wrapper's own sizes and strides are updated the way PyTorch
    updates wrapper subclasses (the op re-run on the metadata alone)."""
    target = args[0]
    result = view(*args, **kwargs)
    target._local_tensor = result._local()
    target._spec = result._spec
    target._view_of = None
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    return target
