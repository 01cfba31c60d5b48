"""What a sharding rule sees (``OpSchema``) and returns (``OutputSharding``), and the registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, Shard, _StridedShard, is_shard_like

_RULES: dict = {}


def register(*ops):
    """Register ``fn(schema) -> OutputSharding`` for aten overloads or overload packets, or
    for ops named like ``"prims::fma"`` (ops a module registers only when it is imported)."""

    def deco(fn):
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


# The optimizers' single-kernel steps: in place on lists of parameters, gradients and
# states, position by position, like the ``_foreach_`` ops (whose rule they share).
_FUSED_STEPS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")


def is_multi_tensor(func) -> bool:
    """Whether ``func`` works position by position on lists of tensors (``_foreach_*`` and
    the fused optimizer steps): positions may sit on different meshes."""
    name = func.__name__
    return name.startswith("_foreach_") or name.split(".")[0] in _FUSED_STEPS


# Rules whose decision depends on the types of the numbers an op takes (an int or a float
# operand), never on their values: dispatch's caches key such numbers by type alone, so an
# optimizer's per-step scalars (a bias correction, a scheduled learning rate) hit one entry
# instead of making a new one every step.
VALUE_FREE_RULES: set = set()


def find_rule(func):
    rule = _RULES.get(func) or _RULES.get(func.overloadpacket) or _RULES.get(func._schema.name)
    if rule is None and is_multi_tensor(func):
        rule = _RULES.get("_foreach_")
    return rule


@dataclass
class OpSchema:
    """The op and its arguments with every DTensor replaced by its ``DTensorSpec``.

    ``leaves`` is the flattened ``(args, kwargs)``; ``out_meta`` the flattened outputs of
    running the op on meta tensors of the global shapes (shape, stride, dtype per tensor).
    """

    func: object
    args: tuple
    kwargs: dict
    leaves: list
    out_meta: list

    @property
    def name(self) -> str:
        return self.func.overloadpacket.__name__

    def spec_indices(self) -> list[int]:
        return [i for i, x in enumerate(self.leaves) if isinstance(x, DTensorSpec)]

    def leaf_index(self, spec: DTensorSpec) -> int:
        for i, x in enumerate(self.leaves):
            if x is spec:
                return i
        raise AssertionError("spec is not a leaf of this schema")

    @property
    def mesh(self):
        return self.leaves[self.spec_indices()[0]].mesh


@dataclass
class OutputSharding:
    """A rule's answer.

    output_placements: placements per tensor output (flattened order), None for non-tensors.
    input_placements: {leaf index: placements} for DTensor inputs that must be redistributed.
    local_fn: replaces the op on local tensors (for rules that need different local args).
    output_meshes: per output, when outputs live on different meshes (foreach ops).
    """

    output_placements: list
    input_placements: dict = field(default_factory=dict)
    local_fn: Callable | None = None
    output_meshes: list | None = None


def with_dim(p: Shard, dim: int) -> Shard:
    """``p`` moved to tensor dim ``dim``, keeping its kind (a ``_StridedShard`` stays one)."""
    if p.dim == dim:
        return p
    if isinstance(p, _StridedShard):
        return _StridedShard(dim, p.split_factor)
    return Shard(dim)


def map_to(p_out, out_ndim: int, shape: tuple, out_shape: tuple):
    """Placement an input of ``shape`` needs so that a broadcasting op yields ``p_out``."""
    if is_shard_like(p_out):
        td = p_out.dim - (out_ndim - len(shape))
        if td < 0 or shape[td] != out_shape[p_out.dim]:
            return Replicate()
        return with_dim(p_out, td)
    return Replicate() if not isinstance(p_out, Partial) else p_out


def replicate_all(schema: OpSchema, ndim_outputs: int | None = None) -> OutputSharding:
    """Fallback: gather every input, run the op on full tensors, outputs replicated."""
    inputs = {}
    for i in schema.spec_indices():
        spec = schema.leaves[i]
        inputs[i] = (Replicate(),) * spec.mesh.ndim
    mesh_ndim = schema.mesh.ndim
    outs = [(Replicate(),) * mesh_ndim if m is not None else None for m in schema.out_meta]
    return OutputSharding(outs, inputs)
