"""What ``set_deterministic_reduction`` costs: step time, bytes on the wire and gradient
bytes held, against the default, interleaved in one run.

    python benchmarks/determinism_bench.py                 # ws 2, 1 and 4 micro-batches a rank
    python benchmarks/determinism_bench.py --rounds 5 --nproc 4

One ``torchrun`` world per micro-batch count. In it, one GPT under ``fully_shard`` trains
rounds of two steps: one in the default mode and one in the deterministic mode, the order
alternating every round (the switch is flipped between steps, so both arms share the model,
the process and the load on the machine). A step is ``micro`` micro-batches per rank, all but
the last without gradient sync, then AdamW. Per mode: the median step time, the bytes each
rank contributes to collectives per step (``dtensor.debug``) and the most gradient bytes a
rank held while accumulating (unsharded gradients and, in the mode, the summation tree's
leaves). The ratio is deterministic / default per round; its spread is the 25th-75th
percentile over rounds. Results: a rich table and ``bench_results/determinism.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._arms import run_worker  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="cost of fsdp2's deterministic reduction")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro", type=int, nargs="+", default=[1, 4], help="micro-batches a rank")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _grad_bytes(model) -> int:
    """Gradient bytes waiting for a reduction on this rank (unsharded, and tree leaves)."""
    from fsdp2._param import internal

    total = 0
    for m in model.modules():
        state = m.__dict__.get("_fsdp_state")
        if state is None or state.group is None:
            continue
        for p in state.group.params:
            with internal():
                g = p.unsharded_param.grad if p.unsharded_param is not None else None
            tensors = [g, p.accumulated_grad, *(t for _, t in p.grad_leaves)]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from dtensor.debug import CommDebugMode
    from examples.gpt import GPT, GPTConfig, gpt_loss
    from fsdp2 import fully_shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    # ~5M parameters; dim 0 of the embeddings (4001, 129 rows) divides by no world size
    cfg = GPTConfig(vocab_size=4001, dim=256, n_layers=4, n_heads=4, max_seq_len=args.seq + 1)
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, cfg.vocab_size, (args.rows, args.seq + 1), generator=g)
            for _ in range(args.micro)]  # fmt: skip

    def step(deterministic: bool) -> tuple[float, int, int]:
        model.set_deterministic_reduction(deterministic)
        dist.barrier()
        held = 0
        t0 = time.perf_counter()
        with CommDebugMode() as comm:
            for i, batch in enumerate(data):
                model.set_requires_gradient_sync(i == args.micro - 1)
                (gpt_loss(model, batch[:, :-1], batch[:, 1:]) / args.micro).backward()
                if i < args.micro - 1:
                    held = max(held, _grad_bytes(model))
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - t0, comm.get_total_bytes(), held

    for _ in range(args.warmup):
        step(False)
        step(True)
    times = {False: [], True: []}
    info = {}
    for r in range(args.rounds):
        for mode in (False, True) if r % 2 == 0 else (True, False):
            seconds, nbytes, held = step(mode)
            times[mode].append(seconds)
            info[mode] = (nbytes, held)
    if rank == 0:
        ratios = [d / s for s, d in zip(times[False], times[True], strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        result = {
            "micro": args.micro,
            "default_s": statistics.median(times[False]),
            "deterministic_s": statistics.median(times[True]),
            "ratio": statistics.median(ratios),
            "ratio_p25": q[0],
            "ratio_p75": q[2],
            "default_bytes": info[False][0],
            "deterministic_bytes": info[True][0],
            "default_held": info[False][1],
            "deterministic_held": info[True][1],
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.worker:
        args.micro = args.micro[0]
        worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    results = []
    for micro in args.micro:
        flags = ["--worker", "--micro", str(micro), "--rounds", str(args.rounds),
                 "--warmup", str(args.warmup), "--rows", str(args.rows), "--seq", str(args.seq)]  # fmt: skip
        results.append(
            run_worker(__file__, flags, nproc=args.nproc, what=f"ws{args.nproc} micro {micro}")
        )
    table = Table(
        title=f"set_deterministic_reduction vs default, world size {args.nproc} (CPU, gloo)"
    )
    for col in ("micro-batches / rank", "default s", "deterministic s", "ratio (p25-p75)",
                "bytes / step (default, det.)", "grad bytes held (default, det.)"):  # fmt: skip
        table.add_column(col)
    mib = 1 << 20
    for r in results:
        table.add_row(
            str(r["micro"]),
            f"{r['default_s']:.3f}",
            f"{r['deterministic_s']:.3f}",
            f"{r['ratio']:.3f} ({r['ratio_p25']:.3f}-{r['ratio_p75']:.3f})",
            f"{r['default_bytes'] / mib:.1f} MiB, {r['deterministic_bytes'] / mib:.1f} MiB",
            f"{r['default_held'] / mib:.1f} MiB, {r['deterministic_held'] / mib:.1f} MiB",
        )
    Console().print(table)
    out = ROOT / "bench_results" / "determinism.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"nproc": args.nproc, "results": results}, indent=1))


if __name__ == "__main__":
    main()
