"""``save`` and ``load``: sharded state dicts to a checkpoint directory and back, any layout.

Save, on every rank of the group, in three exchanges ([Note: the three exchanges of a save])::

    1. flatten the state dict; describe the block each tensor holds here   (planner)
    2. exchange descriptions and problems; choose one writer per block     (exchange 1)
    3. write this rank's blocks into <dir>.partial-<token>/rank-NNNNN.safetensors, fsync
    4. exchange byte ranges and CRCs (exchange 2); rank 0 writes metadata.json, fsyncs, moves
       an older checkpoint at <dir> aside and renames the partial directory to <dir>; every
       rank learns whether that worked                                    (exchange 3)

A crash before step 4's renames leaves ``<dir>`` as it was; a crash between them leaves the
previous checkpoint aside, where ``load`` finds it ([Note: replacing a checkpoint]). Load,
on every rank::

    1. parse metadata.json (checked as hostile input); match keys, shapes and kinds
    2. for each tensor, intersect the block this rank holds with the saved chunks
    3. check the headers and CRCs of exactly the chunks it will read; share the problems
    4. only when every rank found none: copy the overlaps into the caller's tensors

so a damaged checkpoint raises on every rank before anything in the state dict changes.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from dtensor.checkpoint._comm import Group
from dtensor.checkpoint._flatten import decode_value, encode_value, flatten, set_path
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import (
    METADATA_FILE,
    Chunk,
    FileEntry,
    Metadata,
    TensorEntry,
    parse_metadata,
)
from dtensor.checkpoint.planner import LocalItem, assign_writers, local_item, read_plan
from dtensor.checkpoint.storage import DataFile, write_file
from dtensor.tensor import DTensor

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so leftovers of killed saves are never removed
    fcntl = None

logger = logging.getLogger(__name__)


def save(state_dict: Mapping, *, checkpoint_id: str | os.PathLike, process_group=None) -> None:
    """Write ``state_dict`` (nested dicts of DTensors, tensors and plain values) to a directory.

    Every rank of ``process_group`` (default: the world, or just this process when no group
    is initialized) calls it with its own shards. An existing checkpoint at ``checkpoint_id``
    is replaced only once the new one is complete.

    Example::

        >>> from dtensor import checkpoint as dcp
        >>> dcp.save({"model": model.state_dict(), "step": 10}, checkpoint_id="ckpt/step-10")
    """
    group = Group.of(process_group)
    snapshot, problems = _snapshot(state_dict)
    _write(snapshot, Path(checkpoint_id), group, problems)


def async_save(
    state_dict: Mapping, *, checkpoint_id: str | os.PathLike, process_group=None
) -> Future:
    """Snapshot ``state_dict`` to CPU now, write it in a background thread; returns a future.

    When it returns, the snapshot is taken: training may go on and change the model without
    changing what is written. ``future.result()`` returns None once the checkpoint is
    committed, or raises what ``save`` would have raised. The background thread talks over its
    own gloo group (same ranks, created on first use), so its messages never interleave with
    the training's collectives.

    Example::

        >>> fut = dcp.async_save({"model": model.state_dict()}, checkpoint_id="ckpt/step-10")
        >>> train_more()
        >>> fut.result()
    """
    group = Group.of(process_group)
    snapshot, problems = _snapshot(state_dict, copy=True)
    group.agree(problems)  # a value that cannot be saved raises here, on every rank
    background = group.companion()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-async-save")
    future = pool.submit(_write, snapshot, Path(checkpoint_id), background, [])
    pool.shutdown(wait=False)
    return future


class _Snapshot:
    """What a rank will write: its tensor blocks (as CPU tensors) and the encoded values."""

    def __init__(self, items: dict[str, LocalItem], values: dict[str, object]) -> None:
        self.items = items
        self.values = values


def _snapshot(state_dict: Mapping, *, copy: bool = False) -> tuple[_Snapshot, list[str]]:
    """This rank's blocks and values, and the problems found (shared by the caller)."""
    problems, items, values = [], {}, {}
    try:
        for key, (_, leaf) in sorted(flatten(state_dict).items()):
            if key == "__metadata__":
                raise CheckpointError("'__metadata__' is reserved by safetensors; rename that key")
            if isinstance(leaf, torch.Tensor):
                item = local_item(key, leaf.detach(), for_save=True)
                local = item.local.detach()
                if local.device.type != "cpu" or copy:
                    local = local.to("cpu", copy=True)
                item.local = local.contiguous()
                items[key] = item
            else:
                values[key] = encode_value(key, leaf)
    except CheckpointError as e:
        problems.append(str(e))
    return _Snapshot(items, values), problems


