"""Distributed checkpoints: save sharded state from any layout, load it into any other.

A checkpoint is a directory of safetensors files (one per writing rank) and a plain-JSON
``metadata.json``; nothing is pickled, a crashed save leaves a complete checkpoint that
``load`` finds (the new one or the one before), and every byte is covered by a CRC-32. See
``docs/checkpoint.md``.

Example::

    >>> from dtensor import checkpoint as dcp
    >>> dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt/step-100")
    >>> dcp.load({"model": model.state_dict()}, checkpoint_id="ckpt/step-100")
    >>> dcp.load_hf(model.state_dict(), "llama-hf/")   # Hugging Face weights, any layout
"""

from dtensor.checkpoint.api import async_save, load, read_metadata, save
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.hf import export_hf, load_hf
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
]
