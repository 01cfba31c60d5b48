"""The checkpoint's ``metadata.json``: what it holds, and the checks applied when it is read.

A checkpoint directory::

    metadata.json              this file (plain JSON, written last, by rank 0)
    rank-00000.safetensors     the chunks rank 0 wrote
    rank-00001.safetensors     ...

``metadata.json`` records, for every tensor, its global shape and dtype and the chunks that
tile it: each chunk's box (offsets, sizes), the file that holds it, its byte range in that
file and a CRC-32 of those bytes. Each file's size and the CRC-32 of its safetensors header
are recorded too, so every byte of every file is covered by a checksum. Non-tensor values
(optimizer hyperparameters, step counters kept as numbers) are stored inline as JSON.

:func:`parse_metadata` treats the file as hostile: every name, number and range is checked
before anything is allocated or any data file is opened.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

from dtensor.checkpoint._reshard import Box, coverage_problem, volume
from dtensor.checkpoint.errors import CheckpointError

FORMAT = "dtensor.checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"
#: Written beside ``metadata.json``: tools that find checkpoints by PyTorch's file name
#: (torchtitan's ``CheckpointManager`` resumes from the newest ``step-N`` holding a
#: ``.metadata``) find ours too. Plain text, not a pickle: PyTorch's reader fails loudly on it.
DISCOVERY_FILE = ".metadata"
DISCOVERY_TEXT = (
    "This directory is a dtensor.checkpoint checkpoint: safetensors files described by "
    "metadata.json (no pickle). Load it with dtensor.checkpoint.load; PyTorch's "
    "torch.distributed.checkpoint cannot read it.\n"
)
# Data files are plain names inside the checkpoint directory, never paths.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors$")
MAX_NDIM = 64

# dtype <-> the names safetensors uses in its headers (also used in metadata.json).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def plain_file_name(name: object) -> bool:
    """Whether ``name`` is a plain ``*.safetensors`` name (no path, not hidden).

    Example::

        >>> plain_file_name("rank-00000.safetensors"), plain_file_name("../x.safetensors")
        (True, False)
    """
    return isinstance(name, str) and bool(_FILE_NAME.match(name))


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a safetensors dtype name.

    Example::

        >>> itemsize("BF16")
        2
    """
    return DTYPES[dtype_name].itemsize


@dataclass(frozen=True)
class Chunk:
    """One saved block of a tensor: where it sits in the tensor and in which bytes of which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int  # absolute byte offset in the file
    end: int
    crc32: int | None  # None: no checksum recorded (a file we did not write)

    @property
    def box(self) -> Box:
        return self.offsets, self.sizes


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's global shape and dtype, and the chunks that tile it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return volume(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class FileEntry:
    """A data file's total size and the CRC-32 of its safetensors header (length prefix included)."""

    bytes: int
    header_end: int
    header_crc32: int


@dataclass
class Metadata:
    """Everything ``metadata.json`` says.

    Example::

        >>> md = Metadata(values={"step": 3})
        >>> parse_metadata(md.to_json(), files_on_disk={}).values
        {'step': 3}
    """

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)
    values: dict[str, object] = field(default_factory=dict)  # encoded JSON values

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "files": {
                name: {"bytes": f.bytes, "header_end": f.header_end, "header_crc32": f.header_crc32}
                for name, f in sorted(self.files.items())
            },
            "tensors": {
                key: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "chunks": [
                        {
                            "offsets": list(c.offsets),
                            "sizes": list(c.sizes),
                            "file": c.file,
                            "start": c.start,
                            "end": c.end,
                            "crc32": c.crc32,
                        }
                        for c in t.chunks
                    ],
                }
                for key, t in self.tensors.items()
            },
            "values": self.values,
        }
        return json.dumps(doc, indent=1, allow_nan=False)


def parse_metadata(text: str | bytes, files_on_disk: dict[str, int]) -> Metadata:
    """Parse and check ``metadata.json``; ``files_on_disk`` maps each file name to its size.

    Raises :class:`CheckpointError` naming the first problem: not JSON, an unknown format or
    version, a file name that is a path, a file missing or of the wrong size, a bad dtype or
    shape, chunks outside their tensor, overlapping or leaving elements missing, or a byte
    range that disagrees with the chunk's size or leaves its file.
    """
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{METADATA_FILE} is not valid JSON: {e}") from None
    _expect(isinstance(doc, dict), "the top level is not a JSON object")
    _expect(doc.get("format") == FORMAT, f"'format' is {doc.get('format')!r}, expected {FORMAT!r}")
    _expect(
        doc.get("version") == VERSION,
        f"'version' is {doc.get('version')!r}; this library reads version {VERSION}",
    )
    files = _parse_files(doc.get("files"), files_on_disk)
    tensors_doc = doc.get("tensors")
    _expect(isinstance(tensors_doc, dict), "'tensors' is not an object")
    tensors = {key: _parse_tensor(key, entry, files) for key, entry in tensors_doc.items()}
    values = doc.get("values")
    _expect(isinstance(values, dict), "'values' is not an object")
    clash = sorted(set(values) & set(tensors))
    _expect(not clash, f"keys {clash} are both tensors and values")
    return Metadata(tensors=tensors, files=files, values=values)


