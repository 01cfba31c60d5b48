"""Pointwise ops (unary, binary with broadcasting, in-place) and their ``_foreach_`` forms.

Per mesh dim the output placement is chosen, then every input is asked for the placement
that produces it:

- a ``Partial`` survives only ops that are linear in it: ``a + b`` with both partial alike,
  ``a * r`` / ``a / r`` with ``r`` replicated or a python number, ``-a``. Anything else
  reduces the partial first (all-reduce or reduce-scatter).
- otherwise the first input sharded on a dim that is not broadcast decides ``Shard(d)``,
  and inputs that broadcast along ``d`` are replicated;
- in-place ops keep the target's placements (the target is never redistributed).
"""

from __future__ import annotations

import torch

from dtensor._ops._common import (
    VALUE_FREE_RULES,
    OpSchema,
    OutputSharding,
    map_to,
    register,
    with_dim,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, is_shard_like

aten = torch.ops.aten

_UNARY = """abs acos acosh asin asinh atan atanh bitwise_not ceil cos cosh erf erfc erfinv exp
exp2 expm1 floor frac isfinite isinf isnan isneginf isposinf log log10 log1p log2
logical_not neg nan_to_num reciprocal relu round rsqrt sigmoid sign sgn silu gelu sin sinh
sqrt square tan tanh trunc clamp clamp_min clamp_max hardtanh leaky_relu elu mish softplus
pow logit fill zero zeros_like ones_like empty_like full_like copy
_conj conj_physical resolve_conj _neg_view resolve_neg
""".split()
_BINARY = """add sub rsub mul div true_divide floor_divide remainder fmod maximum minimum atan2
eq ne lt le gt ge logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor
lerp addcmul addcdiv where masked_fill threshold_backward gelu_backward silu_backward
sigmoid_backward tanh_backward hardtanh_backward leaky_relu_backward copysign xlogy hypot
""".split()

# linearity of an op in its (single) partial operand
_ADD_LIKE = {
    "add",
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


def _decide(name: str, operands: list, out_shape, *, inplace: bool):
    """Output placements and per-spec input placements for one pointwise application."""
    specs = [o for o in operands if isinstance(o, DTensorSpec)]
    out = []
    for i in range(specs[0].mesh.ndim):
        if inplace:
            p_out = _inplace_output(name, operands, specs[0], i, len(out_shape))
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


def _inplace_output(name: str, operands: list, target: DTensorSpec, i: int, out_ndim: int):
    """Mesh dim ``i``'s output placement of an in-place op: the target's own (a shard dim
    moved when the target has fewer dims than the output)."""
    p_out = target.placements[i]
    if isinstance(p_out, Partial) and not _keeps_partial(name, operands, i, p_out):
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


def pointwise_rule(schema: OpSchema) -> OutputSharding:
    name = schema.func.__name__.split(".")[0]
    inplace = name.endswith("_") and not name.startswith("_")
    operands = _operands(schema)
    if inplace:
        out_shape = operands[0].shape
    else:
        out_shape = next(m.shape for m in schema.out_meta if m is not None)
    out, needs = _decide(name, operands, out_shape, inplace=inplace)
    specs = [o for o in operands if isinstance(o, DTensorSpec)]
    inputs = {schema.leaf_index(s): n for s, n in zip(specs, needs)}
    n_out = len(schema.out_meta)
    return OutputSharding(
        [out if m is not None else None for m in schema.out_meta] if n_out else [], inputs
    )


for _name in _UNARY + _BINARY:
    for _n in (_name, _name + "_"):
        _op = getattr(aten, _n, None)
        if _op is not None:
            register(_op)(pointwise_rule)
# a * b + c in one rounding: torch.compile's optimizers emit it (inductor registers the op)
register("prims::fma")(pointwise_rule)
VALUE_FREE_RULES.add(pointwise_rule)  # _keeps_partial asks whether a number is there


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
        out, needs = _decide(name, operands, out_shape, inplace=inplace)
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
