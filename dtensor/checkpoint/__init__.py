"""Distributed checkpoints: save sharded state from any layout, load it into any other.

A checkpoint is a directory of safetensors files (one per writing rank) and a plain-JSON
``metadata.json``; nothing is pickled, a crashed save leaves a complete checkpoint that
``load`` finds (the new one or the one before), and every byte is covered by a CRC-32. See
``docs/checkpoint.md``.

PyTorch's ``torch.distributed.checkpoint`` names are here too (``FileSystemWriter``,
``DefaultSavePlanner``, ``Metadata``, ``HuggingFaceStorageWriter``, ...), so
``import dtensor.checkpoint as dcp`` replaces ``import torch.distributed.checkpoint as dcp``;
docs/checkpoint.md, "PyTorch DCP API", lists each name and what differs.

Example::

    >>> from dtensor import checkpoint as dcp
    >>> dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt/step-100")
    >>> dcp.load({"model": model.state_dict()}, checkpoint_id="ckpt/step-100")
    >>> dcp.load_hf(model.state_dict(), "llama-hf/")   # Hugging Face weights, any layout
"""

from dtensor.checkpoint.api import (
    async_save,
    load,
    load_state_dict,
    read_metadata,
    save,
    save_state_dict,
)
from dtensor.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from dtensor.checkpoint.errors import CheckpointError, CheckpointException
from dtensor.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    StorageReader,
    StorageWriter,
)
from dtensor.checkpoint.hf import export_hf, load_hf
from dtensor.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from dtensor.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from dtensor.checkpoint.public_metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from dtensor.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "save",
    "load",
    "async_save",
    "read_metadata",
    "load_hf",
    "export_hf",
    "CheckpointError",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    # PyTorch's torch.distributed.checkpoint names (docs/checkpoint.md, "PyTorch DCP API")
    "BytesStorageMetadata",
    "CheckpointException",
    "ChunkStorageMetadata",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "FileSystemReader",
    "FileSystemWriter",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "LoadPlan",
    "LoadPlanner",
    "Metadata",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "StorageReader",
    "StorageWriter",
    "TensorStorageMetadata",
    "WriteItem",
    "load_state_dict",
    "save_state_dict",
]
