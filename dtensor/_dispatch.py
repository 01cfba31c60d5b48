"""The ``__torch_dispatch__`` pipeline: validate, find the rule, redistribute, run, wrap.

1. Flatten ``(args, kwargs)``; every DTensor becomes its spec. A one-element plain tensor
   mixed in (a scalar, a single index) is taken as a replicated DTensor, as PyTorch does;
   any other plain tensor is rejected (the caller forgot to distribute it).
2. Find the op's rule. An op without one runs locally when every input is replicated (the
   answer is then the local answer on every rank); otherwise it is a
   ``NotImplementedError`` naming the op and the input placements.
3. Run the op on meta tensors of the global shapes: that gives every output's global shape,
   stride and dtype without communication.
4. Ask the rule for output placements and any input redistribution. Steps 3-4 are cached on
   the input specs and the non-tensor arguments.
5. Redistribute inputs, run the op (or the rule's ``local_fn``) on local tensors, wrap.

What dispatch needs to know about an op is read once, into its ``_OpFacts``; a call seen
before skips the pipeline ([Note: the dispatch fast path]).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dtensor import (
    _inplace,
    _ops,  # noqa: F401  (registers the rules)
)
from dtensor._ops._common import (
    VALUE_FREE_RULES,
    OpSchema,
    OutputSharding,
    find_rule,
    is_multi_tensor,
)
from dtensor._spec import DTensorSpec, TensorMeta
from dtensor.placement import Partial, Replicate, _StridedShard, format_placements
from dtensor.tensor import (
    DTensor,
    _new_dtensor,
    is_torch_dtensor,
    redistribute_dtensor,
    set_dispatch,
    torch_dtensor_message,
)

logger = logging.getLogger(__name__)
aten = torch.ops.aten

# [Note: dispatch caches live with their mesh] Both caches below (the pipeline's sharding
# decisions and the fast path's call signatures) hold DTensorSpecs, and a spec holds its mesh,
# which holds its process groups. Kept in module-level dicts they kept every mesh ever used
# alive, with its groups, until 8,192 entries filled them. So each root mesh keeps its own
# caches, in the resources the layers above keep with it (``mesh.resources``, shared by its
# slices: [Note: mesh resources] in ``device_mesh/resources.py``): an entry goes when its
# mesh does, as the rest of the mesh's runtime state. An op across mesh objects of several
# roots is keyed by those objects as well and lives with the first one's root, holding the
# others until it goes.
_LIMIT = 8192  # entries per cache of one root mesh; a full cache starts again empty
_ALL_CACHES: weakref.WeakSet = weakref.WeakSet()  # every mesh's, for clear_cache


class _MeshCaches:
    """One root mesh's dispatch caches, both keyed by ``_call_key`` ([Note: one cache key]);
    made by ``mesh.resources.get(_MeshCaches)`` on the mesh's first op."""

    __slots__ = ("rules", "fast", "__weakref__")

    def __init__(self) -> None:
        self.rules: dict = {}  # call key -> (OutputSharding, output metas)
        self.fast: dict = {}  # call key -> _Hit ([Note: the dispatch fast path])
        _ALL_CACHES.add(self)


def _caches_of(mesh) -> _MeshCaches:
    """``mesh``'s dispatch caches (its root's)."""
    return mesh.resources.get(_MeshCaches)


def _put(cache: dict, key, value) -> None:
    if len(cache) >= _LIMIT:
        cache.clear()
    cache[key] = value


def clear_cache() -> None:
    """Forget every cached sharding decision (the next op of each kind propagates again).

    Example:
        >>> clear_cache()   # benchmarks time a cache miss this way
    """
    for ref in list(_ALL_CACHES.data):  # one C-level copy: another thread may add meanwhile
        caches = ref()
        if caches is not None:
            caches.rules.clear()
            caches.fast.clear()


# Ops handled entirely by a function: fn(func, args, kwargs) -> result.
CUSTOM: dict = {}


def custom(*ops):
    def deco(fn):
        for op in ops:
            CUSTOM[op] = fn
        _FACTS.clear()  # the handler replaces whatever dispatch had decided for these ops
        return fn

    return deco


def dispatch(func, args, kwargs):
    """Run aten op ``func`` on DTensor arguments (``DTensor.__torch_dispatch__`` calls this).

    Example:
        >>> dispatch(torch.ops.aten.add.Tensor, (dt, dt), {})   # what dt + dt runs
    """
    facts = _FACTS.get(id(func))
    if facts is None:
        facts = _facts_of(func)
    if facts.custom is not None:
        return facts.custom(func, args, kwargs)
    if not facts.fast:
        return dispatch_by_rule(func, args, kwargs)
    signature = _call_key(func, args, kwargs, facts.value_free)
    key, mesh = signature
    if key is not None:
        try:
            hit = mesh.resources.get(_MeshCaches).fast.get(key)
        except TypeError:  # an unhashable argument (a symbolic size under tracing)
            hit, signature = None, _NO_KEY
        if hit is not None:
            return _run_hit(hit, args, kwargs)
    return dispatch_by_rule(func, args, kwargs, signature)


