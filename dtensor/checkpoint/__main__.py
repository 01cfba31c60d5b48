"""Command line: ``python -m dtensor.checkpoint {inspect,verify,consolidate} DIR ...``.

python -m dtensor.checkpoint inspect ckpt/step-100
python -m dtensor.checkpoint verify ckpt/step-100          # exit status 1 on any problem
python -m dtensor.checkpoint consolidate ckpt/step-100 full.safetensors
python -m dtensor.checkpoint consolidate ckpt/step-100 hf-out --hf --prefix model.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, export_hf
from dtensor.checkpoint.tools import consolidate, inspect, verify

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20,
          "GIB": 1 << 30}  # fmt: skip


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _inspect(args, console: Console) -> int:
    rows, md = inspect(args.dir)
    title = f"{args.dir}: {len(rows)} tensors, {len(md.files)} files"
    header = ("key", "shape", "dtype", "chunks", "bytes")
    body = [(r.key, str(list(r.shape)), r.dtype, str(r.chunks), _size(r.nbytes)) for r in rows]
    total = ("total", "", "", str(sum(r.chunks for r in rows)), _size(sum(r.nbytes for r in rows)))
    if console.is_terminal:
        table = Table(title=title)
        for col in header:
            right = col in ("chunks", "bytes")
            # a long key folds onto more lines, never loses characters to an ellipsis
            table.add_column(col, justify="right" if right else "left", overflow="fold")
        for cells in [*body, None, total]:
            if cells is None:
                table.add_section()
            else:
                table.add_row(*(Text(c) for c in cells))  # Text: a key is never markup
        console.print(table)
    else:
        # Piped or redirected: plain aligned columns, whole lines, whatever the width rich
        # would assume (80 columns off a terminal), so that grep and awk see every key.
        _plain(console, title)
        for line in _aligned([header, *body, total], right=(3, 4)):
            _plain(console, line)
    if md.values:
        _plain(console, f"values: {', '.join(sorted(md.values))}")
    return 0


def _aligned(rows: list[tuple[str, ...]], right: tuple[int, ...]) -> list[str]:
    """Rows of cells as lines of columns two spaces apart, padded to the widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _plain(console: Console, text: str, label: str = "", style: str = "") -> None:
    """One line, never wrapped or cropped; ``text`` is printed as it is (no rich markup, so a
    key or message with brackets stays intact)."""
    line = Text.assemble((label, style), " " if label else "", text)
    console.print(line, soft_wrap=True, highlight=False)


def _verify(args, console: Console) -> int:
    problems = verify(args.dir)
    for p in problems:
        _plain(console, p, "problem", "red")
    if not problems:
        _plain(
            console,
            f"{args.dir}: metadata, headers and every chunk's CRC-32 check out",
            "ok",
            "green",
        )
    return 1 if problems else 0


def _byte_count(text: str) -> int:
    """``"5GB"``, ``"500MiB"`` or ``"1000000"`` as a number of bytes (argparse type)."""
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits) :]
    try:
        n = int(float(digits) * _UNITS[unit])
    except (ValueError, KeyError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 5GB, 500MB, 200MiB or a byte count"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be at least one byte")
    return n


def _prefix_map(prefix: str | None):
    """Keep only keys under ``prefix`` and remove it (``model.`` for a ``{"model": sd}`` save)."""
    if not prefix:
        return None
    return lambda key: key[len(prefix) :] if key.startswith(prefix) else None


def _consolidate(args, console: Console) -> int:
    if args.max_shard_size is not None and not args.hf:
        raise CheckpointError("--max-shard-size applies to --hf output only")
    rows, _ = inspect(args.dir)
    key_map = _prefix_map(args.prefix)
    total = sum(1 for r in rows if key_map is None or key_map(r.key) is not None)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("consolidating", total=total)
        advance = lambda key: bar.advance(task)  # noqa: E731
        if args.hf:
            names = export_hf(args.dir, args.out, key_map=key_map,
                              max_shard_bytes=args.max_shard_size or DEFAULT_MAX_SHARD_BYTES,
                              progress=advance)  # fmt: skip
            what = f"{len(names)} file{'s' if len(names) > 1 else ''}"
        else:
            size = consolidate(args.dir, args.out, key_map=key_map, progress=advance)
            what = _size(size)
    _plain(console, f"wrote {args.out}: {total} tensors, {what}")
    if args.hf:
        _plain(console, "add the model's config.json (config.save_pretrained) to load it")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtensor.checkpoint", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "inspect", help="table of tensors, shapes, dtypes, chunks and sizes"
    ).add_argument("dir")
    sub.add_parser("verify", help="check metadata, headers and checksums").add_argument("dir")
    c = sub.add_parser(
        "consolidate", help="full tensors in one safetensors file, or a Hugging Face folder"
    )
    c.add_argument("dir")
    c.add_argument("out", help="a .safetensors file, or a folder with --hf")
    c.add_argument("--hf", action="store_true", help="write a Hugging Face model folder")
    c.add_argument(
        "--prefix", help="keep only keys starting with this and strip it (e.g. 'model.')"
    )
    c.add_argument("--max-shard-size", type=_byte_count, default=None,
                   help="with --hf: the most bytes per file (default 5GB)")  # fmt: skip
    args = parser.parse_args(argv)
    console = Console()
    try:
        return {"inspect": _inspect, "verify": _verify, "consolidate": _consolidate}[args.command](
            args, console
        )
    except (CheckpointError, OSError) as e:
        _plain(console, str(e), "error", "red")
        return 1


if __name__ == "__main__":
    sys.exit(main())