# [Note: the three exchanges of a save]
# A save exchanges three times, each one all_gather of JSON (Group.agree), and each carries
# every rank's problems so far, so all ranks raise together or go on together:
#   1. the plan: the snapshot's problems (a value that cannot be saved), rank 0's preparing
#      of the partial directory, the token naming it, and each rank's block descriptions;
#   2. after the writes: each rank's file (size, header CRC, byte ranges and CRCs of its
#      blocks) or why it could not write; only when every file is complete and durable does
#      rank 0 commit (metadata.json, fsync, renames);
#   3. the commit's outcome from rank 0, so every rank returns or raises the same error.
# Exchange 1 is also where the snapshot's problems are shared: a separate exchange for them
# alone (as before) bought nothing, since nothing is written before exchange 1 either way.
# Exchange 3 cannot be dropped: without it the other ranks would return before the rename
# and would not hear of a failed commit. async_save shares the snapshot's problems on the
# caller's group before returning (so a value that cannot be saved raises at the call), then
# makes the same three exchanges on its background group.
def _write(snap: _Snapshot, final: Path, group: Group, problems: list[str]) -> None:
    token, problems, lock = None, list(problems), None
    if group.rank == 0 and not problems:
        token = uuid.uuid4().hex[:12]
        try:
            _check_target(final)
            final.parent.mkdir(parents=True, exist_ok=True)
            lock = _SavesLock(final.parent)
            lock.tidy(final)
            _partial_dir(final, token).mkdir()
        except (OSError, CheckpointError) as e:
            problems.append(f"cannot prepare {final}: {e}")
    try:
        _write_and_commit(snap, final, group, token, problems)
    finally:
        if lock is not None:
            lock.tidy(final)  # an older checkpoint kept aside by an earlier crash is stale now
            lock.release()


def _write_and_commit(snap: _Snapshot, final: Path, group: Group, token, problems) -> None:
    mine = None if token is None else _partial_dir(final, token)  # rank 0's, if it made one
    described = {k: i.describe() for k, i in snap.items.items()}
    plan = {"token": token, "items": described, "values": snap.values}
    gathered = _agree_or_discard(group, problems, plan, mine)  # exchange 1
    token = gathered[0]["token"]
    partial = _partial_dir(final, token)
    try:
        entries, writes = assign_writers([g["items"] for g in gathered])
    except CheckpointError as e:
        _discard(partial, group)
        raise e
    written, problems = _write_my_file(snap, writes[group.rank], partial, group.rank)
    reports = _agree_or_discard(group, problems, written, partial)  # exchange 2
    problems = []
    if group.rank == 0:
        try:
            md = _metadata(entries, reports, gathered)
            _commit(md, partial, final)
        except (OSError, CheckpointError) as e:
            problems.append(f"cannot commit {final}: {e}")
            shutil.rmtree(partial, ignore_errors=True)
    group.agree(problems)  # exchange 3
    logger.info("saved %d tensors to %s", len(entries), final)


def _write_my_file(snap: _Snapshot, mine: list, partial: Path, rank: int):
    if not mine:
        return None, []
    name = f"rank-{rank:05d}.safetensors"
    blocks = [(key, snap.items[key].local) for key, _ in mine]
    try:
        entry, spans = write_file(partial / name, blocks)
    except OSError as e:
        return None, [f"cannot write {partial / name}: {e}"]
    boxes = {key: [list(box[0]), list(box[1])] for key, box in mine}
    report = {
        "file": name,
        "entry": [entry.bytes, entry.header_end, entry.header_crc32],
        "chunks": {key: boxes[key] + list(span) for key, span in spans.items()},
    }
    return report, []


