"""Benchmarks: our DTensor redistribution against torch.distributed.tensor, in one run.

Spawns a gloo world of CPU processes for each size in ``--world`` (2 and 4 ranks by
default); every case runs both implementations on the same tensors, alternating, and reports
medians and the ratio ours / torch's. Results go to one rich table per world size and to
``bench_results/redistribute.json`` (``{world: {case: {"ours": ms, "torch": ms}}}``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# this checkout's packages, not the ones the shared venv was installed from (the workers
# inherit the path)
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = [
    ("Shard(0) -> Replicate", "S0", "R"),
    ("Partial -> Replicate", "P", "R"),
    ("Partial -> Shard(0)", "P", "S0"),
    ("Shard(0) -> Shard(1)", "S0", "S1"),
]


def _placement(lib, code):
    return {"S0": lib.Shard(0), "S1": lib.Shard(1), "R": lib.Replicate(), "P": lib.Partial()}[code]


def _worker(rank, world, port, rows, cols, iters, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import dtensor as ours
    from device_mesh import init_device_mesh

    mesh, tmesh = init_device_mesh("cpu", (world,)), torch_mesh("cpu", (world,))
    full = torch.randn(rows, cols)
    results = {}
    for label, src, dst in CASES:
        if src == "P":
            a = ours.DTensor.from_local(full, mesh, [ours.Partial()])
            b = tdt.DTensor.from_local(full, tmesh, [tdt.Partial()])
        else:
            a = ours.distribute_tensor(full, mesh, [_placement(ours, src)])
            b = tdt.distribute_tensor(full, tmesh, [_placement(tdt, src)])
        times = {"ours": [], "torch": []}
        for _ in range(iters):
            for name, x, lib, m in (("ours", a, ours, mesh), ("torch", b, tdt, tmesh)):
                dist.barrier()
                t0 = time.perf_counter()
                y = x.redistribute(m, [_placement(lib, dst)])
                y.to_local()
                times[name].append(time.perf_counter() - t0)
        results[label] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def _run_world(world: int, rows: int, cols: int, iters: int, out_path: pathlib.Path) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, rows, cols, iters, str(out_path)), nprocs=world, join=True)
    return json.loads(out_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--world", type=int, nargs="+", default=[2, 4], help="gloo world sizes, run in turn"
    )
    parser.add_argument("--rows", type=int, default=2049)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    out_dir = pathlib.Path("bench_results")
    out_dir.mkdir(exist_ok=True)
    out_path = out_dir / "redistribute.json"
    one_world = out_dir / "redistribute_world.json"
    results = {w: _run_world(w, args.rows, args.cols, args.iters, one_world) for w in args.world}
    one_world.unlink()
    out_path.write_text(json.dumps({str(w): r for w, r in results.items()}, indent=2))

    from rich.console import Console
    from rich.table import Table

    for world, cases in results.items():
        table = Table(
            title=f"redistribute of a ({args.rows}, {args.cols}) fp32 tensor, "
            f"{world} gloo ranks, median of {args.iters}"
        )
        for col in ("case", "ours (ms)", "torch (ms)", "ours / torch"):
            table.add_column(col, justify="right" if col != "case" else "left")
        for label, r in cases.items():
            table.add_row(
                label, f"{r['ours']:.2f}", f"{r['torch']:.2f}", f"{r['ours'] / r['torch']:.2f}x"
            )
        Console().print(table)
    Console().print(f"written to {out_path}")


if __name__ == "__main__":
    main()