def _expect(ok: bool, problem: str) -> None:
    if not ok:
        raise CheckpointError(f"{METADATA_FILE}: {problem}")


def is_int(x, lo: int = 0, hi: int = 1 << 62) -> bool:
    """Whether ``x`` is a JSON integer (not a bool) in ``[lo, hi]``."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _parse_files(doc, on_disk: dict[str, int]) -> dict[str, FileEntry]:
    _expect(isinstance(doc, dict), "'files' is not an object")
    files = {}
    for name, entry in doc.items():
        _expect(
            plain_file_name(name),
            f"file name {name!r} is not a plain '*.safetensors' name inside the checkpoint "
            "directory (paths and hidden names are refused)",
        )
        _expect(isinstance(entry, dict), f"the entry for {name} is not an object")
        size, header_end, crc = (
            entry.get("bytes"),
            entry.get("header_end"),
            entry.get("header_crc32"),
        )
        _expect(is_int(size) and is_int(header_end, 8) and is_int(crc, 0, 0xFFFFFFFF),
                f"the entry for {name} needs integer 'bytes', 'header_end' and 'header_crc32'")  # fmt: skip
        _expect(
            header_end <= size, f"{name}: header ends at byte {header_end}, past its {size} bytes"
        )
        if name not in on_disk:
            raise CheckpointError(
                f"{name}: listed in {METADATA_FILE} but missing from the directory"
            )
        if on_disk[name] != size:
            raise CheckpointError(
                f"{name}: {on_disk[name]} bytes on disk, {METADATA_FILE} says {size} "
                "(truncated or replaced)"
            )
        files[name] = FileEntry(bytes=size, header_end=header_end, header_crc32=crc)
    return files


def _parse_tensor(key: str, doc, files: dict[str, FileEntry]) -> TensorEntry:
    where = f"tensor {key!r}"
    _expect(isinstance(doc, dict), f"{where} is not an object")
    dtype, shape = doc.get("dtype"), doc.get("shape")
    _expect(dtype in DTYPES, f"{where} has dtype {dtype!r}; known: {sorted(DTYPES)}")
    _expect(
        isinstance(shape, list) and len(shape) <= MAX_NDIM and all(is_int(s) for s in shape),
        f"{where} has shape {shape!r}; expected a list of at most {MAX_NDIM} non-negative ints",
    )
    chunks_doc = doc.get("chunks")
    _expect(isinstance(chunks_doc, list), f"{where} has no 'chunks' list")
    size = itemsize(dtype)
    chunks = tuple(
        _parse_chunk(where, i, c, len(shape), size, files) for i, c in enumerate(chunks_doc)
    )
    problem = coverage_problem(tuple(shape), [c.box for c in chunks])
    _expect(problem is None, f"{where} (shape {shape}): {problem}")
    return TensorEntry(dtype=dtype, shape=tuple(shape), chunks=chunks)


def _parse_chunk(where: str, i: int, doc, ndim: int, size: int, files) -> Chunk:
    _expect(isinstance(doc, dict), f"{where} chunk {i} is not an object")
    offs, sizes = doc.get("offsets"), doc.get("sizes")
    _expect(
        all(
            isinstance(v, list) and len(v) == ndim and all(is_int(x) for x in v)
            for v in (offs, sizes)
        ),
        f"{where} chunk {i} needs {ndim} non-negative integer 'offsets' and 'sizes'",
    )
    name = doc.get("file")
    _expect(name in files, f"{where} chunk {i} names file {name!r}, which 'files' does not list")
    start, end, crc = doc.get("start"), doc.get("end"), doc.get("crc32")
    _expect(is_int(start) and is_int(end) and is_int(crc, 0, 0xFFFFFFFF),
            f"{where} chunk {i} needs integer 'start', 'end' and 'crc32'")  # fmt: skip
    f = files[name]
    _expect(
        f.header_end <= start <= end <= f.bytes,
        f"{where} chunk {i}: bytes {start}..{end} are outside the data of {name} "
        f"({f.header_end}..{f.bytes})",
    )
    _expect(
        end - start == volume(sizes) * size,
        f"{where} chunk {i}: {end - start} bytes for {volume(sizes)} elements of {size} bytes",
    )
    return Chunk(tuple(offs), tuple(sizes), name, start, end, crc)
