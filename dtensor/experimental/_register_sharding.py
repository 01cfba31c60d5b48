"""``register_sharding``: a sharding rule written by the user, in PyTorch's form.

The user's function is called with the op's arguments as dispatch receives them (positional
and keyword), every DTensor replaced by its ``DTensorSpec`` (a plain one-element tensor,
which dispatch takes as replicated, too) and every other value as it is. It returns a list
of the ways the op can run on ONE mesh dim, pairs ``(output_placements, input_placements)``:

- ``output_placements``: a placement per output of the op (flattened: a list of tensors
  counts once per tensor), ``None`` for a non-tensor output. For an in-place op: the
  written argument's; a sharding whose output differs from its placement for the written
  argument is skipped, since that argument cannot be redistributed.
- ``input_placements``: an entry per argument, in order, keyword arguments last: a
  placement for a tensor, a list of placements for a list of tensors, ``None`` for a
  non-tensor. As in PyTorch, only the entries that are not ``None`` count, and they must
  match the tensor arguments one to one.

A lone placement stands for a list of one. Each pair becomes an ``Option`` of the
per-mesh-dim machinery in ``dtensor/_ops/_common.py`` ([Note: rules for one mesh dim]),
which picks, on every mesh dim, the option that moves the least data from the inputs'
current placements (the first listed on a tie), all-replicated always being one of them.

Registering replaces whatever rule the op had, and everything dispatch had read or decided
about ops is forgotten (their facts, the cached decisions, the fast path's entries), so the
new rule applies from the next call on, even for an op that has run before. The op still
runs on meta tensors first to get its outputs' global shapes: a custom op needs a fake
kernel (``torch.library.register_fake``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtensor import _dispatch
from dtensor._ops._common import OpSchema, Option, OutputSharding, expand_per_mesh_dim, register
from dtensor.placement import normalize_placements


def register_sharding(op):
    """Decorator: make ``fn`` the sharding rule of ``op``, replacing any rule it has (for an
    op DTensor does not support, such as a custom op, or to override a built-in rule).

    ``op``: an ``OpOverload``, an ``OpOverloadPacket`` (all its overloads), a
    ``torch.library.custom_op`` object, or a list of them. ``fn`` gets the op's arguments,
    each DTensor replaced by its ``DTensorSpec`` (``.ndim``, ``.shape``, ``.placements``),
    and returns the acceptable shardings for ONE mesh dim, each a pair
    ``(output_placements, input_placements)``: a placement per output (``None`` for a
    non-tensor output), and one entry per argument in order, keyword arguments last (a
    placement per tensor, a list of them per list of tensors, ``None`` per non-tensor).
    On each mesh dim the sharding that moves the least data is used, the first listed on a
    tie, all-replicated always being one of them. The module docstring has the details.

    Raises:
        TypeError: ``op`` is not an op.
        ValueError: ``op`` is run by a handler of its own (``aten.equal``, ``.item()``),
            which consults no rule; or, when the op runs, ``fn``'s answer is malformed (not
            pairs, a wrong number of placements, a placement that does not fit).

    Example:
        >>> @register_sharding(torch.ops.aten._softmax.default)
        ... def softmax_sharding(x, dim, half_to_float):
        ...     dim = dim % x.ndim
        ...     options = [([Replicate()], [Replicate(), None, None])]
        ...     for d in range(x.ndim):
        ...         if d != dim:
        ...             options.append(([Shard(d)], [Shard(d), None, None]))
        ...     return options
        >>> x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
        >>> torch.softmax(x, dim=1).placements
        (Shard(dim=0),)
    """
    overloads = _overloads(op)
    for overload in overloads:
        if overload in _dispatch.CUSTOM:
            raise ValueError(
                f"register_sharding: DTensor runs {overload} by a handler of its own, which "
                "consults no sharding rule; a rule registered for it would never be used."
            )

    def decorate(fn: Callable) -> Callable:
        rule = _rule_of(fn)
        for overload in overloads:
            register(overload)(rule)
        _forget_decisions()
        return fn

    return decorate


def _overloads(op) -> list:
    """The ``OpOverload``s ``op`` names (see ``register_sharding``)."""
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    overload = getattr(op, "_opoverload", None)  # a torch.library.custom_op object
    if isinstance(overload, torch._ops.OpOverload):
        return [overload]
    if isinstance(op, (list, tuple)) and op:
        return [o for item in op for o in _overloads(item)]
    raise TypeError(
        "register_sharding: expected an op (torch.ops.aten.<name>.<overload>, an overload "
        f"packet, a torch.library.custom_op) or a list of them, got {op!r}."
    )


def _forget_decisions() -> None:
    """Make dispatch read every op afresh: its per-op facts (which hold whether the rule
    keys numbers by value) and every mesh's cached decisions and fast path entries."""
    _dispatch._FACTS.clear()
    _dispatch.clear_cache()


