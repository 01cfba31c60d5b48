"""Data files: safetensors written and read in place, with a CRC-32 per chunk.

The safetensors layout is: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets relative to the
end of the header), then the raw little-endian bytes of each tensor. We write it ourselves so
that each tensor goes from its own memory to the file (no staging copy) and its CRC-32 is
taken on the way; the files load with the ``safetensors`` library unchanged
([Note: the write path]).

Reading maps the file (a private, copy-on-write mapping), checks the header against
``metadata.json``, and hands out tensors that view the mapped bytes: a rank touches only the
chunks it needs.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
import sys
import zlib
from pathlib import Path

import torch

from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import DTYPE_NAMES, DTYPES, Chunk, FileEntry

MAX_HEADER_BYTES = 100 << 20


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (no copy).

    Example::

        >>> len(tensor_bytes(torch.zeros(3, dtype=torch.bfloat16)))
        6
    """
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def write_file(
    path: Path, items: list[tuple[str, torch.Tensor]]
) -> tuple[FileEntry, dict[str, tuple[int, int, int]]]:
    """Write ``items`` (name, contiguous CPU tensor) as one safetensors file, fsync it.

    Returns the file's entry and, per name, ``(start, end, crc32)`` with absolute byte offsets.

    Example::

        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "a.safetensors"
        >>> entry, spans = write_file(p, [("w", torch.ones(2))])
        >>> spans["w"][:2], entry.bytes == p.stat().st_size
        ((64, 72), True)
    """
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in items]
    return write_stream(path, specs, (t for _, t in items))


def write_stream(
    path: Path,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors,
    *,
    file_metadata: dict[str, str] | None = None,
):
    """Like :func:`write_file`, with the header from ``specs`` and the tensors produced lazily.

    ``tensors`` yields one contiguous CPU tensor per spec, in order, so a caller can build each
    just before it is written (``consolidate`` keeps one full tensor in memory at a time).
    ``file_metadata`` becomes the header's ``__metadata__`` (string to string, as safetensors
    requires; Hugging Face loaders look for ``{"format": "pt"}`` there).
    """
    header, cursor = {}, 0
    if file_metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in file_metadata.items()}
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [cursor, cursor + nbytes]}  # fmt: skip
        cursor += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as safetensors does
    head = struct.pack("<Q", len(text)) + text
    header_end = len(head)
    spans = {}
    with open(path, "wb", buffering=0) as f:
        out = _Stream(f)
        out.write(head)
        for (name, dtype, shape), t in zip(specs, tensors, strict=True):
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"{name}: got {t.dtype} {tuple(t.shape)}, header says {dtype} {shape}"
                )
            lo, hi = header[name]["data_offsets"]
            spans[name] = (header_end + lo, header_end + hi, out.write(tensor_bytes(t)))
        out.finish()
    entry = FileEntry(
        bytes=header_end + cursor, header_end=header_end, header_crc32=zlib.crc32(head)
    )
    return entry, spans


# [Note: the write path]
# A save is as fast as the disk only if the disk is busy from the first byte to the last.
# Written plainly (write() everything, then one fsync), the bytes sit in the page cache until
# the fsync (a machine with gigabytes of memory starts writing back dirty pages only after
# 10% of it is dirty or 30 s have passed), so the disk idles while the process copies and
# checksums, and the process idles while the disk writes. So each file is written in pieces
# of PIECE bytes straight from the tensor's memory (a memoryview: no copy but the kernel's
# own into the page cache), each piece's CRC-32 is folded in just before its write (while the
# piece is in the CPU cache), and every KICK bytes we ask the kernel to start writing that
# range back (sync_file_range(SYNC_FILE_RANGE_WRITE): it queues the I/O and returns). The disk
# then writes while we copy and checksum the next pieces; the one fsync at the end (which
# also makes the file's size durable) waits only for the tail. Where sync_file_range is not
# available (not Linux), the file is written the plain way, as correct and slower.
_PIECE = 4 << 20
_KICK = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _find_sync_file_range():
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _find_sync_file_range()


