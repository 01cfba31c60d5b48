"""DTensorSpec: everything about a DTensor except its local data (hashable, for caches)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from device_mesh import DeviceMesh
from dtensor.placement import (
    Placement,
    _StridedShard,
    format_placements,
    local_shape_and_offset,
)


@dataclass(frozen=True)
class TensorMeta:
    """Global shape, stride and dtype of a DTensor.

    Example:
        >>> TensorMeta(torch.Size([7, 5]), contiguous_stride((7, 5)), torch.float32).stride
        (5, 1)
    """

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DTensorSpec:
    """Where a DTensor lives (mesh), how it is laid out (placements) and its global meta.

    Example:
        >>> from dtensor.spec import spec_of
        >>> spec = spec_of(distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)]))
        >>> spec.placements, spec.shape
        ((Shard(dim=0),), torch.Size([7, 5]))
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    meta: TensorMeta

    @property
    def shape(self) -> torch.Size:
        return self.meta.shape

    @property
    def ndim(self) -> int:
        return len(self.meta.shape)

    @property
    def has_strided(self) -> bool:
        """Whether some mesh dim shards inside another's shard (``_StridedShard``); computed
        once per spec, since dispatch asks for every DTensor argument of every op."""
        found = self.__dict__.get("_strided")
        if found is None:
            found = any(isinstance(p, _StridedShard) for p in self.placements)
            object.__setattr__(self, "_strided", found)
        return found

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def local_shape_and_offset(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        coord = self.mesh.get_coordinate()
        return local_shape_and_offset(self.shape, self.mesh.shape, coord, self.placements)

    def with_placements(self, placements) -> DTensorSpec:
        return DTensorSpec(self.mesh, tuple(placements), self.meta)

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {self.meta.dtype} {format_placements(self.placements)}"

    def __hash__(self) -> int:
        # Computed once: dispatch hashes the spec of every DTensor argument of every op.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.mesh, self.placements, self.meta))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # The cached hash is per process (str hashes are salted): never carry it along.
        state = dict(self.__dict__)
        state.pop("_hash", None)
        state.pop("_strided", None)
        return state


def contiguous_stride(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a size-0 dim counts as 1).

    Example:
        >>> contiguous_stride((2, 3, 4))
        (12, 4, 1)
    """
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
