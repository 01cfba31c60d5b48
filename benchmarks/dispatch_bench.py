"""Eager dispatch overhead: our DTensor against torch.distributed.tensor, per op, in one run.

    python benchmarks/dispatch_bench.py                # default: 151 rounds of 20 calls per op
    python benchmarks/dispatch_bench.py --rounds 31    # a quicker look

One process, a 1-rank gloo world, a 1-rank mesh of each library, and 8x8 fp32 tensors, so
the local op costs next to nothing and what is timed is the work around it: argument
handling, the sharding cache, wrapping the outputs. For every op the two libraries run
alternately (who goes first alternates too), each round timing a short block of calls (short,
so that a block another process preempted is an outlier the median ignores); the table gives
the median microseconds per call over the rounds, the ratio ours / torch's, and the
spread of the per-round ratios (25th-75th percentile). The geometric mean is over the ops.

The second table is a cache miss: both libraries' sharding caches are cleared before every
single timed call (ours: ``dtensor._dispatch.clear_cache()``; torch's: its C++ dispatch cache
and its Python propagation caches).

Results: rich tables and ``bench_results/dispatch.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# label -> fn(x, w, b, g): x is (8, 8) Shard(0); w (8, 8), b and g (8,) are replicated
OPS = {
    "x + x": lambda x, w, b, g: x + x,
    "x * 2.0": lambda x, w, b, g: x * 2.0,
    "x @ w": lambda x, w, b, g: x @ w,
    "F.linear(x, w, b)": lambda x, w, b, g: F.linear(x, w, b),
    "F.layer_norm(x, (8,), g, b)": lambda x, w, b, g: F.layer_norm(x, (8,), g, b),
    "x.sum()": lambda x, w, b, g: x.sum(),
    "x.view(-1)": lambda x, w, b, g: x.view(-1),
    "x.detach()": lambda x, w, b, g: x.detach(),
}


def _inputs(lib, mesh, device: str = "cpu"):
    torch.manual_seed(0)
    x = lib.distribute_tensor(torch.randn(8, 8, device=device), mesh, [lib.Shard(0)])
    w = lib.distribute_tensor(torch.randn(8, 8, device=device), mesh, [lib.Replicate()])
    b = lib.distribute_tensor(torch.randn(8, device=device), mesh, [lib.Replicate()])
    g = lib.distribute_tensor(torch.randn(8, device=device), mesh, [lib.Replicate()])
    return x, w, b, g


def _clear_torch_caches() -> None:
    import torch.distributed.tensor as tdt

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's cache
    prop = tdt.DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()


def _block_us(fn, args, n: int) -> float:
    """Microseconds per call of ``fn(*args)``, over a block of ``n`` calls (host time: on a
    GPU the kernels queue behind, and what is timed is the dispatch that launches them)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t0) / n * 1e6


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(rounds: int, calls: int, miss_calls: int, device: str = "cpu") -> dict:
    """Both tables' numbers, as a dict ready for JSON. ``device``: where the tensors live
    (``"cuda"`` needs a one-rank NCCL default group; the GPU check runs it so)."""
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import dtensor as ours
    from device_mesh import init_device_mesh
    from dtensor import _dispatch

    inputs = {
        "ours": _inputs(ours, init_device_mesh(device, (1,)), device),
        "torch": _inputs(tdt, torch_mesh(device, (1,)), device),
    }
    clear = {"ours": _dispatch.clear_cache, "torch": _clear_torch_caches}
    hit, miss = {}, {}
    gc.disable()
    try:
        for label, fn in OPS.items():
            for lib in ("ours", "torch"):  # warm-up: caches filled, first-call costs paid
                _block_us(fn, inputs[lib], 50)
            times = {"ours": [], "torch": []}
            for r in range(rounds):
                order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
                for lib in order:
                    times[lib].append(_block_us(fn, inputs[lib], calls))
            hit[label] = times
            gc.collect()
            times = {"ours": [], "torch": []}
            for r in range(miss_calls):
                order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
                for lib in order:
                    clear[lib]()
                    times[lib].append(_block_us(fn, inputs[lib], 1))
            miss[label] = times
            gc.collect()
    finally:
        gc.enable()
    return {"hit": _summarize(hit), "miss": _summarize(miss)}


def _summarize(raw: dict) -> dict:
    rows = {}
    for label, t in raw.items():
        ratios = [a / b for a, b in zip(t["ours"], t["torch"], strict=True)]
        ours_us, torch_us = statistics.median(t["ours"]), statistics.median(t["torch"])
        rows[label] = {
            "ours_us": ours_us,
            "torch_us": torch_us,
            "ratio": ours_us / torch_us,
            "ratio_p25": _quantile(ratios, 0.25),
            "ratio_p75": _quantile(ratios, 0.75),
        }
    geomean = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows.values()))
    return {"ops": rows, "geomean": geomean, "max_ratio": max(r["ratio"] for r in rows.values())}


def _table(title: str, summary: dict):
    from rich.table import Table

    table = Table(title=title)
    for col in ("op", "ours (us)", "torch (us)", "ours / torch", "per-round p25-p75"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for label, r in summary["ops"].items():
        table.add_row(
            label,
            f"{r['ours_us']:.1f}",
            f"{r['torch_us']:.1f}",
            f"{r['ratio']:.2f}x",
            f"{r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}",
        )
    table.add_row("geomean", "", "", f"{summary['geomean']:.2f}x", "", style="bold")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=151, help="timed blocks per op and library")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed block")
    parser.add_argument("--miss-calls", type=int, default=101, help="timed cache-miss calls")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = measure(args.rounds, args.calls, args.miss_calls)
    finally:
        dist.destroy_process_group()
    results["args"] = vars(args)
    results["torch"] = torch.__version__

    from rich.console import Console

    console = Console()
    console.print(
        _table(
            f"dispatch on a sharding-cache hit: 8x8 fp32, 1-rank mesh, median of "
            f"{args.rounds} blocks of {args.calls} calls",
            results["hit"],
        )
    )
    console.print(
        _table(
            f"dispatch on a sharding-cache miss (both caches cleared before each call), "
            f"median of {args.miss_calls} calls",
            results["miss"],
        )
    )
    out = ROOT / "bench_results" / "dispatch.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
