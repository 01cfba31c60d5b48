"""Our DTensor and PyTorch's side by side on PyTorch's OpInfo database.

    python benchmarks/op_coverage.py --world-size 2 --lib both --out bench_results/op_coverage.json

Spawns ``--world-size`` gloo ranks per library, runs ``tests/_op_coverage.py`` on every op
and layout, and prints per layout how many ops pass on each, and the ops PyTorch's DTensor
passes that ours does not. ``--only a,b`` limits the ops.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, ws, port, lib_name, only, layouts, log_path, samples):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=timedelta(seconds=20),
    )
    from tests import _op_coverage as oc

    lib = oc.ours() if lib_name == "ours" else oc.pytorch()

    def on_op(name, results):
        if rank == 0:
            with open(log_path, "a") as f:
                rec = {"op": name}
                if results is not None:
                    rec["results"] = {"|".join(k): v for k, v in results.items()}
                f.write(json.dumps(rec) + "\n")

    oc.run_ops(lib, layouts, only=only, on_op=on_op, samples_per_op=samples)
    dist.barrier()
    dist.destroy_process_group()


def run(lib_name: str, ws: int, only, layouts, out_path: str, samples: int = 2) -> dict:
    """Every op's outcomes; an op that hangs or kills a rank is recorded as an error and the
    run goes on from the next op in fresh processes."""
    from tests import _op_coverage as oc

    names = [oc.op_name(o) for o in oc.all_ops()]
    remaining = [n for n in names if only is None or n in only]
    log_path = out_path + ".log"
    results: dict = {}
    t = time.time()
    while remaining:
        open(log_path, "w").close()
        try:
            mp.spawn(
                _worker,
                args=(ws, _port(), lib_name, set(remaining), layouts, log_path, samples),
                nprocs=ws,
                join=True,
            )
            failed = None
        except Exception as e:  # a rank raised, hung past the timeout, or aborted
            failed = f"{type(e).__name__}"
        started, done = None, set()
        with open(log_path) as f:
            for line in f:
                rec = json.loads(line)
                if "results" in rec:
                    done.add(rec["op"])
                    results.update(
                        {tuple(k.split("|")): tuple(v) for k, v in rec["results"].items()}
                    )
                else:
                    started = rec["op"]
        if failed is not None and started is not None and started not in done:
            print(f"{lib_name}: {started} hung or killed a rank ({failed})", file=sys.stderr)
            for layout in layouts:
                for d in ("fwd", "bwd"):
                    results[(started, layout, d)] = ("error", "hang or abort")
            done.add(started)
        elif failed is not None:
            raise RuntimeError(f"{lib_name} run failed outside an op")
        remaining = [n for n in remaining if n not in done]
    print(f"{lib_name}: {time.time() - t:.1f} s", file=sys.stderr)
    with open(out_path, "w") as f:
        json.dump({"|".join(k): v for k, v in results.items()}, f, indent=0, sort_keys=True)
    return results


def _counts(res: dict, layout: str, direction: str) -> int:
    return sum(
        1 for (n, lay, d), (o, _) in res.items() if lay == layout and d == direction and o == "pass"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--lib", choices=["ours", "pytorch", "both"], default="both")
    ap.add_argument("--only", default=None)
    ap.add_argument("--layouts", default="replicate,shard0,shardlast,shard2d")
    ap.add_argument("--out", default="bench_results/op_coverage")
    ap.add_argument("--samples", type=int, default=2, help="samples per op (the test uses 1)")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    layouts = tuple(args.layouts.split(","))
    libs = ["ours", "pytorch"] if args.lib == "both" else [args.lib]
    results = {}
    for lib in libs:
        results[lib] = run(
            lib,
            args.world_size,
            only,
            layouts,
            f"{args.out}_{lib}_ws{args.world_size}.json",
            args.samples,
        )
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ops passing, world size {args.world_size}")
    table.add_column("layout")
    for lib in libs:
        table.add_column(f"{lib} fwd", justify="right")
        table.add_column(f"{lib} bwd", justify="right")
    for layout in layouts:
        row = [layout]
        for lib in libs:
            row += [
                str(_counts(results[lib], layout, "fwd")),
                str(_counts(results[lib], layout, "bwd")),
            ]
        table.add_row(*row)
    Console().print(table)
    if len(libs) == 2:
        ours_r, theirs = results["ours"], results["pytorch"]
        missing = sorted(
            k for k, (o, _) in theirs.items() if o == "pass" and ours_r.get(k, ("",))[0] != "pass"
        )
        print(f"{len(missing)} (op, layout, direction) PyTorch passes and ours does not:")
        for k in missing:
            print("  ", "|".join(k), "->", ours_r.get(k))
    for lib in libs:
        wrong = sorted(k for k, (o, _) in results[lib].items() if o == "wrong")
        print(f"{lib}: {len(wrong)} wrong")
    return 0


if __name__ == "__main__":
    sys.exit(main())
