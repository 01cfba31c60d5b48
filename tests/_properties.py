"""Shared pieces of the property-based tests (tests/test_properties_*.py): hypothesis
profiles, strategies for meshes, shapes and placements, an oracle for local shards that does
not use the library's chunk maths, and the per-property example counters.

Profiles (pick one with ``HYPOTHESIS_PROFILE``; ``make property`` runs ``long``):

- ``fast`` (default, part of ``make test``): few examples, derandomized so every run of
  ``make test`` draws the same ones; world sizes 1-4 for the multi-rank properties.
- ``long``: many more examples, random (a failure is saved in hypothesis's example
  database under ``.hypothesis/`` and replayed first next time); world sizes 1-8.

Examples are generated in the pytest process and shipped to the ranks of a
``tests/harness.py`` pool in batches (one hypothesis example = a list of cases = one round
trip), so every rank runs exactly the same cases; hypothesis shrinks a failing batch to the
one smallest failing case.

Placements travel as plain tuples: ``("R",)``, ``("S", dim)``, ``("P", reduce_op)``.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fast")
_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
LONG_EXAMPLES = 40  # per property and world size
settings.register_profile("fast", max_examples=12, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=LONG_EXAMPLES, **_COMMON)
if PROFILE not in ("fast", "long"):
    raise ValueError(f"HYPOTHESIS_PROFILE must be 'fast' or 'long', got {PROFILE!r}.")
settings.load_profile(PROFILE)
LONG = PROFILE == "long"


def examples(fast: int, long: int = LONG_EXAMPLES) -> settings:
    """A property's example budget (per world size where the test is parametrized by it):
    ``fast`` in the fast profile, sized by what one example costs, ``long`` in the long one."""
    return settings(max_examples=long if LONG else fast)


# The multi-rank properties use real gloo worlds of these sizes (an 8-process pool takes
# about 50 s to start on a 2-core machine, so only the long profile goes there).
WORLD_SIZES = (1, 2, 3, 4, 5, 6, 7, 8) if LONG else (1, 2, 3, 4)
# pytest-timeout's limit for one property (all its examples); every harness round trip has
# its own deadline, so a hung collective still fails within a minute.
TIMEOUT_S = 3600 if LONG else 300
# Cases per hypothesis example (one harness round trip each).
BATCH = 12 if LONG else 8
REDUCE_OPS = ("sum", "avg", "max", "min")

# ----------------------------------------------------------------------------- counters
# property name -> Counter of "examples" (hypothesis examples, i.e. round trips), "cases"
# (cases run on the ranks) and "error: <class>: <message start>" for every expected error.
STATS: dict[str, Counter] = {}


def count(prop: str, key: str, n: int = 1) -> None:
    STATS.setdefault(prop, Counter())[key] += n


def summary_lines() -> list[str]:
    lines = [f"property-based tests (HYPOTHESIS_PROFILE={PROFILE}):"]
    for prop, c in sorted(STATS.items()):
        errors = sum(v for k, v in c.items() if k.startswith("error"))
        lines.append(
            f"  {prop}: {c['examples']} hypothesis examples, {c['cases']} cases run, "
            f"{errors} of them ending in a clear library error"
        )
        sizes = [f"{k.rsplit(' ', 1)[1]}: {v}" for k, v in sorted(c.items()) if "world size" in k]
        if sizes:
            lines.append(f"      by world size: {', '.join(sizes)}")
        for k, v in sorted(c.items()):
            if k.startswith("error"):
                lines.append(f"      {v:5d} x {k[len('error: ') :]}")
    return lines


# --------------------------------------------------------------------------- strategies
def mesh_shapes(world_size: int) -> list[tuple[int, ...]]:
    """Every mesh shape of 1-3 dims (size-1 dims included) whose product is ``world_size``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [
        shape
        for n in (1, 2, 3)
        for shape in itertools.product(divisors, repeat=n)
        if math.prod(shape) == world_size
    ]


def tensor_shapes(max_ndim: int = 3, max_size: int = 7, min_ndim: int = 0):
    """Shapes with dims of size 0, 1 and others smaller or larger than the mesh."""
    return st.lists(st.integers(0, max_size), min_size=min_ndim, max_size=max_ndim).map(tuple)