def _agree_or_discard(group: Group, problems, payload, partial: Path | None) -> list:
    try:
        return group.agree(problems, payload)
    except CheckpointError:
        _discard(partial, group)
        raise


def _discard(partial: Path | None, group: Group) -> None:
    if group.rank == 0 and partial is not None:
        shutil.rmtree(partial, ignore_errors=True)


def _metadata(entries, reports: list, gathered: list) -> Metadata:
    md = Metadata()
    chunks: dict[str, list[Chunk]] = {key: [] for key in entries}
    for report in reports:
        if report is None:
            continue
        md.files[report["file"]] = FileEntry(*report["entry"])
        for key, (offs, sizes, start, end, crc) in report["chunks"].items():
            chunks[key].append(Chunk(tuple(offs), tuple(sizes), report["file"], start, end, crc))
    for key, (dtype, shape) in sorted(entries.items()):
        md.tensors[key] = TensorEntry(
            dtype, shape, tuple(sorted(chunks[key], key=lambda c: c.offsets))
        )
    for doc in reversed(gathered):  # rank 0's values win; other ranks may add keys
        md.values.update(doc["values"])
    return md


def _partial_dir(final: Path, token: str) -> Path:
    return final.parent / f".{final.name}.partial-{token}"


def _aside_dirs(final: Path, kind: str) -> list[Path]:
    """The ``.<name>.partial-*`` (``kind="partial"``) or ``.<name>.old-*`` directories of
    ``final``."""
    prefix = f".{final.name}.{kind}-"
    if not final.parent.is_dir():
        return []
    return sorted(p for p in final.parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


# [Note: replacing a checkpoint]
# Replacing a checkpoint takes two renames (the old one aside to .<name>.old-<token>, then the
# partial directory to <name>); no portable rename swaps two directories. A crash between them
# leaves nothing at <name> and the complete previous checkpoint aside: load() then reads that
# one (logging where), and a later save cleans it up once <name> holds a checkpoint again.
# A save that was killed leaves its .<name>.partial-<token> behind; the next save to <name>
# removes it. What it must never remove is the partial directory of a save still in flight
# (an async_save of this process, or another job, writing the same path). So rank 0 of every
# save holds a shared flock on the parent directory from before it creates its partial
# directory until after its commit, and leftovers are removed only under an exclusive flock,
# taken without waiting: when any save into that parent directory is in flight, the clean-up
# is skipped and left to a later save. flock locks belong to an open file, so this also tells
# two saves of one process apart; where the file system refuses the lock (some network file
# systems), nothing is removed.
class _SavesLock:
    """Rank 0's shared lock on the directory a checkpoint is saved into (see the Note)."""

    def __init__(self, parent: Path) -> None:
        self._fd = os.open(parent, os.O_RDONLY)
        self._locked = _flock(self._fd, "shared")

    def tidy(self, final: Path) -> None:
        """Remove what killed or cut-short saves left of ``final``, if no save is in flight."""
        if not self._locked:
            return
        try:
            if _flock(self._fd, "exclusive"):
                stale = _aside_dirs(final, "partial")
                if (final / METADATA_FILE).is_file():
                    stale += _aside_dirs(final, "old")
                for path in stale:
                    logger.info("removing %s, left by a save that did not finish", path)
                    shutil.rmtree(path, ignore_errors=True)
        finally:
            # back to shared, also after a refused upgrade: flock(2) may drop the shared lock
            # before it finds the exclusive one taken
            _flock(self._fd, "shared")

    def release(self) -> None:
        os.close(self._fd)


def _flock(fd: int, mode: str) -> bool:
    """Take (``"shared"``, waiting) or try (``"exclusive"``) a flock; False if not taken."""
    if fcntl is None:
        return False
    try:
        if mode == "shared":
            fcntl.flock(fd, fcntl.LOCK_SH)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held by another save, or locks unsupported here
        return False


def _check_target(final: Path) -> None:
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"{final} exists and is not a directory")
    if final.is_dir() and any(final.iterdir()) and not (final / METADATA_FILE).is_file():
        raise CheckpointError(
            f"{final} is a non-empty directory that is not a checkpoint; refusing to replace it"
        )