def _rule_of(fn: Callable) -> Callable:
    """The dispatch rule (``schema -> OutputSharding``) running the user's function."""

    def options(schema: OpSchema) -> list:
        return _options(fn, schema)

    def registered_sharding(schema: OpSchema) -> OutputSharding:
        # an in-place op's written argument stays put: expand_per_mesh_dim sees to that
        return expand_per_mesh_dim(schema, options(schema))

    registered_sharding.options = options  # as register_per_mesh_dim's rules carry
    registered_sharding.user_fn = fn
    return registered_sharding


def _options(fn: Callable, schema: OpSchema) -> list:
    """``fn``'s answer for ``schema``, checked, as ``Option``s."""
    where = getattr(fn, "__qualname__", repr(fn))
    answer = fn(*schema.args, **schema.kwargs)
    try:
        pairs = list(answer)
    except TypeError:
        pairs = None
    if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        _invalid(
            where,
            schema.func,
            f"must return a list of (output_placements, input_placements) pairs, got {answer!r}.",
        )
    options = []
    for k, (outs, ins) in enumerate(pairs):
        option = _option(where, schema, k, _as_list(outs), [p for p in _flat(ins) if p is not None])
        if option is not None:
            options.append(option)
    return options


def _option(where: str, schema: OpSchema, k: int, outs: list, ins: list) -> Option | None:
    """Sharding ``k`` of the user's answer as an ``Option`` (None: an in-place op's sharding
    that would move the written argument, which cannot apply)."""
    func = schema.func
    specs = [schema.leaves[i] for i in schema.spec_indices()]
    inplace = _dispatch._facts_of(func).inplace
    # an in-place op's outputs are its written argument (dispatch derives none for it)
    n_out = len(func._schema.returns) if inplace else len(schema.out_meta)
    if len(outs) != n_out:
        _invalid(
            where,
            func,
            f"sharding {k} gives {len(outs)} output placement(s), but the op has {n_out} "
            f"output(s): {outs!r}.",
        )
    if len(ins) != len(specs):
        _invalid(
            where,
            func,
            f"sharding {k} gives {len(ins)} input placement(s) (None entries left out), but "
            f"the op has {len(specs)} tensor input(s) "
            f"({', '.join(str(tuple(s.shape)) for s in specs)}). Give one entry per argument "
            "in order: a placement per tensor, None per non-tensor.",
        )
    ins = tuple(
        _placement(where, func, p, s.ndim, f"sharding {k}, input {j}")
        for j, (p, s) in enumerate(zip(ins, specs))
    )
    if inplace:
        written = outs[0] if outs else None
        what = f"sharding {k}, output 0"
        if written is not None and _placement(where, func, written, specs[0].ndim, what) != ins[0]:
            return None  # the output is the written input: this sharding cannot apply
        return Option((), ins)
    outs = tuple(
        None if meta is None else _placement(where, func, p, meta.ndim, f"sharding {k}, output {j}")
        for j, (p, meta) in enumerate(zip(outs, schema.out_meta))
    )
    return Option(outs, ins)


def _as_list(x) -> list:
    """A list of placements as given, a lone placement as a list of one."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _flat(ins) -> list:
    """Input entries with a list-of-tensors argument's list opened in place."""
    out = []
    for entry in _as_list(ins):
        out.extend(entry if isinstance(entry, (list, tuple)) else [entry])
    return out


def _placement(where: str, func, p, ndim: int, what: str):
    """``p`` checked and normalized (PyTorch's placements taken, negative shard dims made
    non-negative) for a tensor of ``ndim`` dims; ``what``: which entry it is, for errors."""
    try:
        return normalize_placements((p,), 1, ndim, api=what)[0]
    except (TypeError, ValueError) as e:
        # a ValueError, as dispatch raises: a TypeError inside ``a + b`` becomes NotImplemented
        _invalid(where, func, str(e))


def _invalid(where: str, func, why: str):
    raise ValueError(f"register_sharding function {where} for {func}: {why}")
