"""Redistribution: a pure planner (placements in, list of steps out) and its executor.

[Note: nested shards] When several mesh dims shard the same tensor dim, they nest in mesh-dim
order: mesh dim 0 takes its ``torch.chunk`` first and mesh dim 1 splits that chunk again,
except that a ``_StridedShard`` (FSDP over tensor parallelism) splits inside the plain shards.
A tensor dim's *shard sequence* (``shard_order``) lists the mesh dims sharding it, outermost
first. Only a
common prefix of the source and target sequences can stay; the rest is gathered innermost
first, then the target's remaining shards are added outermost first.

The plan, in order:
1. ``Shard(a) -> Shard(b)`` on a mesh dim that alone shards both dims: one all-to-all.
2. Gather every shard beyond the common prefix (all-gather, innermost first).
3. ``Partial`` that must become ``Replicate`` (or a shard that cannot be added yet): all-reduce.
4. Add target shards outermost first: a local slice from ``Replicate``, a reduce-scatter
   from ``Partial``.
5. ``Replicate -> Partial`` (internal use only): keep the value on one rank, zero elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtensor import _collectives as _eager
from dtensor import _collectives_traced as T
from dtensor import _workspace
from dtensor.placement import (
    NormPartial,
    Partial,
    Placement,
    Replicate,
    chunk_offsets,
    chunk_sizes,
    is_shard_like,
    local_shape_and_offset,
    shard_order,
)


@dataclass(frozen=True)
class Step:
    """One transition on one mesh dim. ``kind`` is one of ``all_gather``, ``all_to_all``,
    ``all_reduce``, ``reduce_scatter``, ``slice``, ``to_partial``."""

    kind: str
    mesh_dim: int
    src: Placement
    dst: Placement


def _shard_seq(placements, tensor_dim: int) -> list[int]:
    return shard_order(placements, tensor_dim)


def plan_redistribute(src, dst) -> list[Step]:
    """Steps that turn placements ``src`` into ``dst`` (same mesh). Pure.

    Example:
        >>> [s.kind for s in plan_redistribute((Shard(0),), (Replicate(),))]
        ['all_gather']
    """
    plan = _Plan(src, dst)
    tensor_dims = sorted({p.dim for p in (*src, *dst) if is_shard_like(p)})
    plan.move_shards_all_to_all(src)
    plan.gather_beyond_common_prefix(tensor_dims)
    plan.reduce_partials()
    plan.add_target_shards(tensor_dims)
    plan.add_partials()
    return plan.steps


class _Plan:
    """A plan being built: the placements reached so far (``cur``), the steps that reach
    them, and the target ``dst``. The methods are the module docstring's steps, in order."""

    def __init__(self, src, dst) -> None:
        self.cur = list(src)
        self.dst = dst
        self.steps: list[Step] = []

    def move(self, kind: str, i: int, new) -> None:
        self.steps.append(Step(kind, i, self.cur[i], new))
        self.cur[i] = new

    def move_shards_all_to_all(self, src) -> None:
        """1. One all-to-all where a mesh dim alone moves its shard to another tensor dim."""
        cur, dst = self.cur, self.dst
        for i, (s, d) in enumerate(zip(src, dst)):
            if is_shard_like(s) and is_shard_like(d) and s.dim != d.dim:
                if (
                    _shard_seq(cur, s.dim) == [i]
                    and _shard_seq(dst, d.dim) == [i]
                    and not _shard_seq(cur, d.dim)
                    and not _shard_seq(dst, s.dim)
                ):
                    self.move("all_to_all", i, d)

    def gather_beyond_common_prefix(self, tensor_dims) -> None:
        """2. Gather the shards beyond the common prefix, innermost first."""
        for tdim in tensor_dims:
            have, want = _shard_seq(self.cur, tdim), _shard_seq(self.dst, tdim)
            keep = 0
            while keep < min(len(have), len(want)) and have[keep] == want[keep]:
                keep += 1
            for i in reversed(have[keep:]):
                self.move("all_gather", i, Replicate())

    def reduce_partials(self) -> None:
        """3. All-reduce the partials that cannot stay (but those a reduce-scatter can
        turn into the target's next shard)."""
        cur, dst = self.cur, self.dst
        for i, (c, d) in enumerate(zip(cur, dst)):
            if isinstance(c, Partial) and c != d:
                if is_shard_like(d) and _can_append_shard(cur, dst, i, d.dim):
                    continue  # becomes a reduce-scatter in step 4
                self.move("all_reduce", i, Replicate())

    def add_target_shards(self, tensor_dims) -> None:
        """4. Add the target's shards outermost first (a slice, or a reduce-scatter)."""
        cur, dst = self.cur, self.dst
        for tdim in tensor_dims:
            for i in _shard_seq(dst, tdim):
                if cur[i] != dst[i]:
                    self.move(
                        "reduce_scatter" if isinstance(cur[i], Partial) else "slice", i, dst[i]
                    )

    def add_partials(self) -> None:
        """5. ``Replicate -> Partial``; any other difference left is a planner bug."""
        for i, (c, d) in enumerate(zip(self.cur, self.dst)):
            if c != d:
                if not (isinstance(c, Replicate) and isinstance(d, Partial)):
                    raise AssertionError(f"redistribute planner: cannot move {c} to {d}")
                self.move("to_partial", i, d)


