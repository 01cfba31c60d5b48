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
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from dtensor.checkpoint._comm import Group
from dtensor.checkpoint._compat import (
    expand_stateful,
    group_for,
    load_back,
    nested_stateful,
    resolve_reader,
    resolve_writer,
)
from dtensor.checkpoint._flatten import decode_value, encode_value, flatten, set_path
from dtensor.checkpoint._read import _aside_dirs
from dtensor.checkpoint._read import _kept_checkpoint as _kept_checkpoint  # re-exported
from dtensor.checkpoint._read import read_metadata as read_metadata  # re-exported
from dtensor.checkpoint.default_planner import SaveOptions, load_allows_partial, save_options
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import (
    DISCOVERY_FILE,
    DISCOVERY_TEXT,
    METADATA_FILE,
    Chunk,
    FileEntry,
    Metadata,
    TensorEntry,
)
from dtensor.checkpoint.planner import LocalItem, assign_writers, local_item, read_plan
from dtensor.checkpoint.public_metadata import Metadata as PublicMetadata
from dtensor.checkpoint.public_metadata import to_public
from dtensor.checkpoint.storage import DataFile, write_file
from dtensor.tensor import DTensor

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so leftovers of killed saves are never removed
    fcntl = None

logger = logging.getLogger(__name__)


