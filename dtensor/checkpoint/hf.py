"""Hugging Face weights in and out: ``load_hf`` into any sharded layout, ``export_hf`` back.

A Hugging Face model folder holds either one ``model.safetensors`` or several
``model-0000i-of-0000n.safetensors`` files and a ``model.safetensors.index.json`` whose
``weight_map`` says which file holds each tensor. Every tensor is stored whole.

**In.** :func:`load_hf` reads the safetensors headers (checked as hostile input: plain file
names only, every byte range inside its file and the right size for its shape and dtype),
describes each tensor as one chunk covering all of it, and then runs the same load as
:func:`dtensor.checkpoint.load`: each rank intersects the block it holds with that chunk and
copies just those bytes out of the mapped file, so no rank reads or allocates a whole tensor
it does not own. The files carry no checksums; their headers are re-read and compared before
any data is used. A ``key_map`` renames Hugging Face keys to the state dict's (or drops them).

**Out.** :func:`export_hf` writes a checkpoint directory (ours) as a Hugging Face folder,
assembling one full tensor at a time, so memory stays near the largest tensor. Add the
model's ``config.json`` (``config.save_pretrained(out)``) and ``from_pretrained`` loads it.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

from dtensor.checkpoint._comm import Group
from dtensor.checkpoint.api import load_from, read_metadata
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import (
    DTYPES,
    MAX_NDIM,
    Chunk,
    FileEntry,
    Metadata,
    TensorEntry,
    is_int,
    itemsize,
    plain_file_name,
)
from dtensor.checkpoint.storage import MAX_HEADER_BYTES, write_stream
from dtensor.checkpoint.tools import Assembler

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB" (transformers 5's save_pretrained uses "50GB")
_MAX_INDEX_BYTES = 64 << 20

KeyMap = Callable[[str], "str | None"]


def load_hf(
    state_dict: dict,
    path: str | os.PathLike,
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
    process_group=None,
) -> None:
    """Fill ``state_dict`` (any layout) in place from Hugging Face safetensors weights.

    ``path`` is a ``.safetensors`` file or a model folder (``model.safetensors``, or sharded
    files with ``model.safetensors.index.json``). ``key_map(hf_key)`` returns the state-dict
    key for a Hugging Face key, or None to skip it. With ``strict`` (default), state-dict
    tensors the files lack and file tensors the state dict lacks are one error listing them
    all; a tensor tied to one that is loaded (the same object under two keys, as a tied
    ``lm_head``) needs no entry of its own. Values are converted to the state dict's dtypes.
    Every rank of ``process_group`` calls it; nothing changes unless every rank can load.

    Example::

        >>> from dtensor import checkpoint as dcp
        >>> fully_shard(model)                         # any layout: FSDP, HSDP, TP, 2-D
        >>> dcp.load_hf(model.state_dict(), "llama-hf/")
        >>> dcp.load_hf(wrapper.state_dict(), "llama-hf/", key_map=lambda k: "lm." + k)
    """
    load_from(
        state_dict,
        lambda: read_hf_metadata(path, key_map),
        group=Group.of(process_group),
        strict=strict,
        whole_source=True,
    )


def read_hf_metadata(
    path: str | os.PathLike, key_map: KeyMap | None = None
) -> tuple[Path, Metadata]:
    """Describe a Hugging Face safetensors file or folder: ``(directory, metadata)``.

    Each tensor becomes one chunk covering all of it, with no CRC (the files have none),
    keyed by ``key_map(hf_key)`` (tensors it maps to None are left out).

    Example::

        >>> directory, md = read_hf_metadata("llama-hf/")
        >>> md.tensors["model.norm.weight"].shape
        (2048,)
    """
    directory, names, index = _hf_files(Path(path))
    md = Metadata()
    origin: dict[str, str] = {}
    held: set[str] = set()
    for name in names:
        entry, tensors = _read_header(directory, name)
        md.files[name] = entry
        held |= set(tensors)
        for hf_key, tensor in tensors.items():
            if index is not None and index.get(hf_key, name) != name:
                raise CheckpointError(
                    f"{name} holds {hf_key!r}, which {INDEX_FILE} places in {index[hf_key]}"
                )
            key = hf_key if key_map is None else key_map(hf_key)
            if key is None:
                continue
            if not isinstance(key, str):
                raise CheckpointError(f"key_map({hf_key!r}) returned {key!r}; expected str or None")
            if key in md.tensors:
                raise CheckpointError(
                    f"{hf_key!r} and {origin[key]!r} both map to {key!r}; fix the key_map"
                )
            md.tensors[key], origin[key] = tensor, hf_key
    if index is not None:
        absent = sorted(set(index) - held)
        if absent:
            raise CheckpointError(
                f"{INDEX_FILE} lists tensors its files do not hold: {', '.join(absent[:20])}"
            )
    return directory, md


def _hf_files(path: Path) -> tuple[Path, list[str], dict[str, str] | None]:
    """The directory, the data files to read and the index's weight map (None without one)."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file")
        return path.parent, [path.name], None
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist")
    if (path / SINGLE_FILE).is_file():  # preferred over an index, as transformers does
        return path, [SINGLE_FILE], None
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_index(index_path)
        return path, sorted(set(weight_map.values())), weight_map
    present = sorted(p.name for p in path.iterdir())
    pickled = [n for n in present if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    hint = (
        f"; {', '.join(pickled)} would need unpickling, which this library never does "
        "(convert to safetensors first)"
        if pickled
        else ""
    )
    raise CheckpointError(
        f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (it holds: {present[:10]}){hint}"
    )


def _read_index(path: Path) -> dict[str, str]:
    if path.stat().st_size > _MAX_INDEX_BYTES:
        raise CheckpointError(f"{path} is {path.stat().st_size} bytes; refusing to parse it")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path} has no 'weight_map' object")
    for key, name in weight_map.items():
        if not plain_file_name(name):
            raise CheckpointError(
                f"{path}: {key!r} is mapped to {name!r}, which is not a plain '*.safetensors' "
                "name inside the folder (paths are refused)"
            )
        if not (path.parent / name).is_file():
            raise CheckpointError(f"{path}: {key!r} is mapped to {name}, which is missing")
    return weight_map


