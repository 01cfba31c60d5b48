"""Pointwise ops (unary, binary with broadcasting, in-place, ``out=``) and their ``_foreach_``
forms.

An op that computes each output element from the input elements at the same (broadcast)
position gives the same answer on a block of its inputs as on the whole: so a ``Shard(d)``
of the output needs only the same block of every input (an input that broadcasts along
``d`` is needed whole). Per mesh dim the output placement is chosen, then every input is
asked for the placement that produces it:

- a ``Partial`` survives only ops that are linear in it: ``a + b`` with both partial alike,
  ``a * r`` / ``a / r`` with ``r`` replicated or a python number, ``-a``, a constant scale
  (``deg2rad``), ``complex(re, im)`` with both partial alike. Anything else reduces the
  partial first (all-reduce or reduce-scatter): ``exp(a) + exp(b) != exp(a + b)``.
- otherwise the first input sharded on a dim that is not broadcast decides ``Shard(d)``,
  and inputs that broadcast along ``d`` are replicated;
- in-place ops keep the target's placements (the target is never redistributed), and an
  ``out=`` op keeps those of its ``out`` tensors, which must have the result's shape.

Which ops: every aten overload tagged ``torch.Tag.pointwise`` (the tag PyTorch gives
elementwise ops) that returns tensors only, draws no random numbers and writes no argument
other than its in-place target or ``out=``, unless another rule covers it; plus the ops
named in ``_UNARY`` / ``_BINARY`` below, elementwise ops without the tag (most activation
backwards, ``_prelu_kernel``: its weight broadcasts, and autograd sums the weight's
gradient over the broadcast dims afterwards). Adding one is adding its name to a list. An
op whose output has its own shape or mixes positions (``glu`` halves a dim) needs a rule of
its own: see the end of the file.
Random elementwise ops live in ``random.py``: their values are not a function of the block.

The sweep over the tag registers overloads, and it runs when this module is imported: a
module imported later that wants its own rule for a tagged op must register the overload
(which replaces this one), not the overload packet (which an overload entry shadows).
"""

from __future__ import annotations

import torch

