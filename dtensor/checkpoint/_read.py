"""Finding and parsing a checkpoint's metadata: no process group, no other checkpoint module.

``read_metadata`` and ``_kept_checkpoint`` live here, below ``api`` and the storage classes,
so the storage classes can read metadata without importing the save and load engine
(``api`` re-exports both).
"""

from __future__ import annotations

import logging
from pathlib import Path

from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.metadata import METADATA_FILE, Metadata, parse_metadata

logger = logging.getLogger("dtensor.checkpoint.api")


def _aside_dirs(final: Path, kind: str) -> list[Path]:
    """The ``.<name>.partial-*`` (``kind="partial"``) or ``.<name>.old-*`` directories of
    ``final``."""
    prefix = f".{final.name}.{kind}-"
    if not final.parent.is_dir():
        return []
    return sorted(p for p in final.parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


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
