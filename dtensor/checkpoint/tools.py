"""Offline tools on a checkpoint directory, no process group needed: inspect, verify, consolidate.

``python -m dtensor.checkpoint`` wraps these in a command line; they are plain functions so
scripts and tests can call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dtensor.checkpoint.api import read_metadata
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import DTYPES, Metadata
from dtensor.checkpoint.planner import read_plan
from dtensor.checkpoint.storage import DataFile, write_stream


@dataclass(frozen=True)
class TensorSummary:
    """One row of ``inspect``: a tensor's key, shape, dtype, chunk count and size in bytes."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    chunks: int
    nbytes: int


def inspect(directory: str | Path) -> tuple[list[TensorSummary], Metadata]:
    """Summarize a checkpoint's tensors (metadata only; data files are not read).

    Example::

        >>> rows, md = inspect("ckpt/step-10")
        >>> rows[0].key, rows[0].shape
        ('model.blocks.0.attn.q.weight', (768, 768))
    """
    md = read_metadata(Path(directory))
    rows = [
        TensorSummary(k, t.shape, t.dtype, len(t.chunks), t.nbytes)
        for k, t in sorted(md.tensors.items())
    ]
    return rows, md


def verify(directory: str | Path) -> list[str]:
    """Every problem found in a checkpoint (empty when it is sound).

    Checks the metadata (as ``load`` does), each file's header against it, the CRC-32 of
    every chunk, and that each file's chunks tile its data with no byte unaccounted for.

    Example::

        >>> verify("ckpt/step-10")
        []
    """
    directory = Path(directory)
    try:
        md = read_metadata(directory)
    except (CheckpointError, OSError) as e:
        return [str(e)]
    by_file: dict[str, list] = {name: [] for name in md.files}
    for key, t in md.tensors.items():
        for chunk in t.chunks:
            by_file[chunk.file].append((key, chunk, t.dtype))
    problems = []
    for name, uses in sorted(by_file.items()):
        problems += _verify_file(directory, md, name, uses)
    return problems


def _verify_file(directory: Path, md: Metadata, name: str, uses: list) -> list[str]:
    entry = md.files[name]
    try:
        f = DataFile(directory / name, entry)
    except (CheckpointError, OSError) as e:
        return [str(e)]
    problems = []
    extra = sorted(set(f.header) - {"__metadata__"} - {key for key, _, _ in uses})
    if extra:
        problems.append(f"{name}: holds tensors metadata.json does not list: {extra}")
    cursor = entry.header_end
    for key, chunk, dtype in sorted(uses, key=lambda u: u[1].start):
        if chunk.start != cursor:
            problems.append(f"{name}: bytes {cursor}..{chunk.start} belong to no chunk")
        cursor = max(cursor, chunk.end)
        try:
            f.check_chunk(key, chunk, dtype)
            f.check_crc(key, chunk)
        except CheckpointError as e:
            problems.append(str(e))
    if cursor != entry.bytes:
        problems.append(f"{name}: bytes {cursor}..{entry.bytes} belong to no chunk")
    return problems


class Assembler:
    """Builds full tensors of a checkpoint from its chunks, checking each chunk's CRC-32 first.

    Example::

        >>> md = read_metadata(Path("ckpt/step-10"))
        >>> Assembler(Path("ckpt/step-10"), md).full("model.norm.weight").shape
        torch.Size([768])
    """

    def __init__(self, directory: Path, md: Metadata) -> None:
        self._directory, self._md = directory, md
        self._files: dict[str, DataFile] = {}

    def full(self, key: str) -> torch.Tensor:
        t = self._md.tensors[key]
        full = torch.empty(t.shape, dtype=DTYPES[t.dtype])
        for r in read_plan(t, ((0,) * len(t.shape), t.shape)):
            f = self._file(r.chunk.file)
            f.check_chunk(key, r.chunk, t.dtype)
            f.check_crc(key, r.chunk)
            full[r.dst] = f.tensor(r.chunk, t.dtype)[r.src]
        return full

    def _file(self, name: str) -> DataFile:
        if name not in self._files:
            self._files[name] = DataFile(self._directory / name, self._md.files[name])
        return self._files[name]


def consolidate(directory: str | Path, out: str | Path, *, key_map=None, progress=None) -> int:
    """Write every tensor of a checkpoint, whole, into one safetensors file; returns its size.

    Tensors are assembled one at a time, so memory stays near the largest tensor. Every chunk
    read is checked against its CRC-32 first. ``key_map(key)`` renames a key, or drops it by
    returning None. ``progress(key)`` is called after each tensor.

    Example::

        >>> consolidate("ckpt/step-10", "model.safetensors")
        390912000
    """
    directory = Path(directory)
    md = read_metadata(directory)
    names = {k: (k if key_map is None else key_map(k)) for k in sorted(md.tensors)}
    keys = [k for k, name in names.items() if name is not None]
    if len(set(names[k] for k in keys)) != len(keys):
        raise CheckpointError("the key_map gives two tensors the same name")
    if "__metadata__" in (names[k] for k in keys):
        raise CheckpointError(
            "the key_map names a tensor '__metadata__', which safetensors reserves"
        )
    assembler = Assembler(directory, md)

    def tensors():
        for key in keys:
            yield assembler.full(key)
            if progress is not None:
                progress(key)

    specs = [(names[k], DTYPES[md.tensors[k].dtype], md.tensors[k].shape) for k in keys]
    entry, _ = write_stream(Path(out), specs, tensors(), file_metadata={"format": "pt"})
    return entry.bytes