def dispatch_by_rule(func, args, kwargs, signature=None):
    """The pipeline without the custom handlers: what a handler calls for inputs it leaves to
    the ordinary rules. ``signature``: the call's ``_call_key``, if the caller has it.

    Example:
        >>> dispatch_by_rule(torch.ops.aten.add.Tensor, (dt, dt), {})
    """
    facts = _facts_of(func)
    if facts.reshapes:
        view = facts.reshape or _inplace.out_of_place_view(func)  # raises: not supported
        return _inplace.change_shape_in_place(func, view, args, kwargs)
    leaves, treespec = _flatten(args, kwargs)
    _check_inputs(func, leaves)
    if any(isinstance(x, DTensor) and x._spec.has_strided for x in leaves):
        leaves = _unstride_unless_kept(func, leaves, treespec)
    if not facts.multi:
        leaves = _replicate_scalars(func, leaves)
    if signature is None:
        signature = _call_key(func, args, kwargs, facts.value_free)
    key, mesh = signature
    rules = cached = None
    if key is not None:
        rules = mesh.resources.get(_MeshCaches).rules
        try:
            cached = rules.get(key)
        except TypeError:  # unhashable (a symbolic size under tracing): no entry
            key = rules = None
    if cached is None:
        if find_rule(func) is None:
            return _run_without_rule(func, leaves, treespec)
        try:
            cached = _propagate(func, leaves, treespec)
        except _ShapesUnknown:
            # x[bool_mask]: replicated inputs can still run, each rank on the whole tensors
            if all(x._spec.is_replicated() for x in leaves if isinstance(x, DTensor)):
                return _run_without_rule(func, leaves, treespec)
            raise
        if rules is not None:
            _put(rules, key, cached)
    sharding, out_meta = cached
    target = leaves[0] if facts.inplace and isinstance(leaves[0], DTensor) else None
    before = target.placements if target is not None else None
    out = _run(func, args, leaves, treespec, sharding, out_meta)
    # a call whose target was reduced where it lies (_reduce_target_in_place) is not
    # remembered: the fast path would replay it without the reduction
    if key is not None and facts.fast and (target is None or target.placements == before):
        _remember_hit(facts, key, mesh, args, kwargs, leaves, sharding, out)
    return out


class _FlatSpec(tuple):
    """The tree spec of ``(args, kwargs)`` holding no containers: ``(len(args), kwarg names)``.

    Most ops (every step of an optimizer) look like this; flattening them by hand skips
    pytree, which was half of the dispatch overhead of ``AdamW.step`` on DTensors.
    """


def _flatten(args, kwargs) -> tuple[list, object]:
    containers = (list, tuple, dict)
    if any(isinstance(a, containers) for a in args) or any(
        isinstance(v, containers) for v in kwargs.values()
    ):
        return tree_flatten((args, kwargs))
    return [*args, *kwargs.values()], _FlatSpec((len(args), tuple(kwargs)))


def _unflatten(leaves: list, treespec) -> tuple[tuple, dict]:
    if type(treespec) is _FlatSpec:
        n, names = treespec
        return tuple(leaves[:n]), dict(zip(names, leaves[n:], strict=True))
    return tree_unflatten(leaves, treespec)


def _replicate_scalars(func, leaves: list) -> list:
    """One-element plain tensors mixed with DTensors (and index tensors of index ops) become
    replicated DTensors (their value is the same everywhere), so every rule sees specs only;
    inside ``implicit_replication()`` so do plain tensors of any size (not on the meta
    device: those are left as they are outside it too, so a cached decision fits both).
    An in-place target must already be a DTensor: writing into a wrapped copy would silently
    lose the result."""
    mesh = None
    out = leaves
    facts = _facts_of(func)
    any_size = facts.index
    for i, x in enumerate(leaves):
        if (
            isinstance(x, torch.Tensor)
            and not isinstance(x, DTensor)
            # the flag is read only for a tensor _check_inputs let through because it was on
            and (any_size or x.numel() == 1 or (x.device.type != "meta" and _IMPLICIT.on))
        ):
            if mesh is None:
                mesh = next((y.device_mesh for y in leaves if isinstance(y, DTensor)), None)
                if mesh is None:
                    return leaves
                out = list(leaves)
            if i == 0 and facts.inplace:
                raise ValueError(
                    f"{func}: the in-place target is a plain torch.Tensor of shape "
                    f"{tuple(x.shape)} and the other operands are DTensors. Make the target "
                    "a DTensor (distribute_tensor) or use the out-of-place op."
                )
            spec = DTensorSpec(
                mesh,
                (Replicate(),) * mesh.ndim,
                TensorMeta(x.shape, tuple(x.stride()), x.dtype),
            )
            out[i] = DTensor(x, spec, requires_grad=False)
    return out


