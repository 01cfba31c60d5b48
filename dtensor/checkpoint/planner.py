"""Who writes what on save, and what each rank reads on load: decisions from boxes alone.

Save: every rank describes the block it holds of each tensor (:func:`local_item`); the
descriptions are exchanged, and every rank runs the same deterministic :func:`assign_writers`
on them, so all agree without another message. Identical blocks held by several ranks
(replicated tensors, HSDP replicas, a tensor-parallel submesh repeated across data-parallel
ranks) are written once, by the candidate with the fewest bytes assigned so far, which spreads
the writing across ranks.

Load: :func:`read_plan` intersects the block a rank holds with the saved chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtensor.checkpoint._reshard import Box, overlaps, relative_slices, volume
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import DTYPE_NAMES, Chunk, TensorEntry, itemsize
from dtensor.placement import Partial, Replicate
from dtensor.tensor import DTensor


@dataclass
class LocalItem:
    """This rank's block of one tensor: global shape and dtype, its box and its local data."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    local: torch.Tensor  # the block's values (for a DTensor, its local tensor)

    def describe(self) -> list:
        return [self.dtype, list(self.shape), list(self.box[0]), list(self.box[1])]


def local_item(key: str, value: torch.Tensor, *, for_save: bool) -> LocalItem:
    """Describe ``value`` (a DTensor or a plain tensor, taken as replicated) for checkpointing.

    A ``Partial`` DTensor is summed first when saving (a collective over its mesh) and refused
    when loading. Example::

        >>> local_item("w", torch.zeros(3, 2), for_save=True).describe()
        ['F32', [3, 2], [0, 0], [3, 2]]
    """
    if value.dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{key!r} has dtype {value.dtype}, which checkpoints do not store")
    if not for_save and value.device.type == "meta":
        raise CheckpointError(
            f"{key!r} is on the meta device and has no memory to load into; call "
            "model.to_empty(device=...) before loading"
        )
    if isinstance(value, DTensor):
        if any(isinstance(p, Partial) for p in value.placements):
            if not for_save:
                raise CheckpointError(
                    f"{key!r} is a Partial DTensor; cannot load into a pending sum"
                )
            value = value.redistribute(
                value.device_mesh,
                [Replicate() if isinstance(p, Partial) else p for p in value.placements],
            )
        sizes, offsets = value._spec.local_shape_and_offset()
        return LocalItem(key, DTYPE_NAMES[value.dtype], tuple(value.shape), (tuple(offsets), tuple(sizes)),
                         value.to_local())  # fmt: skip
    shape = tuple(value.shape)
    return LocalItem(key, DTYPE_NAMES[value.dtype], shape, ((0,) * len(shape), shape), value)


def assign_writers(
    described: list[dict[str, list]],
) -> tuple[dict[str, tuple[str, tuple]], dict[int, list]]:
    """Choose one writer per distinct block.

    ``described[r]`` maps each key to rank ``r``'s ``[dtype, shape, offsets, sizes]``.
    Returns ``(entries, writes)``: per key its ``(dtype, shape)``; per rank the ``(key, box)``
    it writes. Ranks that disagree on a key's dtype or shape make it an error.

    Example::

        >>> d = {"b": ["F32", [4], [0], [4]]}
        >>> assign_writers([d, d])[1]
        {0: [('b', ((0,), (4,)))], 1: []}
    """
    entries: dict[str, tuple[str, tuple]] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    problems = []
    for rank, items in enumerate(described):
        for key, (dtype, shape, offs, sizes) in items.items():
            seen = entries.setdefault(key, (dtype, tuple(shape)))
            if seen != (dtype, tuple(shape)):
                problems.append(
                    f"{key!r}: rank {rank} has {dtype} {shape}, another rank {seen[0]} {list(seen[1])}"
                )
                continue
            if volume(sizes) > 0:
                holders.setdefault((key, (tuple(offs), tuple(sizes))), []).append(rank)
    if problems:
        raise CheckpointError("ranks disagree on tensors:\n" + "\n".join(problems))
    load = [0] * len(described)
    writes: dict[int, list] = {r: [] for r in range(len(described))}
    for (key, box), ranks in sorted(holders.items()):
        writer = min(ranks, key=lambda r: (load[r], r))
        load[writer] += volume(box[1]) * itemsize(entries[key][0])
        writes[writer].append((key, box))
    return entries, writes


@dataclass(frozen=True)
class Read:
    """Copy ``source`` (a saved chunk) sliced by ``src`` into the rank's block sliced by ``dst``."""

    chunk: Chunk
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def read_plan(entry: TensorEntry, box: Box) -> list[Read]:
    """The reads that fill ``box`` of a saved tensor.

    Example::

        >>> c = [Chunk((0,), (2,), "a", 0, 8, 0), Chunk((2,), (2,), "b", 0, 8, 0)]
        >>> [r.chunk.file for r in read_plan(TensorEntry("F32", (4,), tuple(c)), ((1,), (2,)))]
        ['a', 'b']
    """
    reads = []
    for i, shared in overlaps(box, [c.box for c in entry.chunks]):
        chunk = entry.chunks[i]
        reads.append(
            Read(chunk, relative_slices(shared, chunk.offsets), relative_slices(shared, box[0]))
        )
    return reads