from dtensor._ops._common import (
    VALUE_FREE_RULES,
    OpSchema,
    Option,
    OutputSharding,
    find_rule,
    map_to,
    register,
    register_per_mesh_dim,
    with_dim,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, Shard, is_shard_like

aten = torch.ops.aten

# Overload packets registered whole, in-place forms (name + "_") included. The tag sweep
# finds most elementwise ops by itself; these are the ones it misses (untagged) and the
# ones registered before it existed.
_UNARY = """abs acos acosh asin asinh atan atanh bitwise_not ceil cos cosh erf erfc erfinv exp
exp2 expm1 floor frac isfinite isinf isnan isneginf isposinf log log10 log1p log2
logical_not neg nan_to_num reciprocal relu round rsqrt sigmoid sign sgn silu gelu sin sinh
sqrt square tan tanh trunc clamp clamp_min clamp_max hardtanh leaky_relu elu mish softplus
pow logit fill zero zeros_like ones_like empty_like full_like copy
_conj conj_physical resolve_conj _neg_view resolve_neg
hardswish log_sigmoid_forward celu selu hardsigmoid hardshrink softshrink threshold
""".split()
_BINARY = """add sub rsub mul div true_divide floor_divide remainder fmod maximum minimum atan2
eq ne lt le gt ge logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor
lerp addcmul addcdiv where masked_fill threshold_backward gelu_backward silu_backward
sigmoid_backward tanh_backward hardtanh_backward leaky_relu_backward copysign xlogy hypot
complex polar _prelu_kernel elu_backward softplus_backward mish_backward hardsigmoid_backward
hardswish_backward hardshrink_backward softshrink_backward log_sigmoid_backward
rrelu_with_noise_backward native_dropout_backward logit_backward _prelu_kernel_backward
""".split()

# linearity of an op in its (single) partial operand
_ADD_LIKE = {
    "add",
    "complex",  # complex(a1 + a2, b1 + b2) = complex(a1, b1) + complex(a2, b2)
    "sub",
    "add_",
    "sub_",
    "_foreach_add",
    "_foreach_add_",
    "_foreach_sub",
    "_foreach_sub_",
}
_MUL_LIKE = {
    "mul",
    "div",
    "mul_",
    "div_",
    "_foreach_mul",
    "_foreach_mul_",
    "_foreach_div",
    "_foreach_div_",
}
# one operand, linear in it: negation, and complex conjugation (lazy views and their
# materialization, as complex autograd takes them)
_NEG_LIKE = {"neg", "neg_", "_foreach_neg", "_foreach_neg_"}
_NEG_LIKE |= {"_conj", "conj_physical", "resolve_conj", "_neg_view", "resolve_neg"}
# a constant scale, and the identity
_NEG_LIKE |= {"deg2rad", "deg2rad_", "rad2deg", "rad2deg_", "positive"}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like"}


def _keeps_partial(name: str, operands: list, partial_mesh_dim: int, partial) -> bool:
    """Whether op ``name`` applied to ``operands`` (specs or numbers) stays ``partial``.

    ``operands`` are the values in argument order, with DTensorSpecs in place of DTensors.
    """
    if not getattr(partial, "is_linear", False):
        return False
    specs = [o for o in operands if isinstance(o, DTensorSpec)]
    others = [o for o in operands if not isinstance(o, DTensorSpec)]
    pl = [s.placements[partial_mesh_dim] for s in specs]
    if name in _NEG_LIKE:
        return len(specs) == 1
    if name in _ADD_LIKE:
        return not others and all(p == partial for p in pl)
    if name in _MUL_LIKE:
        n_partial = sum(p == partial for p in pl)
        if n_partial != 1 or not all(p == partial or isinstance(p, Replicate) for p in pl):
            return False
        if name.startswith("div") or name.startswith("_foreach_div"):
            return (
                operands
                and operands[0] is not None
                and isinstance(operands[0], DTensorSpec)
                and operands[0].placements[partial_mesh_dim] == partial
            )
        return True
    return False


def _decide(
    name: str,
    operands: list,
    out_shape,
    *,
    target: DTensorSpec | None = None,
    reduce_target: bool = False,
):
    """Output placements and per-spec input placements for one pointwise application;
    ``target``: the tensor written (in-place target or ``out=``), whose placements the
    output keeps; ``reduce_target``: a Partial target may be reduced first (the first
    argument of a single-tensor in-place op, which dispatch reduces where it lies)."""
    specs = [o for o in operands if isinstance(o, DTensorSpec)]
    out = []
    for i in range((target or specs[0]).mesh.ndim):
        if target is not None:
            p_out = _inplace_output(name, operands, target, i, len(out_shape), reduce_target)
        else:
            p_out = _out_of_place_output(name, operands, specs, i, out_shape)
        if name.rstrip("_") in _LIKE and isinstance(p_out, Partial):
            p_out = Replicate()  # a fresh tensor: its value is not a partial of anything
        out.append(p_out)
    needs = [
        tuple(_input_need(name, s, i, p_out, out_shape) for i, p_out in enumerate(out))
        for s in specs
    ]
    return tuple(out), needs


def _inplace_output(
    name: str, operands: list, target: DTensorSpec, i: int, out_ndim: int, reduce_target: bool
):
    """Mesh dim ``i``'s output placement of an op writing into ``target`` (in place or
    ``out=``): the target's own (a shard dim moved when the target has fewer dims than the
    output), or ``Replicate`` for a Partial target that the op is not linear in and that
    may be reduced first (``reduce_target``: ``clamp_min_`` on a partial norm, as
    ``cosine_similarity`` runs; dispatch reduces the target where it lies, or refuses)."""
    p_out = target.placements[i]
    if isinstance(p_out, Partial) and not _keeps_partial(name, operands, i, p_out):
        if reduce_target:
            return Replicate()
        raise NotImplementedError(
            f"{name}: in-place op on a Partial DTensor (mesh dim {i}) would need a "
            "reduction first; reduce it with redistribute(placements=[Replicate()]) "
            "or use the out-of-place op."
        )
    if is_shard_like(p_out) and len(target.shape) != out_ndim:
        p_out = with_dim(p_out, p_out.dim + out_ndim - len(target.shape))
    return p_out


def _out_of_place_output(name: str, operands: list, specs: list, i: int, out_shape):
    """Mesh dim ``i``'s output placement of an out-of-place op: the first partial when the
    op is linear in it, else the first input's shard on a dim that is not broadcast, else
    ``Replicate``."""
    ps = [s.placements[i] for s in specs]
    partials = [p for p in ps if isinstance(p, Partial)]
    if partials and _keeps_partial(name, operands, i, partials[0]):
        return partials[0]
    out_ndim = len(out_shape)
    for s, p in zip(specs, ps):
        if is_shard_like(p):
            od = p.dim + out_ndim - s.ndim
            if s.shape[p.dim] == out_shape[od]:
                return with_dim(p, od)
    return Replicate()


def _input_need(name: str, s: DTensorSpec, i: int, p_out, out_shape):
    """The placement input ``s`` needs on mesh dim ``i`` to produce ``p_out``."""
    if isinstance(p_out, Partial):
        return s.placements[i] if s.placements[i] == p_out else Replicate()
    if name.rstrip("_") in _LIKE:
        p = s.placements[i]
        return Replicate() if isinstance(p, Partial) else p
    return map_to(p_out, len(out_shape), tuple(s.shape), tuple(out_shape))


def _operands(schema: OpSchema) -> list:
    return [a for a in schema.args if not isinstance(a, (list, tuple))] + [
        v
        for k, v in schema.kwargs.items()
        if k not in ("alpha", "dtype", "memory_format", "layout", "device", "pin_memory")
        and isinstance(v, DTensorSpec)
    ]


def _written_kwargs(func) -> tuple[str, ...]:
    """Names of the ``out=`` arguments ``func`` writes (keyword-only, marked ``!``)."""
    return tuple(
        a.name
        for a in func._schema.arguments
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
    )


def _writes_first(func) -> bool:
    args = func._schema.arguments
    first = args[0].alias_info if args else None
    return first is not None and first.is_write and not args[0].kwarg_only


def pointwise_rule(schema: OpSchema) -> OutputSharding:
    func = schema.func
    name = func.__name__.split(".")[0]
    if schema.kwargs.get("rounding_mode") is not None:
        # floor(a/r) + floor(b/r) is not floor((a+b)/r): a rounded division is not linear
        name = name + "_rounded"
    outs = [schema.kwargs[k] for k in _written_kwargs(func) if k in schema.kwargs]
    operands = [o for o in _operands(schema) if not any(o is w for w in outs)]
    if _writes_first(func):
        target = operands[0]
    elif outs:
        target = _out_target(schema, outs)
    else:
        target = None
    if target is not None:
        out_shape = target.shape
    else:
        out_shape = next(m.shape for m in schema.out_meta if m is not None)
    first = target is not None and not outs
    out, needs = _decide(name, operands, out_shape, target=target, reduce_target=first)
    specs = [o for o in operands if isinstance(o, DTensorSpec)]
    inputs = {schema.leaf_index(s): n for s, n in zip(specs, needs)}
    for w in outs:
        inputs[schema.leaf_index(w)] = w.placements  # written where it is
    return OutputSharding([out if m is not None else None for m in schema.out_meta], inputs)


def _out_target(schema: OpSchema, outs: list) -> DTensorSpec:
    """The ``out=`` tensor whose placements the result keeps; refuses ``out=`` tensors that
    disagree or that the op would resize."""
    metas = [m for m in schema.out_meta if m is not None]
    for w, m in zip(outs, metas):
        if not isinstance(w, DTensorSpec) or tuple(w.shape) != tuple(m.shape):
            raise NotImplementedError(
                f"{schema.func}: out= needs a DTensor of the result's shape "
                f"{tuple(m.shape)}; a DTensor out= is never resized."
            )
        if w.placements != outs[0].placements:
            raise NotImplementedError(
                f"{schema.func}: its out= tensors have different placements "
                f"({outs[0].placements} and {w.placements}); give them the same."
            )
    return outs[0]


@register("_foreach_")
def foreach_rule(schema: OpSchema) -> OutputSharding:
    """``_foreach_op(list, list | scalar | scalars, ...)``: the pointwise rule per position."""
    name = schema.func.__name__.split(".")[0]
    inplace = name.endswith("_")
    lists = [a for a in schema.args if isinstance(a, (list, tuple))]
    n = len(lists[0])
    outs, meshes, inputs = [], [], {}
    for j in range(n):
        operands = []
        for a in schema.args:
            if isinstance(a, (list, tuple)):
                operands.append(a[j] if len(a) == n else None)
            else:
                operands.append(a)
        specs = [o for o in operands if isinstance(o, DTensorSpec)]
        if not specs:
            outs.append(None)
            meshes.append(None)
            continue
        _check_same_mesh(name, specs, j)
        out_shape = specs[0].shape if inplace else schema.out_meta[j].shape
        out, needs = _decide(name, operands, out_shape, target=specs[0] if inplace else None)
        for s, need in zip(specs, needs):
            idx = _leaf_index_at(schema, s, j)
            prev = inputs.get(idx)
            if prev is not None and prev != need:
                raise NotImplementedError(f"{name}: conflicting placements for a shared input")
            inputs[idx] = need
        outs.append(out)
        meshes.append(specs[0].mesh)
    if inplace:
        return OutputSharding([], inputs)
    return OutputSharding(outs, inputs, output_meshes=meshes)


VALUE_FREE_RULES.add(foreach_rule)  # the pointwise rule per position


def _leaf_index_at(schema: OpSchema, spec, j) -> int:
    for i, x in enumerate(schema.leaves):
        if x is spec:
            return i
    raise AssertionError(f"foreach: spec {j} not found among leaves")


def _check_same_mesh(name, specs, j):
    first = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != first:
            raise ValueError(
                f"{name}: list position {j} mixes meshes {first!r} and {s.mesh!r}. Tensors "
                "combined elementwise must share a mesh."
            )


# --------------------------------------------------------------------------- registration


def _elementwise_by_tag(op) -> bool:
    """Whether ``op`` is tagged pointwise and fits ``pointwise_rule``: returns tensors only
    (``equal`` is tagged and returns a bool), draws no random numbers, and writes nothing
    but its in-place target or its ``out=`` tensors."""
    if torch.Tag.pointwise not in op.tags or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    schema = op._schema
    if not schema.returns or not all(isinstance(r.type, torch.TensorType) for r in schema.returns):
        return False
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write and i > 0 and not a.kwarg_only:
            return False
    return True


def _tagged_ops():
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket) and not name.startswith("_foreach_"):
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if _elementwise_by_tag(op):
                    yield op