def _commit(md: Metadata, partial: Path, final: Path) -> None:
    """Write metadata.json last, make everything durable, then swap the directory in."""
    path = partial / METADATA_FILE
    with open(path, "w") as f:
        f.write(md.to_json())
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{partial.name.rsplit('-', 1)[-1]}"
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    state_dict: dict, *, checkpoint_id: str | os.PathLike, process_group=None, strict: bool = True
) -> None:
    """Fill ``state_dict`` in place from a checkpoint, resharding to whatever layout it has.

    Each DTensor receives its own block, read from the saved chunks that overlap it; plain
    tensors receive the whole tensor; plain values are replaced. With ``strict`` (default),
    keys the state dict has and the checkpoint lacks, and checkpoint keys missing from the
    state dict whose first dotted component (``model`` in ``model.wq.weight``) is one of the
    state dict's, are one error listing them all. A shape
    mismatch is always an error. Nothing is changed unless every rank can load everything.

    Example::

        >>> sd = {"model": model.state_dict()}
        >>> dcp.load(sd, checkpoint_id="ckpt/step-10")   # model's DTensors now hold the values
    """
    directory = Path(checkpoint_id)

    def open_source():
        found = _kept_checkpoint(directory)
        return found, read_metadata(found)

    load_from(
        state_dict,
        open_source,
        group=Group.of(process_group),
        strict=strict,
        whole_source=False,
    )


def load_from(state_dict: dict, open_source, *, group: Group, strict: bool, whole_source: bool):
    """The load procedure, for any source described as :class:`Metadata` (ours or Hugging Face's).

    ``open_source()`` returns ``(directory, metadata)``. With ``whole_source``, every tensor of
    the source counts as unexpected when the state dict lacks it; otherwise only those under
    the state dict's own top-level names do (loading ``{"model": ...}`` from a checkpoint that
    also holds ``optim`` is fine).
    """
    problems, plan = [], None
    try:
        directory, md = open_source()
        plan = _load_plan(state_dict, md, strict, whole_source)
        _check_sources(directory, md, plan)
    except (CheckpointError, OSError) as e:
        problems.append(str(e))
    except Exception as e:  # anything else must still reach agree(), or the others would hang
        problems.append(f"{type(e).__name__}: {e}")
    group.agree(problems)
    for path, value in plan.values:
        set_path(state_dict, path, value)
    with torch.no_grad():
        for dest, reads, dtype in plan.copies:
            for r in reads:
                dest[r.dst].copy_(plan.files[r.chunk.file].tensor(r.chunk, dtype)[r.src])
    logger.info("loaded %d tensors from %s", len(plan.copies), directory)


def _kept_checkpoint(directory: Path) -> Path:
    """``directory``, or where a save cut off between its two renames left the previous
    checkpoint ([Note: replacing a checkpoint]) when nothing is at ``directory``."""
    if directory.exists():
        return directory
    kept = [p for p in _aside_dirs(directory, "old") if (p / METADATA_FILE).is_file()]
    if not kept:
        return directory
    newest = max(kept, key=lambda p: (p / METADATA_FILE).stat().st_mtime_ns)
    logger.warning(
        "%s is missing: a save was interrupted while replacing it; loading the previous "
        "checkpoint, kept at %s",
        directory,
        newest,
    )
    return newest


