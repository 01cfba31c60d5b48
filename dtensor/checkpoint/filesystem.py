"""Storage objects with PyTorch's names: ``FileSystemWriter`` / ``FileSystemReader`` (this
library's format underneath) and the abstract ``StorageWriter`` / ``StorageReader``.

``dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))`` is ``dcp.save(sd,
checkpoint_id=path)``: safetensors files and ``metadata.json``, CRC-32 on every byte, an
atomic commit. The constructors take PyTorch's arguments; each one that changes PyTorch's
behaviour is honoured or refused with a ``ValueError`` that says what to pass instead.

This library's save and load drive only its own storage classes: a ``StorageWriter`` or
``StorageReader`` implemented elsewhere (PyTorch's ``FileSystemWriter``, a user subclass of
either base) is refused with an error naming ``storage_writer`` / ``storage_reader``, since
its ``write_data`` / ``read_data`` would never run. (``dtensor.checkpoint.storage`` is the
write path of the format, not PyTorch's ``storage`` module.)
"""

from __future__ import annotations

import abc
import os
from pathlib import Path

from dtensor.checkpoint._read import _kept_checkpoint, read_metadata
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import METADATA_FILE
from dtensor.checkpoint.public_metadata import Metadata, StorageMeta, to_public

_WRITER_STEPS = ("reset", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan",
                 "write_data", "finish", "storage_meta")  # fmt: skip
_READER_STEPS = ("reset", "read_metadata", "set_up_storage_reader", "prepare_local_plan",
                 "prepare_global_plan", "read_data")  # fmt: skip


class StorageWriter(abc.ABC):
    """PyTorch's storage-writer interface (abstract), for ``isinstance`` checks and subclassing.

    This library's save drives only :class:`FileSystemWriter` and
    :class:`~dtensor.checkpoint.HuggingFaceStorageWriter`; another implementation passed as
    ``storage_writer`` is refused by name, since its methods would never be called.

    Example::

        >>> isinstance(dcp.FileSystemWriter("ckpt/1"), dcp.StorageWriter)
        True
    """

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the writer at ``checkpoint_id`` (a new save)."""

    @abc.abstractmethod
    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        """PyTorch's set-up step (not called by this library's save)."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan):
        """PyTorch's planning step (not called by this library's save)."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans):
        """PyTorch's planning step (not called by this library's save)."""

    @abc.abstractmethod
    def write_data(self, plan, planner):
        """PyTorch's write step (not called by this library's save)."""

    @abc.abstractmethod
    def finish(self, metadata, results) -> None:
        """PyTorch's commit step (not called by this library's save)."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether this writer can save to ``checkpoint_id``."""

    def storage_meta(self) -> StorageMeta | None:
        """Which checkpoint this writer saves (None when not known)."""
        return None


class StorageReader(abc.ABC):
    """PyTorch's storage-reader interface (abstract), for ``isinstance`` checks and subclassing.

    This library's load drives only :class:`FileSystemReader` and
    :class:`~dtensor.checkpoint.HuggingFaceStorageReader`; another implementation passed as
    ``storage_reader`` is refused by name.

    Example::

        >>> isinstance(dcp.FileSystemReader("ckpt/1"), dcp.StorageReader)
        True
    """

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the reader at ``checkpoint_id`` (a new load)."""

    @abc.abstractmethod
    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's :class:`~dtensor.checkpoint.Metadata`."""

    @abc.abstractmethod
    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        """PyTorch's set-up step (not called by this library's load)."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan):
        """PyTorch's planning step (not called by this library's load)."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans):
        """PyTorch's planning step (not called by this library's load)."""

    @abc.abstractmethod
    def read_data(self, plan, planner):
        """PyTorch's read step (not called by this library's load)."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether this reader can load ``checkpoint_id``."""


def _not_driven(self, *args, **kwargs):
    raise NotImplementedError(
        f"{type(self).__name__}: dtensor.checkpoint's save and load drive this storage "
        "themselves; PyTorch's step-by-step storage protocol is not exposed. Pass the object "
        "to dcp.save(storage_writer=...) / dcp.load(storage_reader=...)"
    )


def _is_path(checkpoint_id) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike)) and bool(os.fspath(checkpoint_id))


def refuse(name: str, value, default, why: str) -> None:
    """Raise the ValueError for an argument whose non-default ``value`` cannot be honoured."""
    if value != default:
        raise ValueError(f"{name}={value!r} is not supported: {why}")


class _AtPath:
    """What this library's storage objects share: a path (``checkpoint_id``, ``reset``) and
    PyTorch's plan steps, which save and load never call (they drive the files themselves)."""

    path: Path

    @property
    def checkpoint_id(self) -> Path:
        """The checkpoint directory (or Hugging Face folder)."""
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point this object at another path (``None`` keeps the current one)."""
        if checkpoint_id is not None:
            _check_path(f"{type(self).__name__}.reset", checkpoint_id)
            self.path = Path(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether ``checkpoint_id`` is a non-empty path."""
        return _is_path(checkpoint_id)

    prepare_local_plan = prepare_global_plan = _not_driven


class PathWriter(_AtPath, StorageWriter):
    """Base of this library's writers (``FileSystemWriter``, ``HuggingFaceStorageWriter``).

    Example::

        >>> isinstance(FileSystemWriter("ckpt"), PathWriter)
        True
    """

    def storage_meta(self) -> StorageMeta:
        """``StorageMeta(checkpoint_id=<the path>)``."""
        return StorageMeta(checkpoint_id=str(self.path))

    set_up_storage_writer = write_data = finish = _not_driven