def _run_without_rule(func, leaves, treespec):
    """An op with no rule: computed locally when every input is replicated; an in-place or
    ``out=`` op on full tensors, each written shard keeping its block
    ([Note: writes through gathered views]); anything else refused."""
    dtensors = [x for x in leaves if isinstance(x, DTensor)]
    replicated = all(x._spec.is_replicated() for x in dtensors)
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise NotImplementedError(_no_rule_message(func, leaves))
    args, kwargs = _unflatten(leaves, treespec)
    written = _inplace.written_dtensors(func, args, kwargs)
    if written and not replicated:
        return _inplace.run_writing_op_on_full(
            func, args, kwargs, leaves, lambda flat: _unflatten(flat, treespec)
        )
    if not replicated:
        raise NotImplementedError(_no_rule_message(func, leaves))
    local_leaves = [x._local() if isinstance(x, DTensor) else x for x in leaves]
    local_args, local_kwargs = _unflatten(local_leaves, treespec)
    out = func(*local_args, **local_kwargs)
    for t in written:
        _inplace.write_back(t)
    returns = func._schema.returns
    if written and all(r.alias_info is not None and r.alias_info.is_write for r in returns):
        # it returns what it wrote (add_, out=); an op that writes some arguments and
        # returns new tensors (batch norm's running statistics) is wrapped below
        if not returns:
            return None
        return written[0] if len(written) == 1 else tuple(written)
    mesh = dtensors[0].device_mesh
    placements = (Replicate(),) * mesh.ndim

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            meta = TensorMeta(t.shape, tuple(t.stride()), t.dtype)
            return DTensor(t, DTensorSpec(mesh, placements, meta), requires_grad=False)
        return t

    return tree_map(wrap, out)


class _ShapesUnknown(NotImplementedError):
    """The op's output shapes could not be derived on meta tensors (they depend on the
    values, as ``x[bool_mask]``'s do, or the op has no meta kernel)."""


def _propagate(func, leaves, treespec):
    # A distinct spec object per leaf, so rules can find a leaf by identity even when the
    # same DTensor is passed twice (x * x).
    spec_leaves = [dataclasses.replace(x._spec) if isinstance(x, DTensor) else x for x in leaves]
    try:
        out_meta = _meta_outputs(func, leaves, treespec)
    except (RuntimeError, NotImplementedError) as e:
        raise _ShapesUnknown(
            f"{_no_rule_message(func, leaves, has_rule=True)} (its output shapes could not "
            f"be derived from the global input shapes: {e})"
        ) from e
    rule = find_rule(func)
    args, kwargs = _unflatten(spec_leaves, treespec)
    schema = OpSchema(func, args, kwargs, spec_leaves, out_meta)
    sharding = rule(schema)
    return sharding, out_meta


def _run(func, args, leaves, treespec, sharding: OutputSharding, out_meta):
    facts = _facts_of(func)
    inplace = facts.inplace
    local_leaves = []
    for i, x in enumerate(leaves):
        if isinstance(x, DTensor):
            want = sharding.input_placements.get(i)
            if want is not None and tuple(want) != x.placements:
                if inplace and i == 0:
                    if not _reduce_target_in_place(x, tuple(want)):
                        partial = any(isinstance(p, Partial) for p in x.placements)
                        raise NotImplementedError(
                            f"{func}: the in-place target has placements "
                            f"{format_placements(x.placements)} but the op needs "
                            f"{format_placements(want)}; use the out-of-place op instead."
                            + (
                                " (A Partial target is reduced where it lies only when no "
                                "view shares its memory: reduce it first with "
                                "redistribute(placements=[Replicate()]).)"
                                if partial
                                else ""
                            )
                        )
                else:
                    x = redistribute_dtensor(x, want)
            x = x._local()
        local_leaves.append(x)
    local_args, local_kwargs = _unflatten(local_leaves, treespec)
    out = (sharding.local_fn or func)(*local_args, **local_kwargs)
    if inplace:
        # The local op ran below autograd, which left the local tensors' version counters
        # alone; bump them as a plain in-place op would, so a write through a tensor that
        # shares one (``p.data``'s local, ``to_local()``) is seen by whoever checks it.
        written = local_args[0]
        torch.autograd.graph.increment_version(
            [t for t in written if isinstance(t, torch.Tensor)]
            if isinstance(written, (list, tuple))
            else written
        )
        target = args[0]
        if getattr(target, "_view_of", None) is not None:
            _inplace.write_back(target)
        return target if facts.returns else None
    if facts.writes_out:
        # ``out=`` DTensors: bump their versions as a plain write would, and carry the write
        # up a gathered view's chain ([Note: writes through gathered views])
        for t in _inplace.written_dtensors(func, *_unflatten(leaves, treespec)):
            torch.autograd.graph.increment_version(t._local())
            if getattr(t, "_view_of", None) is not None:
                _inplace.write_back(t)
    wrapped = _wrap(out, sharding, out_meta, leaves)
    if isinstance(leaves[0], DTensor) and facts.view:
        outs = list(wrapped) if isinstance(wrapped, (list, tuple)) else [wrapped]
        _inplace.record_view(func, args, lambda: _unflatten(leaves, treespec)[1], leaves[0], outs)
    return wrapped


