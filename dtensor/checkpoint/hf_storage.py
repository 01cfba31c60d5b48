"""``HuggingFaceStorageWriter`` / ``HuggingFaceStorageReader``: PyTorch's names for saving a
state dict as a Hugging Face safetensors folder and loading one, on top of
:func:`~dtensor.checkpoint.export_hf` and :func:`~dtensor.checkpoint.load_hf`.

``dcp.save(hf_sd, storage_writer=HuggingFaceStorageWriter(out))`` saves the (sharded) state
dict as a checkpoint in a hidden staging directory inside ``out`` (the atomic, checksummed
save), then rank 0 assembles each tensor whole into ``out``'s safetensors files and removes
the staging directory; every rank learns whether that worked. Whatever the layout, the
folder holds full tensors (PyTorch's ``enable_consolidation``, always). ``dcp.load(sd,
storage_reader=HuggingFaceStorageReader(folder))`` is ``load_hf(sd, folder)``: each rank
reads only its shards' bytes.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from dtensor.checkpoint.filesystem import PathReader, PathWriter, _check_path, refuse
from dtensor.checkpoint.hf import export_hf, read_hf_metadata
from dtensor.checkpoint.public_metadata import Metadata, to_public

STAGING = ".dcp-staging"


class HuggingFaceStorageWriter(PathWriter):
    """Save a state dict as a Hugging Face folder (``from_pretrained`` reads it).

    Keys are the state dict's flattened keys (pass Hugging Face names). Without
    ``fqn_to_index_mapping`` the tensors go into ``model.safetensors`` (or 5 GB shards with
    an index); with it, key ``k`` goes into ``model-0000i-of-0000n.safetensors`` for
    ``i = fqn_to_index_mapping[k]`` and the index is written. ``save_distributed`` and
    ``enable_consolidation`` are accepted either way: every rank always takes part and the
    output is always consolidated. The thread counts must stay 1. Non-tensor values are
    refused (the format holds tensors only).

    Example::

        >>> dcp.save(model.state_dict(), storage_writer=dcp.HuggingFaceStorageWriter("hf-out"))
        >>> config.save_pretrained("hf-out")      # then AutoModel.from_pretrained("hf-out")
    """

    def __init__(
        self,
        path: str,
        fqn_to_index_mapping: dict[str, int] | None = None,
        thread_count: int = 1,
        save_distributed: bool = False,
        enable_consolidation: bool = False,
        thread_count_consolidation: int = 1,
    ) -> None:
        _check_path("HuggingFaceStorageWriter", path)
        if fqn_to_index_mapping is not None and not isinstance(fqn_to_index_mapping, Mapping):
            raise ValueError(
                f"fqn_to_index_mapping={fqn_to_index_mapping!r}: expected a dict "
                "{key: file index from 1} or None"
            )
        refuse("thread_count", thread_count, 1, "tensors are written by one thread; drop it")
        refuse("thread_count_consolidation", thread_count_consolidation, 1,
               "rank 0 assembles one tensor at a time; drop the argument")  # fmt: skip
        self.path = Path(path)
        self.fqn_to_index_mapping = (
            None if fqn_to_index_mapping is None else dict(fqn_to_index_mapping)
        )
        self.save_distributed = bool(save_distributed)
        self.enable_consolidation = bool(enable_consolidation)

    _dcp_driven = True

    def _dcp_persist(self, write, snapshot, group, problems: list[str]):
        """Save into the staging directory with ``write``, then export (see the module)."""
        return save_hf(write, snapshot, self, group, problems)


class HuggingFaceStorageReader(PathReader):
    """Load a Hugging Face safetensors folder (or file) into any layout: ``load_hf`` by name.

    Example::

        >>> dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader("llama-hf"))
    """

    def __init__(self, path: str, thread_count: int = 1) -> None:
        _check_path("HuggingFaceStorageReader", path)
        refuse("thread_count", thread_count, 1, "each rank maps the files it needs; drop it")
        self.path = Path(path)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The folder's tensors as PyTorch's ``Metadata`` (one chunk per tensor)."""
        return to_public(self._dcp_source()[1], str(self.path))

    _dcp_driven = True
    _dcp_whole_source = True  # as load_hf: every tensor of the files counts

    def _dcp_source(self):
        """``(directory, metadata)`` of the folder, as ``load_hf`` reads it."""
        return read_hf_metadata(self.path)


def hf_save_problems(writer: HuggingFaceStorageWriter, snapshot) -> list[str]:
    """What this rank's snapshot holds that a Hugging Face folder cannot (shared, then raised)."""
    problems = []
    if snapshot.values:
        problems.append(
            "HuggingFaceStorageWriter stores tensors only; these values would be lost: "
            + ", ".join(sorted(snapshot.values)[:20])
            + " (save them with FileSystemWriter, or leave them out)"
        )
    mapping = writer.fqn_to_index_mapping
    if mapping is not None:
        unmapped = sorted(k for k in snapshot.items if k not in mapping)
        if unmapped:
            problems.append(
                f"fqn_to_index_mapping has no file index for: {', '.join(unmapped[:20])}"
            )
    return problems


def save_hf(write, snapshot, writer: HuggingFaceStorageWriter, group, problems: list[str]):
    """Save into the staging directory with ``write``, then export on rank 0 and agree."""
    staging = writer.path / STAGING
    md = write(snapshot, staging, group, list(problems) + hf_save_problems(writer, snapshot))
    outcome = []
    if group.rank == 0:
        try:
            export_hf(staging, writer.path, file_index=writer.fqn_to_index_mapping)
        except Exception as e:  # out of memory too: the other ranks wait in agree() for it
            outcome.append(
                f"cannot write the Hugging Face files in {writer.path}: {type(e).__name__}: {e}"
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    group.agree(outcome)
    return md