def _can_append_shard(cur, dst, mesh_dim: int, tensor_dim: int) -> bool:
    """Whether a reduce-scatter on ``mesh_dim`` would put its shard in the target's order."""
    have, want = _shard_seq(cur, tensor_dim), _shard_seq(dst, tensor_dim)
    return want[: len(have)] == have and len(want) > len(have) and want[len(have)] == mesh_dim


def redistribute_local(local: torch.Tensor, spec, dst_placements, *, async_op=False):
    """Run the plan from ``spec.placements`` to ``dst_placements`` on ``local``.

    Returns a ``Pending``; all but the last collective finish before returning.
    """
    steps = plan_redistribute(spec.placements, dst_placements)
    cur = list(spec.placements)
    if local.is_conj() or local.is_neg():
        # a lazy conjugate or negative view (``clone`` of ``_conj`` keeps the bit): the
        # collectives read and copy raw memory, which would drop the pending conjugation
        local = local.resolve_conj().resolve_neg()
    result = _eager.Pending.ready(local)
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        result = _run_step(result.wait(), step, cur, spec, async_op=async_op and last)
        cur[step.mesh_dim] = step.dst
    return result


def _dim_size_without(spec, cur, mesh_dim: int, tensor_dim: int) -> int:
    """Size of ``tensor_dim`` on this rank if ``mesh_dim`` did not shard it."""
    placements = list(cur)
    placements[mesh_dim] = Replicate()
    shape, _ = local_shape_and_offset(
        spec.shape, spec.mesh.shape, spec.mesh.get_coordinate(), placements
    )
    return shape[tensor_dim]


def _run_step(local, step: Step, cur, spec, *, async_op: bool):
    mesh, i = spec.mesh, step.mesh_dim
    # the same collectives, as graph ops, when torch.compile is tracing (no data to send)
    C = T if T.tracing(local) else _eager
    if step.kind == "all_gather":
        full = _dim_size_without(spec, cur, i, step.src.dim)
        return C.all_gather(local, mesh, i, step.src.dim, full, async_op=async_op)
    if step.kind == "all_to_all":
        full_from = _dim_size_without(spec, cur, i, step.src.dim)
        full_to = local.size(step.dst.dim)
        return C.all_to_all(
            local, mesh, i, step.src.dim, step.dst.dim, full_from, full_to, async_op=async_op
        )
    if step.kind == "all_reduce":
        return C.all_reduce(local, mesh, i, step.src, async_op=async_op)
    if step.kind == "reduce_scatter":
        return C.reduce_scatter(local, mesh, i, step.dst.dim, step.src, async_op=async_op)
    if step.kind == "slice":
        ws = None if C is T else _workspace.workspace_of(mesh, i)
        return C.Pending.ready(
            local_chunk(local, step.dst.dim, mesh.size(i), mesh.get_local_rank(i), ws)
        )
    if step.kind == "to_partial":
        return C.Pending.ready(replicate_to_partial(local, step.dst, mesh.get_local_rank(i)))
    raise AssertionError(f"unknown redistribute step {step}")


def local_chunk(
    t: torch.Tensor, tensor_dim: int, num_chunks: int, index: int, ws=None
) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``t`` along ``tensor_dim``: a copy (``clone``), or
    a contiguous one in a buffer of the workspace ``ws`` ([Note: collective workspace])."""
    n = t.size(tensor_dim)
    start = chunk_offsets(n, num_chunks)[index]
    piece = t.narrow(tensor_dim, start, chunk_sizes(n, num_chunks)[index])
    if ws is None:
        return piece.clone()
    return ws.empty(piece.shape, piece.dtype, piece.device).copy_(piece)


def replicate_to_partial(t: torch.Tensor, partial: Partial, local_rank: int) -> torch.Tensor:
    """Split a replicated value into partials whose reduction gives it back: the value on
    local rank 0 and zeros elsewhere for a sum (and for a finite p-norm, whose reduction
    sums ``|x|^p``), the value on local rank 0 and ones elsewhere for a product, the value
    everywhere for an average, max, min or infinite norm."""
    if local_rank != 0 and _sums(partial):
        return torch.zeros_like(t)
    if local_rank != 0 and type(partial) is Partial and partial.reduce_op == "product":
        return torch.ones_like(t)  # the value on local rank 0 times ones: exact
    return t.clone()


def _sums(partial: Partial) -> bool:
    if isinstance(partial, NormPartial):
        return partial.norm_type not in (float("inf"), float("-inf"))
    return partial.reduce_op == "sum"