def _reduce_target_in_place(target: DTensor, want: tuple) -> bool:
    """Reduce the Partial mesh dims of an in-place target where it lies, when the op's rule
    needs them replicated (``clamp_min_`` on a partial norm, ``add_`` of a number to a
    partial sum, as ``cosine_similarity`` and ``rms_norm`` decompose): the reduction leaves
    the target's value as it is, so its local tensor is overwritten with the reduced one
    and its placements become ``want``. Only when that is all the rule asks (Partial ->
    Replicate) and the local tensor is not a view of another tensor (whose Partial
    placements would then hold replicated values). Returns whether it did."""
    have = target.placements
    if target._view_of is not None or any(
        h != w and not (isinstance(h, Partial) and isinstance(w, Replicate))
        for h, w in zip(have, want, strict=True)
    ):
        return False
    local = target._local()
    # Decided from what every rank shares (the op sequence that made the target), never
    # from rank-local facts such as how many references hold its memory: ranks deciding
    # differently would enter different collectives. A local tensor that is a view of
    # another DTensor's block would leave that base partial over replicated values.
    if local._base is not None:
        return False
    reduced = redistribute_dtensor(target, want)._local()
    with torch.no_grad():
        local.copy_(reduced)
    target._spec = target._spec.with_placements(want)
    return True


def _wrap(out, sharding: OutputSharding, out_meta, leaves):
    """Wrap local outputs; ``out_meta`` and the rule's placements align with its leaves."""
    default_mesh = next(x for x in leaves if isinstance(x, DTensor)).device_mesh
    meshes = sharding.output_meshes or [default_mesh] * len(out_meta)
    flat, spec = tree_flatten(out)
    wrapped = []
    for j, item in enumerate(flat):
        if isinstance(item, torch.Tensor):
            meta = out_meta[j]
            dspec = DTensorSpec(
                meshes[j],
                tuple(sharding.output_placements[j]),
                TensorMeta(meta.shape, tuple(meta.stride()), meta.dtype),
            )
            item = _new_dtensor(DTensor, item, dspec, False)
        wrapped.append(item)
    return tree_unflatten(wrapped, spec)


