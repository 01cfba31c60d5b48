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

import abc
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

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
    described: list[dict[str, list]], *, lowest_rank: bool = False
) -> tuple[dict[str, tuple[str, tuple]], dict[int, list]]:
    """Choose one writer per distinct block (the lowest holding rank with ``lowest_rank``,
    PyTorch's ``dedup_save_to_lowest_rank``; else the holder with the fewest bytes so far).

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
        writer = min(ranks) if lowest_rank else min(ranks, key=lambda r: (load[r], r))
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


# ------------------------------------------------------------------ PyTorch's planner names
# PyTorch's save and load run a pluggable planner (``SavePlanner`` / ``LoadPlanner``) through
# local plans, a global plan and per-item callbacks. This library plans with the box maths
# above instead (every rank runs the same assign_writers / read_plan), so it offers these
# names for code that constructs or type-checks them: the default planners are accepted with
# their options, and a planner that replaces any step is refused by name (default_planner.py).


class WriteItemType(Enum):
    """What a :class:`WriteItem` writes: a whole tensor, a shard of one, or bytes.

    Example::

        >>> WriteItemType.SHARD.name
        'SHARD'
    """

    TENSOR = auto()
    SHARD = auto()
    BYTE_IO = auto()


class LoadItemType(Enum):
    """What a :class:`ReadItem` reads: tensor data or bytes.

    Example::

        >>> LoadItemType.TENSOR.name
        'TENSOR'
    """

    TENSOR = auto()
    BYTE_IO = auto()


@dataclass(frozen=True)
class MetadataIndex:
    """A flattened key (``fqn``), and for a chunk its ``offset`` in the global tensor.

    Example::

        >>> MetadataIndex("model.w", (2, 0)).fqn
        'model.w'
    """

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class WriteItem:
    """One block a rank writes (PyTorch's plan item); describes, never drives, a save here.

    Example::

        >>> WriteItem(MetadataIndex("step"), WriteItemType.BYTE_IO).type.name
        'BYTE_IO'
    """

    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: Any = None
    tensor_data: Any = None


@dataclass(frozen=True)
class ReadItem:
    """One read of a load plan: ``lengths`` elements from ``storage_offsets`` of a saved chunk
    into ``dest_offsets`` of the destination (this library's :class:`Read` does that work).

    Example::

        >>> r = ReadItem(LoadItemType.TENSOR, MetadataIndex("w"), (0,), MetadataIndex("w", (0,)),
        ...              (0,), (4,))
        >>> r.lengths
        (4,)
    """

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: tuple[int, ...]
    storage_index: MetadataIndex
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class SavePlan:
    """A rank's list of :class:`WriteItem` (PyTorch's save plan), with opaque data fields.

    Example::

        >>> SavePlan([]).usable
        True
    """

    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclass
class LoadPlan:
    """A rank's list of :class:`ReadItem` (PyTorch's load plan), with opaque data fields.

    Example::

        >>> LoadPlan([]).items
        []
    """

    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """PyTorch's save-planner interface (abstract), so ``isinstance`` and subclassing work.

    This library's :func:`~dtensor.checkpoint.save` does not call these steps: it plans
    from the blocks each rank holds. Pass ``DefaultSavePlanner(...)`` (its options are
    honoured) or no planner; an object that implements these methods itself is refused
    with an error naming ``planner``, since its steps would never run.

    Example::

        >>> isinstance(dcp.DefaultSavePlanner(), dcp.SavePlanner)
        True
    """

    @abc.abstractmethod
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False):
        """Receive the state dict to plan (not called by this library's save)."""

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan:
        """This rank's plan (not called by this library's save)."""

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]):
        """Combine every rank's plan (not called by this library's save)."""

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Accept the coordinator's plan (not called by this library's save)."""

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem):
        """The data of one item (not called by this library's save)."""


class LoadPlanner(abc.ABC):
    """PyTorch's load-planner interface (abstract), so ``isinstance`` and subclassing work.

    This library's :func:`~dtensor.checkpoint.load` does not call these steps: it reads
    by intersecting boxes and copies into the state dict's tensors itself. Pass
    ``DefaultLoadPlanner(...)`` (``allow_partial_load`` is honoured) or no planner; an
    object that implements these methods itself is refused with an error naming ``planner``.

    Example::

        >>> isinstance(dcp.DefaultLoadPlanner(), dcp.LoadPlanner)
        True
    """

    @abc.abstractmethod
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False):
        """Receive the state dict and metadata (not called by this library's load)."""

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """This rank's reads (not called by this library's load)."""

    @abc.abstractmethod
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """Combine every rank's plan (not called by this library's load)."""

    @abc.abstractmethod
    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """Accept the coordinator's plan (not called by this library's load)."""

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value) -> None:
        """Receive a non-tensor value (not called by this library's load)."""

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem):
        """The tensor to read into (not called by this library's load)."""

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor) -> None:
        """Accept a filled tensor (not called by this library's load)."""
