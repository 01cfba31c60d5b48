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


# [Note: rules for one mesh dim] Most ops treat each mesh dim alike: whether ``cumsum`` may
# keep a ``Shard(d)`` does not depend on what the other mesh dims do. A rule registered with
# ``register_per_mesh_dim`` only lists, for ONE mesh dim, the ways the op can run: each an
# ``Option(outputs, inputs)`` of one placement per tensor output and per DTensor input (in
# argument order). ``expand_per_mesh_dim`` turns that list into the n-D answer: on each mesh
# dim it takes the option that moves the least data from the inputs' current placements,
# the first such on a tie, and always has "every input and output replicated" to fall back
# on. Example, a scan along ``dim``:
#
#     @register_per_mesh_dim(aten.cumsum.default)
#     def cumsum_options(schema):
#         x, dim = schema.args[0], schema.args[1] % schema.args[0].ndim
#         return [Option((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@dataclass(frozen=True)
class Option:
    """One way to run an op on one mesh dim: a placement per tensor output (``None`` for an
    output that is not a tensor) and per DTensor input, in argument order."""

    outputs: tuple
    inputs: tuple


def _move_cost(have, want) -> float:
    """How costly redistributing ``have`` -> ``want`` on one mesh dim is, roughly: nothing
    without a change, a little for taking a block of a replicated tensor (local, but the
    answer then comes out sharded where the caller had it whole), one collective otherwise,
    two for a shard that must become a partial (gathered first)."""
    if have == want:
        return 0.0
    if isinstance(have, Replicate):
        return 0.1
    if is_shard_like(have) and isinstance(want, Partial):
        return 2.0
    return 1.0


def expand_per_mesh_dim(schema: OpSchema, options: list) -> OutputSharding:
    """The n-D ``OutputSharding`` of a rule given as one-mesh-dim ``options`` (see the note
    [rules for one mesh dim])."""
    specs = [schema.leaves[i] for i in schema.spec_indices()]
    n_out = len(schema.out_meta)
    fallback = Option(
        tuple(Replicate() if m is not None else None for m in schema.out_meta),
        (Replicate(),) * len(specs),
    )
    outs = [[] for _ in range(n_out)]
    ins = [[] for _ in specs]
    writes_first = _writes_first_argument(schema.func)
    for mesh_dim in range(schema.mesh.ndim):
        have = [s.placements[mesh_dim] for s in specs]
        best, best_cost = fallback, None
        for opt in [*options, fallback]:
            if len(opt.inputs) != len(specs) or len(opt.outputs) != n_out:
                raise ValueError(
                    f"rule for {schema.func} gave an option with {len(opt.inputs)} inputs and "
                    f"{len(opt.outputs)} outputs; the op has {len(specs)} and {n_out}"
                )
            if writes_first and opt.inputs[0] != have[0] and opt is not fallback:
                continue  # an in-place target is never redistributed
            cost = sum(_move_cost(h, w) for h, w in zip(have, opt.inputs))
            if best_cost is None or cost < best_cost:
                best, best_cost = opt, cost
        for k, p in enumerate(best.outputs):
            outs[k].append(p)
        for k, p in enumerate(best.inputs):
            ins[k].append(p)
    out_placements = [tuple(o) if m is not None else None for o, m in zip(outs, schema.out_meta)]
    inputs = {i: tuple(p) for i, p in zip(schema.spec_indices(), ins)}
    return OutputSharding(out_placements, inputs)


def _writes_first_argument(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def register_per_mesh_dim(*ops):
    """Register ``fn(schema) -> list[Option]`` (the ways to run the op on one mesh dim) for
    ``ops``; dispatch expands it to the mesh (see the note [rules for one mesh dim])."""

    def deco(fn):
        def rule(schema: OpSchema) -> OutputSharding:
            return expand_per_mesh_dim(schema, list(fn(schema)))

        rule.options = fn
        register(*ops)(rule)
        return fn

    return deco


def register_replicated(*ops):
    """Ops that need whole tensors (sorts of the whole input, factorizations, ops whose
    every dim is mixed): inputs are gathered, outputs replicated. Correct for every input,
    at the price of the gathers; give an op a finer rule when it matters for speed."""
    register(*ops)(replicate_all)
