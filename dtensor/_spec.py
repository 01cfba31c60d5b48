"""DTensorSpec: everything about a DTensor except its local data (hashable, for caches)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from device_mesh import DeviceMesh
from dtensor.placement import (
    Placement,
    _StridedShard,
    format_placements,
    is_shard_like,
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

    # PyTorch's DTensorSpec names, which clients read off ``DTensor._spec`` (torchtitan's
    # simple_fsdp reads tensor_meta and num_shards_map).
    @property
    def tensor_meta(self) -> TensorMeta:
        """The global shape, stride and dtype (PyTorch's name for ``meta``)."""
        return self.meta

    @property
    def stride(self) -> tuple[int, ...]:
        return self.meta.stride

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh

    @property
    def num_shards(self) -> int:
        """How many pieces the tensor is cut into (the product of the sharding mesh dims).

        Example:
            >>> spec_of(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])).num_shards
            2
        """
        return math.prod(
            self.mesh.size(i) for i, p in enumerate(self.placements) if is_shard_like(p)
        )

    @property
    def num_shards_map(self) -> list[int]:
        """For every tensor dim, how many pieces the mesh dims sharding it cut it into.

        Example:
            >>> spec_of(distribute_tensor(torch.randn(8, 4), mesh, [Shard(1)])).num_shards_map
            [1, 2]
        """
        out = [1] * self.ndim
        for i, p in enumerate(self.placements):
            if is_shard_like(p):
                out[p.dim] *= self.mesh.size(i)
        return out

    @property
    def dim_map(self) -> list[int]:
        """For every tensor dim, the mesh dim sharding it (-1: none).

        Raises:
            ValueError: two mesh dims shard one tensor dim (no single answer).
        """
        out = [-1] * self.ndim
        for i, p in enumerate(self.placements):
            if is_shard_like(p):
                if out[p.dim] > -1:
                    raise ValueError(
                        f"DTensorSpec.dim_map: tensor dim {p.dim} is sharded by mesh dims "
                        f"{out[p.dim]} and {i} ({format_placements(self.placements)}); read "
                        "num_shards_map or placements instead."
                    )
                out[p.dim] = i
        return out

    @property
    def sums(self) -> list[int]:
        """The mesh dims holding partial values."""
        return [i for i, p in enumerate(self.placements) if p.is_partial()]

    def is_sharded(self) -> bool:
        return any(is_shard_like(p) for p in self.placements)

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