def save(
    state_dict: Mapping,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer=None,
    planner=None,
    process_group=None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> PublicMetadata:
    """Write ``state_dict`` (nested dicts of DTensors, tensors, plain values and Stateful
    objects) to a directory; returns the checkpoint's :class:`~dtensor.checkpoint.Metadata`.

    Every rank of ``process_group`` (default: the world, or just this process when no group
    is initialized, or with ``no_dist=True``) calls it with its own shards. The target is
    ``checkpoint_id``, or ``storage_writer`` (a :class:`~dtensor.checkpoint.FileSystemWriter`
    or :class:`~dtensor.checkpoint.HuggingFaceStorageWriter`; ``checkpoint_id`` given too
    re-targets it, as in PyTorch). ``planner``: None or ``DefaultSavePlanner(...)``. A
    top-level value with ``state_dict()`` and ``load_state_dict()`` is saved as its
    ``state_dict()``. An existing checkpoint is replaced only once the new one is complete.
    ``use_collectives=False`` (PyTorch's uncoordinated save) is refused: the atomic commit
    needs the ranks to agree.

    Example::

        >>> from dtensor import checkpoint as dcp
        >>> dcp.save({"model": model.state_dict(), "step": 10}, checkpoint_id="ckpt/step-10")
        >>> dcp.save({"model": model, "optim": opt},                    # Stateful values
        ...          storage_writer=dcp.FileSystemWriter("ckpt/step-10"),
        ...          planner=dcp.DefaultSavePlanner())
    """
    writer, options, group = _save_arguments(
        checkpoint_id, storage_writer, planner, process_group, no_dist, use_collectives
    )
    expanded = expand_stateful(state_dict)
    snapshot, problems = _snapshot(expanded)
    md = _persist(snapshot, writer, group, problems + nested_stateful(expanded), options)
    return to_public(md, str(writer.path))


def _save_arguments(checkpoint_id, storage_writer, planner, process_group, no_dist,
                    use_collectives):  # fmt: skip
    """Check a save's arguments (no collective yet): the writer, planner options, group."""
    if use_collectives is not True:
        raise ValueError(
            f"use_collectives={use_collectives!r} is not supported: the atomic commit needs "
            "every rank's files before metadata.json is written; pass use_collectives=True "
            "(default), or no_dist=True to save from this process alone"
        )
    writer = resolve_writer(checkpoint_id, storage_writer)
    return writer, save_options(planner), group_for(process_group, no_dist)


def _persist(snapshot, writer, group: Group, problems: list, options: SaveOptions) -> Metadata:
    """Write the snapshot where ``writer`` says: it calls back ``write`` (the save above)
    with the directory and its own problems (a Hugging Face writer then exports)."""

    def write(snap, target, grp, probs):
        return _write(snap, target, grp, probs, lowest_rank=options.lowest_rank)

    return writer._dcp_persist(write, snapshot, group, list(problems))


def async_save(
    state_dict: Mapping,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer=None,
    planner=None,
    process_group=None,
    async_checkpointer_type=None,
    async_stager=None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Future:
    """Snapshot ``state_dict`` to CPU now, write it in a background thread; returns a future.

    Takes :func:`save`'s arguments. When it returns, the snapshot is taken: training may go
    on and change the model without changing what is written. ``future.result()`` returns
    the checkpoint's ``Metadata`` once it is committed, as PyTorch's does, or raises what
    ``save`` would have raised. The background thread talks over its own gloo group
    (same ranks, created on first use), so its messages never interleave with the
    training's collectives. ``async_checkpointer_type`` may be PyTorch's
    ``AsyncCheckpointerType.THREAD`` (or ``"thread"``); a process (``PROCESS``) and a custom
    ``async_stager`` are refused: the snapshot is this library's own CPU copy.

    Example::

        >>> fut = dcp.async_save({"model": model.state_dict()}, checkpoint_id="ckpt/step-10")
        >>> train_more()
        >>> fut.result()
    """
    _check_async(async_checkpointer_type, async_stager)
    writer, options, group = _save_arguments(
        checkpoint_id, storage_writer, planner, process_group, no_dist, use_collectives
    )
    expanded = expand_stateful(state_dict)
    snapshot, problems = _snapshot(expanded, copy=True)
    group.agree(problems + nested_stateful(expanded))  # unsaveable values raise here, everywhere
    background = group.companion()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-async-save")

    def run():
        return to_public(_persist(snapshot, writer, background, [], options), str(writer.path))

    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def _check_async(async_checkpointer_type, async_stager) -> None:
    kind = getattr(async_checkpointer_type, "value", async_checkpointer_type)
    if kind not in (None, "thread"):
        raise ValueError(
            f"async_checkpointer_type={async_checkpointer_type!r} is not supported: the write "
            "runs on a background thread of this process (a process would need the snapshot "
            "pickled across); pass AsyncCheckpointerType.THREAD or leave it out"
        )
    if async_stager is not None:
        raise ValueError(
            f"async_stager={async_stager!r} is not supported: async_save takes its own CPU "
            "snapshot before returning; leave it out"
        )


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
def _write(
    snap: _Snapshot, final: Path, group: Group, problems: list[str], *, lowest_rank: bool = False
) -> Metadata:
    token, problems, lock = None, list(problems), None
    if group.rank == 0 and not problems:
        token = uuid.uuid4().hex[:12]
        try:
            _check_target(final)
            final.parent.mkdir(parents=True, exist_ok=True)
            lock = _SavesLock(final.parent)
            lock.tidy(final)
            _partial_dir(final, token).mkdir()
        except Exception as e:  # the other ranks wait in exchange 1 for rank 0
            problems.append(f"cannot prepare {final}: {e}")
    try:
        return _write_and_commit(snap, final, group, token, problems, lowest_rank)
    finally:
        if lock is not None:
            lock.tidy(final)  # an older checkpoint kept aside by an earlier crash is stale now
            lock.release()


def _write_and_commit(
    snap: _Snapshot, final: Path, group: Group, token, problems, lowest_rank: bool
) -> Metadata:
    mine = None if token is None else _partial_dir(final, token)  # rank 0's, if it made one
    described = {k: i.describe() for k, i in snap.items.items()}
    plan = {"token": token, "items": described, "values": snap.values, "dir": str(final)}
    gathered = _agree_or_discard(group, problems, plan, mine)  # exchange 1
    token = gathered[0]["token"]
    partial = _partial_dir(final, token)
    _check_one_directory([g["dir"] for g in gathered], partial, group)
    try:
        entries, writes = assign_writers([g["items"] for g in gathered], lowest_rank=lowest_rank)
    except CheckpointError as e:
        _discard(partial, group)
        raise e
    written, problems = _write_my_file(snap, writes[group.rank], partial, group.rank)
    reports = _agree_or_discard(group, problems, written, partial)  # exchange 2
    problems = []
    md = _metadata(entries, reports, gathered)  # on every rank: save() returns it
    if group.rank == 0:
        try:
            _commit(md, partial, final)
        except Exception as e:  # whatever it is, the other ranks wait in exchange 3 for it
            problems.append(f"cannot commit {final}: {type(e).__name__}: {e}")
            shutil.rmtree(partial, ignore_errors=True)
    group.agree(problems)  # exchange 3
    logger.info("saved %d tensors to %s", len(entries), final)
    return md


def _check_one_directory(dirs: list[str], partial: Path, group: Group) -> None:
    """Every rank saves into one directory: ranks that name different ones (a rank in the
    path) learn it together, before anything is written."""
    if len(set(dirs)) > 1:
        _discard(partial, group)
        named = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dirs))
        raise CheckpointError(
            f"the ranks passed different checkpoint_id directories ({named}); every rank of "
            "the group must pass the same one (each writes its own file inside it)"
        )