def read_metadata(directory: Path) -> Metadata:
    """Parse ``directory``'s metadata.json against the files actually present.

    Example::

        >>> read_metadata(Path("ckpt/step-10")).tensors["model.wq.weight"].shape
        (768, 768)
    """
    directory = Path(directory)
    path = directory / METADATA_FILE
    if not path.is_file():
        hint = ""
        aside = sorted(directory.parent.glob(f".{directory.name}.old-*"))
        if aside:
            hint = (
                f"; a save was interrupted while swapping it in: the previous one is at {aside[-1]}"
            )
        raise CheckpointError(f"{directory} is not a checkpoint: it has no {METADATA_FILE}{hint}")
    if path.stat().st_size > 1 << 30:
        raise CheckpointError(f"{path} is {path.stat().st_size} bytes; refusing to parse it")
    on_disk = {
        p.name: p.stat().st_size for p in directory.iterdir() if p.is_file() and not p.is_symlink()
    }
    return parse_metadata(path.read_bytes(), on_disk)


class _LoadPlan:
    def __init__(self) -> None:
        self.values: list[tuple[tuple, object]] = []
        self.copies: list[tuple[torch.Tensor, list, str]] = []  # (destination, reads, dtype)
        self.needed: dict[str, list] = {}  # file -> [(key, chunk, dtype)]
        self.files: dict[str, DataFile] = {}  # opened and checked by _check_sources


def _load_plan(state_dict: Mapping, md: Metadata, strict: bool, whole_source: bool) -> _LoadPlan:
    plan, missing, mismatched = _LoadPlan(), [], []
    flat = flatten(state_dict)
    filled: set[tuple] = set()  # the memory some key fills (a tied twin needs no entry)
    tensors = sorted((k, v) for k, v in flat.items() if isinstance(v[1], torch.Tensor))
    for key, (_, leaf) in tensors:
        entry = md.tensors.get(key)
        if entry is None:
            continue
        item = local_item(key, leaf, for_save=False)
        if item.shape != entry.shape:
            mismatched.append(
                f"{key} (checkpoint {list(entry.shape)}, state dict {list(item.shape)})"
            )
            continue
        reads = read_plan(entry, item.box)
        for r in reads:
            plan.needed.setdefault(r.chunk.file, []).append((key, r.chunk, entry.dtype))
        plan.copies.append((item.local, reads, entry.dtype))
        filled.add(_memory(item.local))
    for key, (path, leaf) in sorted(flat.items()):
        if isinstance(leaf, torch.Tensor):
            if key not in md.tensors and not _filled_elsewhere(leaf, filled):
                (mismatched if key in md.values else missing).append(key)
        elif key in md.values:
            plan.values.append((path, decode_value(md.values[key])))
        else:
            (mismatched if key in md.tensors else missing).append(key)
    roots = {key.split(".", 1)[0] for key in flat}
    unexpected = [k for k in sorted(md.tensors.keys() | md.values.keys())
                  if k not in flat and (whole_source or k.split(".", 1)[0] in roots)]  # fmt: skip
    lines = []
    if mismatched:
        lines.append("mis-shaped or of the wrong kind: " + ", ".join(mismatched))
    if strict and missing:
        lines.append("missing from the checkpoint: " + ", ".join(missing))
    if strict and unexpected:
        lines.append("in the checkpoint but not in the state dict: " + ", ".join(unexpected))
    if lines:
        hint = "" if mismatched else " (pass strict=False to load the keys that match)"
        raise CheckpointError(
            "the state dict does not match the checkpoint" + hint + ":\n" + "\n".join(lines)
        )
    return plan


def _memory(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _filled_elsewhere(leaf: torch.Tensor, filled: set[tuple]) -> bool:
    """Whether a key absent from the checkpoint needs nothing: its block is the very memory
    another key fills (``state_dict()`` detaches a tied parameter under each of its names), or
    it is empty on this rank (the ranks that hold some of it decide)."""
    local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
    if local.numel() == 0:
        return leaf.numel() > 0
    return _memory(local) in filled


def _check_sources(directory: Path, md: Metadata, plan: _LoadPlan) -> None:
    """Open each file this rank reads; check its header and the CRC of every chunk it needs."""
    for name, uses in sorted(plan.needed.items()):
        f = DataFile(directory / name, md.files[name])
        for key, chunk, dtype in uses:
            if chunk.crc32 is not None:  # else the chunk was described from this very header
                f.check_chunk(key, chunk, dtype)
            f.check_crc(key, chunk)
        plan.files[name] = f
