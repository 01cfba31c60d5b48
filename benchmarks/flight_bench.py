"""What the flight recorder costs a training step: step time with it on vs off, interleaved.

    python benchmarks/flight_bench.py                # GPT (dim 256, 4 blocks), world size 2
    python benchmarks/flight_bench.py --dim 768 --layers 12 --rounds 4

One torchrun job (gloo, one torch thread per rank) trains with ``fully_shard`` on every
block; rounds alternate recorder off / on (``dtensor.debug.set_flight_recorder``; on, its
watchdog thread runs with the default timeout, polling the store every second), each round
``--steps`` timed steps after one untimed step, so drift and the other load on the machine
fall on both arms alike. Reported: the median step of each arm, their ratio, the ratio per
pair of rounds (its spread, min-max), the collectives recorded per step, the recorder's own
cost per collective measured alone (``note`` in a loop) times that count as a share of a
step - the figure noise cannot hide - and the watchdog thread's work per poll (publish and
compare, timed inline) against its poll interval. Results also go to ``bench_results/flight.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._arms import run_worker  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="flight recorder cost per training step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=6, help="rounds per arm (interleaved)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from device_mesh import init_device_mesh
    from dtensor import _flight, debug
    from examples.gpt import GPT, GPTConfig, gpt_loss
    from fsdp2 import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=4096, dim=args.dim, n_layers=args.layers, n_heads=4,
                    max_seq_len=args.seq)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (ws,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (args.batch // ws, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch // ws, args.seq), generator=g)

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        gpt_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    times = {"off": [], "on": []}
    for _ in range(args.rounds):
        for arm in ("off", "on"):
            debug.set_flight_recorder(arm == "on")
            step()  # untimed: the watchdog (re)starts here
            times[arm].append([step() for _ in range(args.steps)])
    debug.set_flight_recorder(True)
    before = sum(gr.seq for gr in _flight._groups.values())
    step()
    per_step = sum(gr.seq for gr in _flight._groups.values()) - before
    # the recorder's own cost per collective, alone (a group of this job, a typical scope)
    group = mesh.get_group()
    n = 20000
    with debug.collective_scope("fsdp layers.3"):
        t0 = time.perf_counter()
        for _ in range(n):
            _flight.note("all_gather", 0, ws, 1 << 20, group)
        note_s = (time.perf_counter() - t0) / n
    # the watchdog's work per poll (publish + compare with the next rank), done here inline
    w = _flight._watchdog
    polls = 50
    t0 = time.perf_counter()
    for _ in range(polls):
        w.published = -1
        w.step()
    poll_s = (time.perf_counter() - t0) / polls
    dist.barrier()
    debug.set_flight_recorder(False)
    if rank == 0:
        med = {a: statistics.median(s for r in v for s in r) for a, v in times.items()}
        pairs = [
            statistics.median(on) / statistics.median(off)
            for on, off in zip(times["on"], times["off"])
        ]
        result = {
            "world_size": ws,
            "step_off_s": med["off"],
            "step_on_s": med["on"],
            "ratio": med["on"] / med["off"],
            "pair_ratios": pairs,
            "collectives_per_step": per_step,
            "note_us": note_s * 1e6,
            "note_share": note_s * per_step / med["off"],
            "poll_ms": poll_s * 1e3,
            "poll_interval_s": w.poll,
        }
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    flags = ["--worker", "--dim", str(args.dim), "--layers", str(args.layers), "--seq",
             str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
             "--rounds", str(args.rounds)]  # fmt: skip
    r = run_worker(__file__, flags, nproc=args.nproc, what="flight recorder on/off")
    out = ROOT / "bench_results"
    out.mkdir(exist_ok=True)
    (out / "flight.json").write_text(json.dumps(r, indent=2))
    t = Table(title=f"flight recorder, GPT dim {args.dim} x {args.layers}, ws {r['world_size']}")
    for col in ("off", "on", "on/off", "pairs", "coll/step", "note", "notes/step",
                "poll"):  # fmt: skip
        t.add_column(col)
    t.add_row(
        f"{r['step_off_s'] * 1e3:.1f} ms",
        f"{r['step_on_s'] * 1e3:.1f} ms",
        f"{r['ratio']:.3f}",
        f"{min(r['pair_ratios']):.3f}-{max(r['pair_ratios']):.3f}",
        str(r["collectives_per_step"]),
        f"{r['note_us']:.2f} us",
        f"{r['note_share'] * 100:.3f} %",
        f"{r['poll_ms']:.2f} ms / {r['poll_interval_s']:g} s",
    )
    Console(width=150).print(t)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
