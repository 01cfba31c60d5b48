"""Arguments in PyTorch's DCP form, checked and turned into what save and load do here.

Everything here runs before any collective and depends only on the arguments, which every
rank passes alike, so a bad argument raises on every rank at once and none waits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dtensor.checkpoint._comm import Group
from dtensor.checkpoint.filesystem import (
    _READER_STEPS,
    _WRITER_STEPS,
    FileSystemReader,
    FileSystemWriter,
    StorageReader,
    StorageWriter,
)
from dtensor.checkpoint.stateful import Stateful


def group_for(process_group, no_dist: bool) -> Group:
    """The ranks that take part: this process alone with ``no_dist``."""
    if no_dist:
        return Group(None, 0, 1)
    return Group.of(process_group)


def resolve_writer(checkpoint_id, storage_writer):
    """The storage object a save drives, from ``checkpoint_id`` and/or ``storage_writer``."""
    if storage_writer is None:
        if checkpoint_id is None:
            raise ValueError(
                "save needs checkpoint_id=<directory> or storage_writer=FileSystemWriter(<directory>)"
            )
        return FileSystemWriter(checkpoint_id)
    _check_storage(storage_writer, "storage_writer", StorageWriter, _WRITER_STEPS,
                   "FileSystemWriter(path) or HuggingFaceStorageWriter(path)")  # fmt: skip
    if checkpoint_id is not None:  # PyTorch's rule: checkpoint_id re-targets the writer
        storage_writer.reset(checkpoint_id)
    return storage_writer


def resolve_reader(checkpoint_id, storage_reader):
    """The storage object a load reads, from ``checkpoint_id`` and/or ``storage_reader``."""
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError(
                "load needs checkpoint_id=<directory> or storage_reader=FileSystemReader(<directory>)"
            )
        return FileSystemReader(checkpoint_id)
    _check_storage(storage_reader, "storage_reader", StorageReader, _READER_STEPS,
                   "FileSystemReader(path) or HuggingFaceStorageReader(path)")  # fmt: skip
    if checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    return storage_reader


def _driven_class(cls: type) -> type | None:
    """The storage class of this library that ``cls`` is or derives from (None: not ours)."""
    return next((c for c in cls.__mro__ if c.__dict__.get("_dcp_driven")), None)


def _check_storage(obj, arg: str, base: type, steps: tuple, use: str) -> None:
    cls = type(obj)
    where = f"{cls.__module__}.{cls.__qualname__}"
    ours = _driven_class(cls) if isinstance(obj, base) else None
    if ours is None:
        origin = (
            "PyTorch's own storage writes and reads PyTorch's format (pickled .metadata, "
            "torch.save'd data), which this library does not"
            if cls.__module__.startswith("torch.")
            else "this library drives only its own storage classes and would never call its methods"
        )
        raise TypeError(
            f"{arg}={where} cannot be used by dtensor.checkpoint: {origin}. Pass "
            f"{arg}=dtensor.checkpoint.{use}"
        )
    overridden = [s for s in steps + ("_dcp_persist", "_dcp_source")
                  if getattr(cls, s, None) is not getattr(ours, s, None)]  # fmt: skip
    if overridden:
        raise TypeError(
            f"{arg}={where} overrides {', '.join(overridden)} of {ours.__name__}, which "
            f"dtensor.checkpoint never calls (it writes and reads the files itself), so the "
            f"override would be ignored; pass {arg}=dtensor.checkpoint.{use} itself"
        )


def expand_stateful(state_dict: Mapping) -> dict:
    """A shallow copy of ``state_dict`` with each top-level Stateful replaced by its state_dict().

    PyTorch's rule (before planning on save, before reading on load): only top-level values
    are Stateful-expanded.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict is a {type(state_dict).__name__}; expected a dict of tensors, values, "
            "nested dicts and Stateful objects"
        )
    return {k: v.state_dict() if _stateful(v) else v for k, v in state_dict.items()}


def _stateful(value) -> bool:
    return not isinstance(value, torch.Tensor) and isinstance(value, Stateful)


def nested_stateful(expanded: Mapping) -> list[str]:
    """Problems: a Stateful object below the top level (PyTorch would pickle it; we cannot)."""
    found: list[str] = []

    def walk(node: Mapping, path: str) -> None:
        for key, value in node.items():
            here = f"{path}.{key}" if path else str(key)
            if _stateful(value):
                found.append(here)
            elif isinstance(value, Mapping) and not isinstance(value, torch.Tensor):
                walk(value, here)

    for key, value in expanded.items():
        if isinstance(value, Mapping) and not isinstance(value, torch.Tensor):
            walk(value, str(key))
    if not found:
        return []
    return [
        f"{', '.join(found[:10])}: a Stateful object (with state_dict/load_state_dict) is "
        "checkpointed through its state_dict() only at the top level of the state dict, as in "
        "PyTorch; move it to the top level or put its state_dict() there"
    ]


def load_back(state_dict: dict, expanded: dict) -> None:
    """After a load: ``load_state_dict`` each top-level Stateful, copy back the other values."""
    for key in sorted(state_dict, key=str):
        value = state_dict[key]
        if _stateful(value):
            value.load_state_dict(expanded[key])
        else:
            state_dict[key] = expanded[key]