class _Stream:
    """Writes buffers to a raw file in pieces, CRC-32 on the way, starting writeback early."""

    def __init__(self, f) -> None:
        self._f = f
        self._fd = f.fileno()
        self._offset = 0  # bytes written
        self._kicked = 0  # bytes whose writeback has been started

    def write(self, data) -> int:
        """Write all of ``data`` (bytes-like); returns its CRC-32."""
        view = memoryview(data).cast("B")
        crc = 0
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            crc = zlib.crc32(piece, crc)
            while piece:  # a regular file takes it all at once, short of an error
                piece = piece[self._f.write(piece) :]
            self._offset += min(_PIECE, len(view) - start)
            if self._offset - self._kicked >= _KICK:
                self._start_writeback()
        return crc

    def _start_writeback(self) -> None:
        if _sync_file_range is not None and self._offset > self._kicked:
            # a hint: if the kernel refuses it, the fsync in finish() writes those bytes
            _sync_file_range(
                self._fd, self._kicked, self._offset - self._kicked, _SYNC_FILE_RANGE_WRITE
            )
        self._kicked = self._offset

    def finish(self) -> None:
        """Make everything written durable (one fsync)."""
        self._start_writeback()
        os.fsync(self._fd)


class DataFile:
    """One mapped data file whose header has been checked against ``metadata.json``.

    Example::

        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "a.safetensors"
        >>> entry, spans = write_file(p, [("w", torch.arange(4.0))])
        >>> chunk = Chunk((0,), (4,), p.name, *spans["w"])
        >>> f = DataFile(p, entry)
        >>> f.check_chunk("w", chunk, "F32")
        >>> f.tensor(chunk, "F32").tolist()
        [0.0, 1.0, 2.0, 3.0]
    """

    def __init__(self, path: Path, entry: FileEntry) -> None:
        self.name = path.name
        with open(path, "rb") as f:
            head = f.read(entry.header_end)
            if len(head) != entry.header_end or zlib.crc32(head) != entry.header_crc32:
                raise CheckpointError(f"{self.name}: its header is damaged (CRC-32 mismatch)")
            (n,) = struct.unpack("<Q", head[:8])
            if n + 8 != entry.header_end or n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{self.name}: header length {n} disagrees with metadata.json"
                )
            try:
                self.header = json.loads(head[8:])
            except ValueError as e:
                raise CheckpointError(f"{self.name}: the header is not JSON ({e})") from None
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if entry.bytes else None
        self._entry = entry

    def check_chunk(self, key: str, chunk: Chunk, dtype: str) -> None:
        """Check that the header lists ``key`` where metadata.json says, as ``dtype``."""
        info = self.header.get(key)
        begin = self._entry.header_end
        want = {
            "dtype": dtype,
            "shape": list(chunk.sizes),
            "data_offsets": [chunk.start - begin, chunk.end - begin],
        }
        if not isinstance(info, dict) or {k: info.get(k) for k in want} != want:
            raise CheckpointError(
                f"{self.name}: its header entry for {key!r} is {info!r}; metadata.json expects {want}"
            )

    def check_crc(self, key: str, chunk: Chunk) -> None:
        """Compare the chunk's bytes with the CRC-32 recorded in metadata.json.

        A chunk with no recorded CRC (``crc32`` None: a Hugging Face file, described from its
        own header) has nothing to compare with and passes.
        """
        if chunk.crc32 is None:
            return
        got = (
            zlib.crc32(memoryview(self._map)[chunk.start : chunk.end])
            if chunk.end > chunk.start
            else 0
        )
        if got != chunk.crc32:
            raise CheckpointError(
                f"{self.name}: bytes {chunk.start}..{chunk.end} ({key!r}) fail their CRC-32 check "
                "(the file is corrupted)"
            )

    def tensor(self, chunk: Chunk, dtype: str) -> torch.Tensor:
        """The chunk as a tensor viewing the mapped file (no copy)."""
        dt = DTYPES[dtype]
        if chunk.end == chunk.start:
            return torch.empty(chunk.sizes, dtype=dt)
        raw = torch.frombuffer(
            self._map, dtype=torch.uint8, count=chunk.end - chunk.start, offset=chunk.start
        )
        return raw.view(dt).view(chunk.sizes)
