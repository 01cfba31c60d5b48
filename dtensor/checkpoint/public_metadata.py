"""PyTorch's checkpoint metadata classes, built from this library's ``metadata.json``.

``torch.distributed.checkpoint.Metadata`` describes a checkpoint by flattened key:
``state_dict_metadata[key]`` is a :class:`TensorStorageMetadata` (dtype, global size, the
saved chunks) or a :class:`BytesStorageMetadata` (a non-tensor value). Clients read it
(Lightning Fabric lists ``FileSystemReader(path).read_metadata().state_dict_metadata``).
Here these are views of the checkpoint's own JSON metadata (:mod:`dtensor.checkpoint.metadata`),
made by :func:`to_public`; nothing is pickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from dtensor.checkpoint.metadata import DTYPES
from dtensor.checkpoint.metadata import Metadata as _Internal

FORMAT_VERSION = "dtensor.checkpoint/1"


@dataclass
class ChunkStorageMetadata:
    """One saved chunk of a tensor: its ``offsets`` in the global tensor and its ``sizes``.

    Example::

        >>> md = dcp.FileSystemReader("ckpt/1").read_metadata()
        >>> md.state_dict_metadata["model.w"].chunks[0]
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([3, 4]))
    """

    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties:
    """How to create the tensor: dtype and PyTorch's other creation fields (defaults here).

    Example::

        >>> TensorProperties(dtype=torch.bfloat16).dtype
        torch.bfloat16
    """

    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> TensorProperties:
        """The properties of ``tensor`` (dtype, layout, requires_grad).

        Example::

            >>> TensorProperties.create_from_tensor(torch.zeros(2)).dtype
            torch.float32
        """
        return TensorProperties(
            dtype=tensor.dtype, layout=tensor.layout, requires_grad=tensor.requires_grad
        )


@dataclass
class TensorStorageMetadata:
    """A saved tensor: ``properties`` (dtype), global ``size`` and the ``chunks`` that tile it.

    Example::

        >>> t = md.state_dict_metadata["model.w"]
        >>> t.properties.dtype, t.size, len(t.chunks)
        (torch.float32, torch.Size([5, 4]), 2)
    """

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A saved non-tensor value (PyTorch pickles these; here they are JSON in metadata.json).

    Example::

        >>> isinstance(md.state_dict_metadata["step"], BytesStorageMetadata)
        True
    """


@dataclass
class StorageMeta:
    """Which checkpoint a save or load refers to (``checkpoint_id``: the directory here).

    Example::

        >>> dcp.FileSystemWriter("ckpt/1").storage_meta().checkpoint_id
        'ckpt/1'
    """

    checkpoint_id: str | os.PathLike | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """PyTorch's checkpoint description: ``state_dict_metadata`` by flattened key.

    Returned by :func:`dtensor.checkpoint.save` (on every rank) and by
    ``FileSystemReader(path).read_metadata()``. ``planner_data`` and ``storage_data`` are
    None (the nesting of the original keys and the byte locations live in metadata.json,
    which :func:`dtensor.checkpoint.read_metadata` parses); ``version`` names this format.

    Example::

        >>> md = dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id="ckpt/1")
        >>> sorted(md.state_dict_metadata)[:2]
        ['model.b', 'model.w']
    """

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


def to_public(md: _Internal, checkpoint_id: str | os.PathLike | None = None) -> Metadata:
    """PyTorch's :class:`Metadata` for a parsed ``metadata.json`` (keys in sorted order).

    Example::

        >>> to_public(dcp.read_metadata("ckpt/1")).state_dict_metadata["step"]
        BytesStorageMetadata()
    """
    described: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for key in sorted(md.tensors.keys() | md.values.keys()):
        entry = md.tensors.get(key)
        if entry is None:
            described[key] = BytesStorageMetadata()
            continue
        chunks = [
            ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in entry.chunks
        ]
        described[key] = TensorStorageMetadata(
            TensorProperties(dtype=DTYPES[entry.dtype]), torch.Size(entry.shape), chunks
        )
    meta = StorageMeta(checkpoint_id=checkpoint_id) if checkpoint_id is not None else None
    return Metadata(described, storage_meta=meta, version=FORMAT_VERSION)