def _write_my_file(snap: _Snapshot, mine: list, partial: Path, rank: int):
    if not mine:
        return None, []
    name = f"rank-{rank:05d}.safetensors"
    blocks = [(key, snap.items[key].local) for key, _ in mine]
    try:
        entry, spans = write_file(partial / name, blocks)
    except Exception as e:  # out of memory too: the other ranks wait in exchange 2 for it
        return None, [f"cannot write {partial / name}: {type(e).__name__}: {e}"]
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
    for name, text in ((DISCOVERY_FILE, DISCOVERY_TEXT), (METADATA_FILE, md.to_json())):
        with open(partial / name, "w") as f:
            f.write(text)
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
    state_dict: dict,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader=None,
    planner=None,
    process_group=None,
    no_dist: bool = False,
    strict: bool = True,
) -> None:
    """Fill ``state_dict`` in place from a checkpoint, resharding to whatever layout it has.

    Each DTensor receives its own block, read from the saved chunks that overlap it; plain
    tensors receive the whole tensor; plain values are replaced. A top-level value with
    ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer, a data loader) is
    loaded into a fresh ``state_dict()`` and then given to its ``load_state_dict``, as in
    PyTorch. The source is ``checkpoint_id`` or ``storage_reader`` (a
    :class:`~dtensor.checkpoint.FileSystemReader` or
    :class:`~dtensor.checkpoint.HuggingFaceStorageReader`); ``planner``: None or
    ``DefaultLoadPlanner(...)``, whose ``allow_partial_load=True`` means ``strict=False``.
    With ``strict`` (default), keys the state dict has and the checkpoint lacks, and
    checkpoint keys missing from the state dict whose first dotted component (``model`` in
    ``model.wq.weight``) is one of the state dict's, are one error listing them all. A shape
    mismatch is always an error. Nothing is changed unless every rank can load everything.
    ``no_dist=True`` loads in this process alone.

    Example::

        >>> sd = {"model": model.state_dict()}
        >>> dcp.load(sd, checkpoint_id="ckpt/step-10")   # model's DTensors now hold the values
        >>> dcp.load({"model": model}, storage_reader=dcp.FileSystemReader("ckpt/step-10"),
        ...          planner=dcp.DefaultLoadPlanner())
    """
    reader = resolve_reader(checkpoint_id, storage_reader)
    strict = strict and not load_allows_partial(planner)
    group = group_for(process_group, no_dist)
    expanded = expand_stateful(state_dict)
    problems = nested_stateful(expanded)
    load_from(
        expanded,
        _source(reader, problems),
        group=group,
        strict=strict,
        whole_source=reader._dcp_whole_source,
    )
    load_back(state_dict, expanded)


def _source(reader, problems: list[str]):
    """``open_source`` for :func:`load_from`: raises (on this rank, inside the shared
    exchange) the problems found before reading, then opens what ``reader`` names."""

    def open_source():
        if problems:
            raise CheckpointError("\n".join(problems))
        return reader._dcp_source()

    return open_source


def save_state_dict(
    state_dict: dict,
    storage_writer,
    process_group=None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner=None,
) -> PublicMetadata:
    """Deprecated (as in PyTorch): :func:`save` with ``storage_writer`` given by position.

    Warns with a ``FutureWarning``, as PyTorch's does. ``coordinator_rank`` must be 0 (rank 0
    commits the checkpoint).

    Example::

        >>> dcp.save_state_dict(sd, dcp.FileSystemWriter("ckpt/1"))   # prefer dcp.save
    """
    warnings.warn("`save_state_dict` is deprecated; use `save`", FutureWarning, stacklevel=2)
    _check_coordinator(coordinator_rank)
    return save(state_dict, storage_writer=storage_writer, planner=planner,
                process_group=process_group, no_dist=no_dist)  # fmt: skip


def load_state_dict(
    state_dict: dict,
    storage_reader,
    process_group=None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner=None,
) -> None:
    """Deprecated (as in PyTorch): :func:`load` with ``storage_reader`` given by position.

    Warns with a ``FutureWarning``, as PyTorch's does. Unlike ``load`` (and like PyTorch's),
    it does not expand Stateful values. ``coordinator_rank`` must be 0.

    Example::

        >>> dcp.load_state_dict(sd, dcp.FileSystemReader("ckpt/1"))   # prefer dcp.load
    """
    warnings.warn("`load_state_dict` is deprecated; use `load`", FutureWarning, stacklevel=2)
    _check_coordinator(coordinator_rank)
    reader = resolve_reader(None, storage_reader)
    load_from(
        state_dict,
        _source(reader, []),
        group=group_for(process_group, no_dist),
        strict=not load_allows_partial(planner),
        whole_source=reader._dcp_whole_source,
    )


def _check_coordinator(coordinator_rank) -> None:
    if coordinator_rank != 0:
        raise ValueError(
            f"coordinator_rank={coordinator_rank!r} is not supported: rank 0 of the group "
            "commits the checkpoint; pass 0 (default)"
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
    _raise_on_mismatch(md, mismatched, missing if strict else [], unexpected if strict else [])
    return plan


def _raise_on_mismatch(md: Metadata, mismatched: list, missing: list, unexpected: list) -> None:
    lines = []
    if mismatched:
        lines.append("mis-shaped or of the wrong kind: " + ", ".join(mismatched))
    if missing:
        lines.append("missing from the checkpoint: " + ", ".join(missing))
    if unexpected:
        lines.append("in the checkpoint but not in the state dict: " + ", ".join(unexpected))
    saved = sorted({k.split(".", 1)[0] for k in md.tensors.keys() | md.values.keys()})
    absent = sorted({k.split(".", 1)[0] for k in missing} - set(saved))
    if absent:  # strict=False would load nothing there: a renamed or misspelt key, likely
        lines.append(
            f"the checkpoint holds nothing under {absent}; its top-level names are {saved}"
        )
    if lines:
        hint = "" if mismatched or absent else " (pass strict=False to load the keys that match)"
        raise CheckpointError(
            "the state dict does not match the checkpoint" + hint + ":\n" + "\n".join(lines)
        )


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