for _name in _UNARY + _BINARY:
    for _n in (_name, _name + "_"):
        _op = getattr(aten, _n, None)
        if _op is not None:
            register(_op)(pointwise_rule)
for _op in _tagged_ops():
    if find_rule(_op) is None:
        register(_op)(pointwise_rule)
# a * b + c in one rounding: torch.compile's optimizers emit it (inductor registers the op)
register("prims::fma")(pointwise_rule)
VALUE_FREE_RULES.add(pointwise_rule)  # _keeps_partial asks whether a number is there


# --------------------------------------------------------------------------- not quite pointwise


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward_rule(schema: OpSchema) -> OutputSharding:
    """Pointwise, with a buffer laid out as the output. CUDA's kernel returns an empty
    buffer (its backward reads none): it is given the output's local shape, so that
    redistributing it, if a layout ever asks, moves a tensor of the size its spec says."""
    sharding = pointwise_rule(schema)
    sharding.local_fn = _log_sigmoid_forward
    return sharding


def _log_sigmoid_forward(x):
    out, buffer = aten.log_sigmoid_forward.default(x)
    if buffer.shape != out.shape:
        buffer = out.new_zeros(()).expand(out.shape)
    return out, buffer


def _arg(schema: OpSchema, i: int, name: str, default):
    if len(schema.args) > i:
        return schema.args[i]
    return schema.kwargs.get(name, default)


@register_per_mesh_dim(aten.glu.default)
def glu_options(schema: OpSchema) -> list:
    """``glu`` halves ``dim`` and multiplies the halves: any other dim may stay sharded."""
    x = schema.args[0]
    dim = _arg(schema, 1, "dim", -1) % x.ndim
    return [Option((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@register_per_mesh_dim(aten.glu_backward.default)
def glu_backward_options(schema: OpSchema) -> list:
    """The gradient of ``glu`` keeps every shard off ``dim``; it is linear in the output
    gradient, so a partial gradient stays partial (with the input whole)."""
    grad, x = schema.args[0], schema.args[1]
    dim = schema.args[2] % x.ndim
    options = [Option((Shard(d),), (Shard(d), Shard(d))) for d in range(x.ndim) if d != dim]
    for p in dict.fromkeys(grad.placements):
        if isinstance(p, Partial) and p.is_linear:
            options.append(Option((p,), (p, Replicate())))
    return options