def _read_header(directory: Path, name: str) -> tuple[FileEntry, dict[str, TensorEntry]]:
    """Parse one file's safetensors header as hostile input, without reading its data."""
    path = directory / name
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{name}: {size} bytes, too short to be a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{name}: its header claims {n} bytes of a {size}-byte file (truncated or not "
                "safetensors)"
            )
        head = prefix + f.read(n)
    try:
        doc = json.loads(head[8:])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{name}: the header is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{name}: the header is not a JSON object")
    entry = FileEntry(bytes=size, header_end=8 + n, header_crc32=zlib.crc32(head))
    tensors = {
        key: _header_tensor(name, key, info, entry)
        for key, info in doc.items()
        if key != "__metadata__"
    }
    return entry, tensors


def _header_tensor(name: str, key: str, info, entry: FileEntry) -> TensorEntry:
    where = f"{name}: tensor {key!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} is not an object")
    dtype, shape, span = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{where} has dtype {dtype!r}; known: {sorted(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(is_int(s) for s in shape)):
        raise CheckpointError(f"{where} has shape {shape!r}; expected non-negative ints")
    if not (isinstance(span, list) and len(span) == 2 and all(is_int(x) for x in span)):
        raise CheckpointError(f"{where} has data_offsets {span!r}; expected [begin, end]")
    begin, end = entry.header_end + span[0], entry.header_end + span[1]
    nbytes = math.prod(shape) * itemsize(dtype)
    if not (begin <= end <= entry.bytes) or end - begin != nbytes:
        raise CheckpointError(
            f"{where}: bytes {begin}..{end} of a {entry.bytes}-byte file for {nbytes} bytes of "
            f"{dtype} {shape} (truncated or inconsistent)"
        )
    chunk = Chunk((0,) * len(shape), tuple(shape), name, begin, end, None)
    return TensorEntry(dtype=dtype, shape=tuple(shape), chunks=(chunk,))


def export_hf(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    *,
    key_map: KeyMap | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress=None,
    file_index: Mapping[str, int] | None = None,
) -> list[str]:
    """Write a checkpoint's tensors as a Hugging Face folder; returns the data files' names.

    ``key_map(key)`` gives the Hugging Face name of each checkpoint key, or None to leave it
    out (optimizer state, say). Files are filled in key order up to ``max_shard_bytes``; one
    file is ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``. The model files of an earlier export in ``out`` are
    removed first, each file is written under a temporary name and renamed, and the index
    comes last: an export cut short leaves a folder that fails to load, never one that mixes
    two exports. Every chunk's CRC-32 is checked as it is read.
    ``progress(key)`` is called after each tensor. ``file_index`` (PyTorch's
    ``fqn_to_index_mapping``) places each Hugging Face key in file ``i`` of ``n`` (``i`` from
    1, ``n`` the largest index), ``model-0000i-of-0000n.safetensors``, with the index file
    always written; ``max_shard_bytes`` is then not used.

    Example::

        >>> export_hf("ckpt/step-100", "hf-out", key_map=lambda k: k.removeprefix("model.")
        ...           if k.startswith("model.") else None)
        ['model.safetensors']
        >>> model.config.save_pretrained("hf-out")   # then from_pretrained("hf-out")
    """
    if not (isinstance(max_shard_bytes, int) and max_shard_bytes > 0):
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    directory, out = Path(directory), Path(out)
    md = read_metadata(directory)
    pairs = _export_keys(md, key_map)
    names, shards = _layout(pairs, md, max_shard_bytes, file_index)
    out.mkdir(parents=True, exist_ok=True)
    # What this export replaces goes first: an export cut short leaves a folder that fails
    # to load (no index, or a missing file), never one that mixes two exports.
    for stale in _model_files(out):
        stale.unlink()
    assembler = Assembler(directory, md)
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        specs = [
            (hf_key, DTYPES[md.tensors[key].dtype], md.tensors[key].shape) for hf_key, key in shard
        ]
        tmp = out / f".{name}.partial"
        try:
            write_stream(
                tmp, specs, _tensors(assembler, shard, progress), file_metadata={"format": "pt"}
            )
            os.replace(tmp, out / name)
        finally:
            tmp.unlink(missing_ok=True)
        weight_map.update({hf_key: name for hf_key, _ in shard})
    if len(names) > 1 or file_index is not None:  # the index last: it makes the folder loadable
        total = sum(md.tensors[key].nbytes for _, key in pairs)
        _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _model_files(out: Path) -> list[Path]:
    """The files an export writes: ``model.safetensors``, the index and numbered shards."""
    return [
        p
        for p in out.iterdir()
        if p.is_file() and (p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.match(p.name))
    ]


def _export_keys(md: Metadata, key_map: KeyMap | None) -> list[tuple[str, str]]:
    pairs, origin = [], {}
    for key in sorted(md.tensors):
        hf_key = key if key_map is None else key_map(key)
        if hf_key is None:
            continue
        if not isinstance(hf_key, str) or not hf_key or hf_key == "__metadata__":
            raise CheckpointError(f"key_map({key!r}) returned {hf_key!r}; expected a tensor name")
        if hf_key in origin:
            raise CheckpointError(f"{key!r} and {origin[hf_key]!r} both map to {hf_key!r}")
        origin[hf_key] = key
        pairs.append((hf_key, key))
    if not pairs:
        raise CheckpointError(
            f"nothing to export: the key_map left none of the {len(md.tensors)} tensors"
        )
    return pairs


def _split(pairs, md: Metadata, limit: int) -> list[list[tuple[str, str]]]:
    """Fill files in order; a tensor larger than the limit gets a file of its own."""
    shards, size = [[]], 0
    for hf_key, key in pairs:
        nbytes = md.tensors[key].nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((hf_key, key))
        size += nbytes
    return shards


def _layout(pairs, md: Metadata, max_shard_bytes: int, file_index) -> tuple[list[str], list]:
    """The files' names and the ``(hf_key, key)`` pairs each holds."""
    if file_index is not None:
        return _split_by_index(pairs, file_index)
    shards = _split(pairs, md, max_shard_bytes)
    n = len(shards)
    return [SINGLE_FILE] if n == 1 else [_shard_name(i + 1, n) for i in range(n)], shards


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _split_by_index(pairs, file_index: Mapping[str, int]) -> tuple[list[str], list[list]]:
    """Files named by PyTorch's ``fqn_to_index_mapping`` (indices from 1; empty ones skipped)."""
    bad = {k: v for k, v in file_index.items() if not (is_int(v, 1, 99999))}
    if bad:
        raise CheckpointError(
            f"fqn_to_index_mapping: indices must be ints from 1 to 99999, got {dict(list(bad.items())[:5])}"
        )
    unmapped = [hf_key for hf_key, _ in pairs if hf_key not in file_index]
    if unmapped:
        raise CheckpointError(
            f"fqn_to_index_mapping has no file index for {len(unmapped)} tensors: "
            f"{', '.join(unmapped[:20])}; map every key (indices from 1)"
        )
    n = max(file_index[hf_key] for hf_key, _ in pairs)
    by_file: dict[int, list] = {}
    for hf_key, key in pairs:
        by_file.setdefault(file_index[hf_key], []).append((hf_key, key))
    ordered = sorted(by_file)
    return [_shard_name(i, n) for i in ordered], [by_file[i] for i in ordered]


def _tensors(assembler: Assembler, shard, progress):
    for _, key in shard:
        yield assembler.full(key)
        if progress is not None:
            progress(key)


def _write_json(path: Path, doc) -> None:
    tmp = path.parent / f".{path.name}.partial"
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    os.replace(tmp, path)