def placement(ndim: int, *, partial: bool = True, out_of_range: bool = True):
    """One placement for a tensor of ``ndim`` dims: Replicate, Shard on any dim (negative
    too; now and then one out of range), or Partial of every reduce op."""
    kinds = ["R", "S", "S"] if ndim else ["R"]
    if partial:
        kinds.append("P")
    if out_of_range:
        kinds.append("bad")

    def build(kind):
        if kind == "R":
            return st.just(("R",))
        if kind == "S":
            return st.integers(-ndim, ndim - 1).map(lambda d: ("S", d))
        if kind == "P":
            return st.sampled_from(REDUCE_OPS).map(lambda op: ("P", op))
        return st.sampled_from([ndim, -ndim - 1]).map(lambda d: ("S", d))

    return st.sampled_from(kinds).flatmap(build)


def placements(mesh_ndim: int, ndim: int, *, out_of_range: bool = False, **kw):
    """Placements for every mesh dim; with ``out_of_range``, one case in eight has a shard
    dim out of range somewhere (an error case), the others none."""
    if out_of_range:
        bad = st.integers(0, 7).map(lambda k: k == 7)
        return bad.flatmap(
            lambda b: (
                placements(mesh_ndim, ndim, out_of_range=False, **kw)
                if not b
                else _with_bad(mesh_ndim, ndim, **kw)
            )
        )
    return st.lists(
        placement(ndim, out_of_range=False, **kw), min_size=mesh_ndim, max_size=mesh_ndim
    ).map(tuple)


def _with_bad(mesh_ndim: int, ndim: int, **kw):
    return st.lists(
        placement(ndim, out_of_range=True, **kw), min_size=mesh_ndim, max_size=mesh_ndim
    ).map(tuple)


# ---------------------------------------------------------------------- build and oracle
def to_placement(p):
    from dtensor import Partial, Replicate, Shard

    if p[0] == "R":
        return Replicate()
    if p[0] == "S":
        return Shard(p[1])
    return Partial(p[1])


def to_placements(pl) -> tuple:
    return tuple(to_placement(p) for p in pl)


def shard_dim_ok(p, ndim: int) -> bool:
    return p[0] != "S" or (ndim > 0 and -ndim <= p[1] < ndim)


def norm_dim(p, ndim: int):
    """The tuple placement with a non-negative shard dim."""
    return ("S", p[1] % ndim) if p[0] == "S" else p


def oracle_index(n: int, splits) -> torch.Tensor:
    """The indices of a dim of size ``n`` that a rank holds after ``splits`` (a list of
    ``(num_chunks, index)``, outermost first), each a ``torch.chunk`` split with empty
    chunks at the end when ``torch.chunk`` returns fewer than asked."""
    idx = torch.arange(n)
    for k, i in splits:
        parts = list(torch.chunk(idx, k)) if idx.numel() else []
        parts += [idx[:0]] * (k - len(parts))
        idx = parts[i]
    return idx


def oracle_local(full: torch.Tensor, mesh_shape, coord, pl) -> torch.Tensor:
    """This rank's piece of ``full`` under tuple placements ``pl`` (partials count as
    replicas): shards of one tensor dim nest in mesh-dim order, mesh dim 0 outermost."""
    out = full
    for tdim in range(full.ndim):
        splits = [
            (mesh_shape[m], coord[m])
            for m, p in enumerate(pl)
            if p[0] == "S" and p[1] % full.ndim == tdim
        ]
        if splits:
            out = out.index_select(tdim, oracle_index(full.shape[tdim], splits))
    return out


def reduce_stack(stack: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.sum(0) / stack.shape[0]
    if op == "max":
        return stack.amax(0)
    return stack.amin(0)


def describe_error(e: BaseException) -> str:
    """``Class: first sentence of the message`` with placements and numbers as placeholders,
    so that one kind of error is counted once, whatever its case."""
    head = str(e).split("\n")[0].split(". ")[0]
    head = re.sub(r"\b(S|P|_S)\([^)]*\)|\bR\b|(Shard|Partial)\([^)]*\)", "<placement>", head)
    head = re.sub(r"-?\d+", "N", head)
    return f"{type(e).__name__}: {head[:120]}"


# A "clear error" is one of these classes with a message that names the API it came from
# ("distribute_tensor: ...", "DTensor.redistribute: ...", an op name, ...).
CLEAR_ERRORS = (ValueError, TypeError, NotImplementedError)


def check_clear(e: BaseException) -> str:
    if not isinstance(e, CLEAR_ERRORS):
        raise AssertionError(f"not a clear library error: {type(e).__name__}: {e}") from e
    msg = str(e)
    if ": " not in msg.split("\n")[0] or len(msg) < 20:
        raise AssertionError(f"error without the API's name or a cause: {msg!r}") from e
    return describe_error(e)
