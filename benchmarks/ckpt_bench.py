"""Checkpoint save and load throughput: ours vs torch.distributed.checkpoint, in one run.

    python benchmarks/ckpt_bench.py            # the benchmark GPT (~98M) + AdamW, world size 2
    python benchmarks/ckpt_bench.py --small    # a quick check

Each arm is a ``torchrun`` job of 2 ranks (one torch thread each) that builds the GPT with
fully_shard (ours, or PyTorch's FSDP2 for the torch arm), creates the AdamW state, then saves
the model + optimizer state dict ``--repeats`` times and loads it back as many times, each
into a fresh directory under ``--dir`` (default: a temporary directory). Throughput is the
bytes of state over all ranks divided by the median wall time (barrier to barrier).

The disk's own write bandwidth is measured in the same job, just before each save, the way a
save uses it: every rank at once writes its share of the checkpoint's bytes (random bytes,
prepared beforehand) to one file in the same directory and fsyncs it, barrier to barrier.
That is the least a save must do to make those bytes durable, with no header, checksum or
metadata. It is measured two ways: plainly (64 MiB ``write`` calls, then one ``fsync``: what
``dd bs=64M conv=fsync`` does) and streamed (the same, asking the kernel to start writing
back each 64 MiB as soon as it is written, ``sync_file_range``, so the disk need not wait for
the ``fsync``). The ceiling is the faster of the two medians; each save is reported as a
fraction of the ceiling measured in its own job.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._arms import run_worker  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a small model, for a quick check")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: tmp)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _model(small: bool):
    import torch

    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=64) if small \
        else GPTConfig(vocab_size=8192, dim=768, n_layers=12, n_heads=12, max_seq_len=128)  # fmt: skip
    torch.manual_seed(0)
    return GPT(cfg)


def _ours(model, opt):
    from dtensor import checkpoint as dcp
    from fsdp2 import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = opt(model.parameters())

    def state():
        return {
            "model": dcp.get_model_state_dict(model),
            "optim": dcp.get_optimizer_state_dict(model, opt),
        }

    return (
        state,
        lambda sd, d: dcp.save(sd, checkpoint_id=d),
        lambda sd, d: dcp.load(sd, checkpoint_id=d),
    )


def _torch(model, opt):
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = opt(model.parameters())

    def state():
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    return (
        state,
        lambda sd, d: tdcp.save(sd, checkpoint_id=d),
        lambda sd, d: tdcp.load(sd, checkpoint_id=d),
    )


def _local_bytes(sd) -> int:
    import torch

    total = 0
    stack = [sd]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, torch.Tensor):
            local = node.to_local() if hasattr(node, "to_local") else node
            total += local.numel() * local.element_size()
    return total


_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def _disk_write(path: Path, data: memoryview, streamed: bool) -> None:
    """Write ``data`` to ``path`` in 64 MiB calls and fsync once (see the module docstring)."""
    step, kick = 64 << 20, _sync_file_range() if streamed else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            n = os.write(fd, data[done : done + step])
            if kick is not None:
                kick(fd, done, n, _SYNC_FILE_RANGE_WRITE)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args.small)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    state, save, load = (_ours if args.worker == "ours" else _torch)(model, opt)
    sd = state()  # creates the optimizer state (zero moments) in both arms
    nbytes = torch.tensor([_local_bytes(sd)])
    dist.all_reduce(nbytes)
    share = torch.empty(int(nbytes.item()) // world, dtype=torch.uint8).random_()
    share = memoryview(share.numpy())
    base = Path(args.dir)
    saves, loads, disk = [], [], {"plain": [], "streamed": []}
    for i in range(args.repeats):
        for mode, times in disk.items():
            scratch = base / f"{args.worker}-disk-{rank}"
            dist.barrier()
            t0 = time.perf_counter()
            _disk_write(scratch, share, streamed=mode == "streamed")
            dist.barrier()
            times.append(time.perf_counter() - t0)
            scratch.unlink()
        where = base / f"{args.worker}-{i}"
        dist.barrier()
        t0 = time.perf_counter()
        save(sd, where)
        dist.barrier()
        saves.append(time.perf_counter() - t0)
    for i in range(args.repeats):
        target = state()
        dist.barrier()
        t0 = time.perf_counter()
        load(target, base / f"{args.worker}-{i}")
        dist.barrier()
        loads.append(time.perf_counter() - t0)
    if rank == 0:
        for i in range(args.repeats):
            shutil.rmtree(base / f"{args.worker}-{i}", ignore_errors=True)
        Path(args.out).write_text(json.dumps({
            "impl": args.worker, "bytes": int(nbytes.item()), "save_s": statistics.median(saves),
            "load_s": statistics.median(loads), "saves": saves, "loads": loads,
            "disk_plain_s": statistics.median(disk["plain"]), "disk_plain": disk["plain"],
            "disk_streamed_s": statistics.median(disk["streamed"]),
            "disk_streamed": disk["streamed"], "disk_bytes": len(share) * world,
        }))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _disk_mbs(r: dict) -> float:
    """The ceiling measured in arm ``r``'s job: the faster way of writing, in MB/s."""
    return r["disk_bytes"] / 1e6 / min(r["disk_plain_s"], r["disk_streamed_s"])


def run_arm(impl: str, args, directory: Path) -> dict:
    flags = ["--worker", impl, "--repeats", str(args.repeats), "--dir", str(directory)]
    flags += ["--small"] if args.small else []
    return run_worker(__file__, flags, nproc=2, what=f"checkpoint {impl}")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("checkpoint arms", total=2)
        for impl in ("ours", "torch"):
            progress.update(task, description=impl)
            results.append(run_arm(impl, args, directory))
            progress.advance(task)
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    torch_r = results[1]
    table = Table(title=f"checkpoint, GPT + AdamW state ({results[0]['bytes'] / 2**20:.0f} MiB over "
                  f"2 ranks), median of {args.repeats}")  # fmt: skip
    cols = ("impl", "disk MB/s", "save (s)", "save MB/s", "of disk", "vs torch", "load (s)",
            "load MB/s", "vs torch")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in results:
        save_mbs = r["bytes"] / 1e6 / r["save_s"]
        table.add_row(
            r["impl"], f"{_disk_mbs(r):.0f}", f"{r['save_s']:.3f}", f"{save_mbs:.0f}",
            f"{save_mbs / _disk_mbs(r):.0%}", f"{torch_r['save_s'] / r['save_s']:.2f}x",
            f"{r['load_s']:.3f}", f"{r['bytes'] / 1e6 / r['load_s']:.0f}",
            f"{torch_r['load_s'] / r['load_s']:.2f}x",
        )  # fmt: skip
    console.print(table)
    for r in results:
        console.print(
            f"disk in the {r['impl']} job: write + fsync {r['disk_bytes'] / 1e6 / r['disk_plain_s']:.0f}"
            f" MB/s, streamed {r['disk_bytes'] / 1e6 / r['disk_streamed_s']:.0f} MB/s (2 ranks at once)"
        )  # fmt: skip
    console.print(
        "disk MB/s: the faster of the two, measured in the arm's own job just before each save; "
        "of disk: save MB/s / disk MB/s; vs torch: throughput relative to "
        "torch.distributed.checkpoint (above 1 is faster)"
    )
    out = ROOT / "bench_results" / "checkpoint.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