class PathReader(_AtPath, StorageReader):
    """Base of this library's readers (``FileSystemReader``, ``HuggingFaceStorageReader``).

    Example::

        >>> isinstance(FileSystemReader("ckpt"), PathReader)
        True
    """

    set_up_storage_reader = read_data = _not_driven


class FileSystemWriter(PathWriter):
    """Save to a directory in this library's format, with PyTorch's constructor arguments.

    ``overwrite=False`` makes a save into an existing checkpoint an error (PyTorch's
    meaning); with the default the checkpoint is replaced atomically. ``serialization_format``
    may be either of PyTorch's values: the files are safetensors either way. The rest must
    keep their defaults (a ``ValueError`` otherwise): one file per rank, written and fsynced
    by one thread while the disk writes the previous pieces (docs/checkpoint.md, "The write
    path").

    Example::

        >>> dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter("ckpt/1"))
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions=None,
        serialization_format=None,
    ) -> None:
        _check_path("FileSystemWriter", path)
        refuse("single_file_per_rank", single_file_per_rank, True,
               "every rank writes one safetensors file; drop the argument")  # fmt: skip
        refuse("sync_files", sync_files, True, "every file and the directory are fsynced "
               "before the atomic commit, which is what survives a crash; drop the argument")  # fmt: skip
        refuse("thread_count", thread_count, 1, "each rank streams its one file from one "
               "thread while the kernel writes back the pieces before; drop the argument")  # fmt: skip
        refuse("per_thread_copy_ahead", per_thread_copy_ahead, 10_000_000,
               "copies to CPU are not pipelined per thread here; drop the argument")  # fmt: skip
        refuse("cache_staged_state_dict", cache_staged_state_dict, False,
               "async_save snapshots into fresh CPU memory each time; drop the argument")  # fmt: skip
        refuse("_extensions", _extensions, None, "stream transforms (compression) would change "
               "the safetensors files other tools read; drop the argument")  # fmt: skip
        _check_format(serialization_format)
        self.path = Path(path)
        self.overwrite = bool(overwrite)

    _dcp_driven = True  # save drives this class (and subclasses that override no step)

    def _dcp_persist(self, write, snapshot, group, problems: list[str]):
        """Run the save (``write``) into this directory; rank 0 checks ``overwrite`` first."""
        if group.rank == 0 and not self.overwrite and (self.path / METADATA_FILE).is_file():
            problems = problems + [
                f"{self.path} already holds a checkpoint and FileSystemWriter(overwrite=False) "
                "forbids replacing it; save elsewhere or pass overwrite=True"
            ]
        return write(snapshot, self.path, group, problems)


class FileSystemReader(PathReader):
    """Load from a directory this library's save wrote, with PyTorch's constructor.

    ``read_metadata()`` returns PyTorch's :class:`~dtensor.checkpoint.Metadata` (keys,
    dtypes, global sizes, chunks), parsed and checked from ``metadata.json``. A directory
    written by PyTorch's own DCP (a pickled ``.metadata``) is refused by name: convert it
    with PyTorch's ``dcp_to_torch_save``, then :func:`~dtensor.checkpoint.format_utils.
    torch_save_to_dcp`.

    Example::

        >>> reader = dcp.FileSystemReader("ckpt/1")
        >>> sorted(reader.read_metadata().state_dict_metadata)[:1]
        ['model.b']
        >>> dcp.load(sd, storage_reader=reader)
    """

    def __init__(self, path: str | os.PathLike, _extension_registry=None) -> None:
        _check_path("FileSystemReader", path)
        refuse("_extension_registry", _extension_registry, None,
               "stream transforms are not part of this format; drop the argument")  # fmt: skip
        self.path = Path(path)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's metadata as PyTorch's ``Metadata`` (no process group needed)."""
        return to_public(self._dcp_source()[1], str(self.path))

    _dcp_driven = True  # load drives this class (and subclasses that override no step)
    _dcp_whole_source = False  # checkpoint keys under other top-level names are fine

    def _dcp_source(self):
        """``(directory, this library's parsed metadata)`` for the load."""
        refuse_torch_dcp(self.path)
        found = _kept_checkpoint(self.path)
        return found, read_metadata(found)


def refuse_torch_dcp(path: Path) -> None:
    """Raise a clear error when ``path`` holds a checkpoint of PyTorch's DCP format."""
    if (path / ".metadata").is_file() and not (path / METADATA_FILE).is_file():
        raise CheckpointError(
            f"{path} is a checkpoint of PyTorch's torch.distributed.checkpoint format (a pickled "
            ".metadata), which this library does not read (it never unpickles): convert it with "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save, then "
            "dtensor.checkpoint.format_utils.torch_save_to_dcp"
        )


def _check_path(what: str, path) -> None:
    if not _is_path(path):
        raise ValueError(f"{what}: path={path!r} is not a directory path; pass a str or Path")


def _check_format(serialization_format) -> None:
    name = getattr(serialization_format, "value", serialization_format)
    if name not in (None, "torch_save", "safetensors"):
        raise ValueError(
            f"serialization_format={serialization_format!r} is not supported: the files are "
            "always safetensors; drop the argument"
        )
