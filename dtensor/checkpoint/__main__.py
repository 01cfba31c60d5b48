"""Command line: ``python -m dtensor.checkpoint {inspect,verify,consolidate} DIR ...``.

python -m dtensor.checkpoint inspect ckpt/step-100
python -m dtensor.checkpoint verify ckpt/step-100          # exit status 1 on any problem
python -m dtensor.checkpoint consolidate ckpt/step-100 full.safetensors
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.tools import consolidate, inspect, verify


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _inspect(args, console: Console) -> int:
    rows, md = inspect(args.dir)
    table = Table(title=f"{args.dir}: {len(rows)} tensors, {len(md.files)} files")
    for col in ("key", "shape", "dtype", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for r in rows:
        table.add_row(r.key, str(list(r.shape)), r.dtype, str(r.chunks), _size(r.nbytes))
    total = sum(r.nbytes for r in rows)
    table.add_section()
    table.add_row("total", "", "", str(sum(r.chunks for r in rows)), _size(total))
    console.print(table)
    if md.values:
        console.print(f"values: {', '.join(sorted(md.values))}")
    return 0


def _verify(args, console: Console) -> int:
    problems = verify(args.dir)
    for p in problems:
        console.print(f"[red]problem[/red] {p}")
    if not problems:
        console.print(
            f"[green]ok[/green] {args.dir}: metadata, headers and every chunk's CRC-32 check out"
        )
    return 1 if problems else 0


def _consolidate(args, console: Console) -> int:
    rows, _ = inspect(args.dir)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("consolidating", total=len(rows))
        size = consolidate(args.dir, args.out, progress=lambda key: bar.advance(task))
    console.print(f"wrote {args.out}: {len(rows)} tensors, {_size(size)}")
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
    c = sub.add_parser("consolidate", help="full tensors in one safetensors file")
    c.add_argument("dir")
    c.add_argument("out")
    args = parser.parse_args(argv)
    console = Console()
    try:
        return {"inspect": _inspect, "verify": _verify, "consolidate": _consolidate}[args.command](
            args, console
        )
    except CheckpointError as e:
        console.print(f"[red]error[/red] {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