def _meta_outputs(func, leaves, treespec) -> list:
    """The op run on meta tensors of the global shapes: one entry per output leaf."""

    def to_meta(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    margs, mkwargs = _unflatten([to_meta(x) for x in leaves], treespec)
    if mkwargs.get("device") is not None:
        # empty_like(x, device="cpu") (as module.to_empty() calls it) would otherwise
        # allocate a real tensor of the *global* shape here, and the cache would keep it.
        mkwargs = {**mkwargs, "device": torch.device("meta")}
    out = func(*margs, **mkwargs)
    if _facts_of(func).inplace:
        return []
    flat, _ = tree_flatten(out)
    return [to_meta(m) if isinstance(m, torch.Tensor) else None for m in flat]


def _writes_first_argument(func) -> bool:
    schema = func._schema
    if not schema.arguments:
        return False
    first = schema.arguments[0].alias_info
    return bool(first is not None and first.is_write) and not schema.name.endswith("_out")


class _ImplicitReplication(threading.local):
    """Whether this thread is inside ``dtensor.experimental.implicit_replication()`` (a
    per-thread flag, as PyTorch's). Read only where a plain tensor would be refused, so an
    op outside the context pays nothing for it. Calls with such a tensor never get a fast
    path entry (``_remember_hit``) and the pipeline checks them before its cache, so a
    decision made inside the context is never served outside it, nor the other way."""

    on = False


_IMPLICIT = _ImplicitReplication()


def _check_inputs(func, leaves) -> None:
    meshes = []
    facts = _facts_of(func)
    indices_ok = facts.index
    for x in leaves:
        if isinstance(x, DTensor):
            meshes.append(x.device_mesh)
        elif indices_ok:
            continue  # index tensors: taken as replicas (see dtensor/_inplace.py)
        elif is_torch_dtensor(x):
            raise ValueError(torch_dtensor_message(str(func), "an input", x))
        elif isinstance(x, torch.Tensor) and x.numel() != 1 and x.device.type != "meta":
            if _IMPLICIT.on and not facts.multi:
                continue  # implicit_replication(): _replicate_scalars makes it a replica
            # ValueError, not TypeError: operator wrappers (a + b) turn a TypeError into
            # NotImplemented and the message would be lost.
            raise ValueError(_mixed_message(func, x))
    if facts.multi:
        return  # tensors of different list positions may live on different meshes
    first = meshes[0]
    for m in meshes[1:]:
        if m is not first and m != first:
            raise ValueError(
                f"{func}: all DTensor inputs must be on one mesh, got {first!r} and {m!r}. "
                "Redistribute to a common mesh first (full_tensor() + distribute_tensor())."
            )


def _mixed_message(func, x: torch.Tensor) -> str:
    """Why a tensor that is not one of our DTensors met DTensors, and what to do (built only
    when raising: the check above is on every op's path)."""
    kind = type(x)
    if kind.__name__ == "DTensor" and kind.__module__.startswith("torch."):
        return (
            f"{func}: got PyTorch's DTensor ({kind.__module__}.DTensor) of shape "
            f"{tuple(x.shape)} mixed with this library's DTensors. The two libraries' "
            "tensors do not mix: build every DTensor (and fully_shard / parallelize_module) "
            "with one of them, or convert with dtensor.DTensor.from_local(t.to_local(), mesh, "
            "placements)."
        )
    return (
        f"{func}: got a plain torch.Tensor of shape {tuple(x.shape)} mixed with DTensors. Only "
        "one-element tensors may be mixed in; convert the tensor with distribute_tensor(t, "
        "mesh, placements) or DTensor.from_local(...). Likely causes: a parameter of a "
        "fully_shard module read while it is sharded, outside its forward or backward (call "
        "module.unshard() first, or take param.full_tensor()); a module's code run outside "
        "its own forward (a recomputation, a hook or another method re-running part of the "
        "forward: register_fsdp_forward_method runs the hooks around another method); or "
        "tensors of two libraries mixed (PyTorch's fully_shard, DTensor or parallelize_module "
        "with this library's). If the tensor holds the same values on every rank, run the op "
        "inside dtensor.experimental.implicit_replication(), which takes plain tensors as "
        "replicated DTensors (not for _foreach_ ops)."
    )


def _keeps_strided(func, leaves, treespec) -> bool:
    """Whether ``func``'s rule keeps a ``_StridedShard`` input's layout as it is: elementwise
    ops and the optimizer's foreach ops do (same placements in, same out), and so do
    reductions to a scalar (only partials come out). Other rules build plain ``Shard``
    outputs, which would misplace a strided shard."""
    name = getattr(find_rule(func), "__name__", "")
    if name in (
        "pointwise_rule",
        "foreach_rule",
        "identity_rule",
        "foreach_norm_rule",
        "foreach_max_rule",
        "random_inplace",
    ):
        return True
    if name in ("vector_norm_rule", "sum_mean_rule", "max_min_rule"):
        return all(m.ndim == 0 for m in _meta_outputs(func, leaves, treespec))
    return False


def _unstride_unless_kept(func, leaves: list, treespec) -> list:
    """Gather the strided shards of inputs whose layout ``func`` would not keep ([Note:
    nested shards] in ``_redistribute.py``), so every other rule sees plain placements."""
    if _keeps_strided(func, leaves, treespec):
        return leaves
    if _facts_of(func).inplace and isinstance(leaves[0], DTensor) and leaves[0]._spec.has_strided:
        raise NotImplementedError(
            f"{func}: in-place on a DTensor with placements "
            f"{format_placements(leaves[0].placements)} is supported only for elementwise ops; "
            "redistribute it to plain Shard/Replicate placements first."
        )
    out = []
    for x in leaves:
        if isinstance(x, DTensor) and x._spec.has_strided:
            plain = tuple(Replicate() if isinstance(p, _StridedShard) else p for p in x.placements)
            x = redistribute_dtensor(x, plain)
        out.append(x)
    return out


def _no_rule_message(func, leaves, *, has_rule: bool = False) -> str:
    specs = [
        f"{tuple(x.shape)} {format_placements(x.placements)}"
        for x in leaves
        if isinstance(x, DTensor)
    ]
    head = (
        f"DTensor {'cannot shard' if has_rule else 'has no sharding rule for'} {func} "
        f"(inputs: {', '.join(specs)}). Call full_tensor() and run the op on plain tensors"
    )
    if has_rule:  # its output shapes could not be derived: a rule would not help
        return (
            f"{head}, redistribute the inputs to Replicate(), or add a rule in dtensor/_ops. "
            "A custom op needs a fake kernel (torch.library.register_fake) for DTensor to "
            "derive its output shapes."
        )
    return (
        f"{head} (mixed with other DTensors inside "
        "dtensor.experimental.implicit_replication(), which takes plain tensors as "
        "replicated), redistribute the inputs to Replicate(), or register a rule with "
        "dtensor.experimental.register_sharding(op) (or add one in dtensor/_ops)."
    )


# --------------------------------------------------------------------------- facts and keys
# [Note: one record per op] Everything dispatch asks about an op - its custom handler,
# whether its rule keys numbers by type alone, whether it writes its first argument, returns
# a view of it or changes its shape in place, takes index tensors or position-wise tensor
# lists - comes from the op's schema, tags and rule, and is read once, into the op's
# ``_OpFacts``: one record per op in one table, ``_FACTS`` (``custom`` empties it, so a
# handler registered later is seen).

_FACTS: dict = {}  # id(op) -> _OpFacts (the entry keeps the op alive, so the id stays its own)


class _OpFacts:
    """What dispatch needs about one op, looked up once ([Note: one record per op])."""

    __slots__ = (
        "func",
        "custom",
        "value_free",
        "inplace",
        "returns",
        "view",
        "reshapes",
        "reshape",
        "index",
        "multi",
        "writes_out",
        "fast",
    )

    def __init__(self, func):
        self.func = func
        self.custom = CUSTOM.get(func)  # a handler that replaces the pipeline
        # keys hold an int's or a float's type, not its value (VALUE_FREE_RULES)
        self.value_free = find_rule(func) in VALUE_FREE_RULES
        self.inplace = _writes_first_argument(func)
        self.returns = bool(func._schema.returns)
        self.view = _inplace.is_view_op(func)  # returns views of its first argument
        self.reshapes = torch.Tag.inplace_view in func.tags  # t_, squeeze_, ...
        try:
            self.reshape = _inplace.out_of_place_view(func)  # t for t_, ...
        except NotImplementedError:
            self.reshape = None  # unsupported: the pipeline raises the error on every call
        self.index = func in _inplace.INDEX_OPS  # its plain tensors are indices
        self.multi = is_multi_tensor(func)  # _foreach_*: positions may sit on other meshes
        # writes an argument other than the first (``out=``): the write must reach gathered views
        self.writes_out = not self.inplace and any(
            a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments
        )
        self.fast = (
            self.custom is None
            and not self.reshapes
            and not self.multi
            and not self.index
            and not self.writes_out
        )


def _facts_of(func) -> _OpFacts:
    facts = _FACTS.get(id(func))
    if facts is None:
        facts = _FACTS[id(func)] = _OpFacts(func)
    return facts


# [Note: one cache key] Both caches of a root mesh - the pipeline's sharding decisions and the
# fast path's hits - are keyed by the call signature, ``_call_key``: the op, the first
# top-level DTensor's mesh object, each DTensor's spec (after the id of its mesh object where
# that is another one: an equal mesh of another root is another mesh to fsdp2 and tensor
# parallelism), each other tensor's type, shape, stride, dtype and device type, and every
# other value with its type (``x * 2`` and ``x * 2.0`` differ in dtype; under a value-free
# rule an int or a float is its type alone). Containers holding tensors are nested tuples and
# keyword arguments go by name, so the key determines how the call flattens and all the
# pipeline does to it before it asks the rule (which plain tensors become replicas, which
# strided shards are gathered). Every id in a key belongs to an object the entry keeps
# alive: the op (``_FACTS``; an OpOverload lives as long as torch.ops) and the meshes (the
# key's specs hold them).

_NUMBERS = (int, float)
_NO_KEY = (None, None)
_SEQUENCES = (list, tuple)
_NESTED = (torch.Tensor, list, tuple, dict)


def _call_key(func, args, kwargs, free: bool):
    """``(key, mesh)`` of ``func(*args, **kwargs)`` ([Note: one cache key]; ``free``: the
    op's rule is value-free), ``mesh`` holding the caches of its entries; ``(None, None)``
    for a call without DTensors. Top-level DTensors and plain values are the fast path's
    case and are encoded inline; everything else goes through ``_nested_part``."""
    parts = []
    mesh = None
    for a in args:
        if type(a) is DTensor:
            spec = a._spec
            if mesh is None:
                # the outputs live on the first input's mesh, that object: an equal mesh
                # sliced from another root is another mesh to fsdp2 and tensor parallelism
                mesh = spec.mesh
            elif spec.mesh is not mesh:  # another mesh object: the entry is for that one
                parts.append(id(spec.mesh))
            parts.append(spec)
        elif isinstance(a, _SEQUENCES) and not any(isinstance(v, _NESTED) for v in a):
            values = tuple(None if free and type(v) in _NUMBERS else v for v in a)
            parts.append((type(a), values, tuple(map(type, a))))
        elif isinstance(a, _NESTED):
            parts.append(_nested_part(a, free))
        elif free and type(a) in _NUMBERS:
            parts.append((None, type(a)))
        else:
            parts.append((a, type(a)))
    if mesh is None:
        mesh = _first_mesh((args, kwargs))
        if mesh is None:
            return _NO_KEY
    if not kwargs:
        return (id(func), id(mesh), tuple(parts)), mesh
    named = []
    for k, v in kwargs.items():
        if isinstance(v, _NESTED):
            named.append((k, _nested_part(v, free)))
        else:
            named.append((k, None if free and type(v) in _NUMBERS else v, type(v)))
    return (id(func), id(mesh), tuple(parts), tuple(named)), mesh


def _nested_part(x, free: bool):
    """The key part of a value that is not a top-level DTensor: a DTensor in a container
    (its mesh object's id, then its spec), another tensor, or a container, recursively."""
    if isinstance(x, torch.Tensor):
        if isinstance(x, DTensor):
            return (type(x), id(x._spec.mesh), x._spec)
        stride = tuple(x.stride()) if x.layout is torch.strided else x.layout
        return (type(x), tuple(x.shape), stride, x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return (type(x), *[_nested_part(v, free) for v in x])
    if isinstance(x, dict):
        return (dict, *[(k, _nested_part(v, free)) for k, v in x.items()])
    if free and type(x) in _NUMBERS:
        return (None, type(x))
    return (x, type(x))


def _first_mesh(x):
    """The mesh of the first DTensor in ``x``, searched through containers; None if none."""
    if isinstance(x, DTensor):
        return x._spec.mesh
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    for v in values:
        mesh = _first_mesh(v)
        if mesh is not None:
            return mesh
    return None


# --------------------------------------------------------------------------- the fast path
# [Note: the dispatch fast path] The pipeline above costs tens of microseconds of Python per
# op even when its cache answers: flattening, input checks, redistribution planning, wrapping
# through ``DTensor.__new__``. Once an op has run with some input specs and non-tensor
# arguments, everything it needs next time with the same ones is known: which arguments move
# to which placements (usually none), the function to run on the local tensors, and each
# output's spec. Each root mesh's ``fast`` cache (``_MeshCaches``) keeps that per call key
# ([Note: one cache key]), and a hit only swaps the DTensors for their local tensors, runs,
# and wraps the outputs in the very spec objects of the first call (so later keys compare by
# identity and their hashes are already computed). Only calls whose tensors are all
# top-level DTensors get an entry: plain tensors mixed in, tensors inside lists, strided
# shards, custom handlers and ops without a rule keep to the pipeline, which checks and
# converts them on every call. Every check of the pipeline depends only on what the key
# holds, so a call that hits would have passed them; the first call, which made the entry,
# did.


class _Hit:
    """A cached call signature: see [Note: the dispatch fast path]."""

    __slots__ = ("func", "run", "dtensors", "moves", "outs", "seq", "inplace", "returns", "view")


def _only_top_level_dtensors(args, kwargs) -> bool:
    """Whether every tensor of the call is a DTensor (not a subclass) passed as an argument
    of its own: the calls ``_run_hit`` can run."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not DTensor:
                return False
        elif isinstance(a, dict):
            return False
        elif isinstance(a, (list, tuple)) and any(isinstance(v, _NESTED) for v in a):
            return False
    return not any(isinstance(v, _NESTED) for v in kwargs.values())


def _remember_hit(facts, key, mesh, args, kwargs, leaves, sharding, out) -> None:
    """After an op ran through the pipeline: keep what a repeat of this call needs, under its
    call key in ``mesh``'s fast cache."""
    if not _only_top_level_dtensors(args, kwargs) or any(
        x._spec.has_strided for x in leaves if isinstance(x, DTensor)
    ):
        return
    hit = _Hit()
    hit.func = facts.func
    hit.run = sharding.local_fn or facts.func
    hit.dtensors = tuple(i for i, a in enumerate(args) if isinstance(a, DTensor))
    # the k-th DTensor of args is the k-th DTensor leaf: none sits inside a container
    leaf_of = [i for i, x in enumerate(leaves) if isinstance(x, DTensor)]
    moves = []
    for pos, leaf in zip(hit.dtensors, leaf_of, strict=True):
        want = sharding.input_placements.get(leaf)
        if want is not None and tuple(want) != args[pos].placements:
            moves.append((pos, tuple(want)))
    hit.moves = tuple(moves)
    hit.inplace = facts.inplace
    hit.returns = facts.returns
    hit.view = bool(hit.dtensors) and hit.dtensors[0] == 0 and facts.view
    hit.seq = None
    if hit.inplace:
        if not isinstance(args[0], DTensor):
            return
        hit.outs = None
    elif isinstance(out, DTensor):
        hit.outs = out._spec
    elif type(out) in (list, tuple) and all(
        isinstance(o, DTensor) or not isinstance(o, _NESTED) for o in out
    ):
        hit.seq = type(out)
        hit.outs = tuple(o._spec if isinstance(o, DTensor) else None for o in out)
    else:
        return
    _put(mesh.resources.get(_MeshCaches).fast, key, hit)


def _run_hit(hit: _Hit, args, kwargs):
    """``_run`` for a call whose signature ``hit`` has seen before."""
    local = list(args)
    if hit.moves:
        moved = list(args)
        for pos, want in hit.moves:
            moved[pos] = redistribute_dtensor(args[pos], want)
        for i in hit.dtensors:
            local[i] = moved[i]._local()
    else:
        for i in hit.dtensors:
            a = args[i]
            local[i] = a._local_value if a._pending is None else a._local()
    out = hit.run(*local, **kwargs)
    if hit.inplace:
        # as in _run: bump the version counter, carry a write through a gathered view back
        torch.autograd.graph.increment_version(local[0])
        target = args[0]
        if target._view_of is not None:
            _inplace.write_back(target)
        return target if hit.returns else None
    if hit.seq is None:
        wrapped = _new_dtensor(DTensor, out, hit.outs, False)
        # record_view links nothing to a base that is no view when the output aliases it
        if hit.view and (
            args[0]._view_of is not None
            or not _shares_memory(out, args[0]._local_value)  # resolved above
        ):
            _inplace.record_view(hit.func, args, lambda: kwargs, args[0], [wrapped])
        return wrapped
    wrapped = hit.seq(
        _new_dtensor(DTensor, o, spec, False) if isinstance(o, torch.Tensor) else o
        for o, spec in zip(out, hit.outs, strict=True)
    )
    if hit.view:
        _inplace.record_view(hit.func, args, lambda: kwargs, args[0], list(wrapped))
    return wrapped


_shares_memory = torch._C._is_alias_of  # as _inplace._shares_memory


# --------------------------------------------------------------------------- custom handlers
@custom(aten.equal.default)
def _equal(func, args, kwargs):
    """Global equality: compare local pieces in a common layout, then agree over all ranks."""
    from dtensor import _collectives as C
    from dtensor.placement import Partial, Replicate

    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise TypeError(
            f"{func}: both operands must be DTensors, got {type(a).__name__} and "
            f"{type(b).__name__}."
        )
    _check_inputs(func, [a, b])
    if a.shape != b.shape:
        return False
    target = tuple(Replicate() if isinstance(p, Partial) else p for p in a.placements)
    a, b = redistribute_dtensor(a, target), redistribute_dtensor(b, target)
    flag = torch.tensor([1 if torch.equal(a._local(), b._local()) else 0])
    mesh = a.device_mesh
    for mesh_dim in range(mesh.ndim):
        flag = C.all_reduce(flag, mesh, mesh_dim, Partial("min")).wait()
    return bool(flag.item())


@custom(aten._local_scalar_dense.default)
def _item(func, args, kwargs):
    """``.item()``: the global value, replicated first if needed."""
    from dtensor.placement import Replicate

    x = args[0]
    x = redistribute_dtensor(x, (Replicate(),) * x.device_mesh.ndim)
    return func(x._local())


@custom(aten.is_same_size.default)
def _is_same_size(func, args, kwargs):
    return tuple(args[0].shape) == tuple(args[1].shape)


set_dispatch(dispatch)  # [Note: the dispatcher is set from above] in dtensor/tensor.py
