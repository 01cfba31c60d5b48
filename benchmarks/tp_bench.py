"""Tensor parallelism on the benchmark GPT: ours vs PyTorch's same recipe, in one run.

    python benchmarks/tp_bench.py            # TP at world size 2, FSDP+TP at 2x2
    python benchmarks/tp_bench.py --small    # a quick check

Arms: ``tp`` (world size 2, tensor parallel only: every rank runs the whole global batch)
and ``fsdp_tp`` (world size 4: dp=2 x tp=2), each with our ``parallelize_transformer`` and
with PyTorch's ``parallelize_module`` + ``fully_shard`` on the same plan
(``examples.gpt.tp_plan``). Each arm is its own ``torchrun`` job, one torch thread per rank;
step time is the median of the timed steps, peak RSS the maximum over ranks.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._arms import run_worker  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a small model, for a quick check")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(small: bool, seq: int):
    from examples.gpt import GPTConfig

    if small:
        return GPTConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=seq,
                         fused_qkv=False)  # fmt: skip
    return GPTConfig(vocab_size=8192, dim=768, n_layers=12, n_heads=12, max_seq_len=seq,
                     fused_qkv=False)  # fmt: skip


def _build(impl: str, layout: str, cfg):
    import torch

    from examples.gpt import GPT, tp_plan

    shape, names = ((2,), ("tp",)) if layout == "tp" else ((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    if impl == "ours":
        from device_mesh import init_device_mesh
        from fsdp2 import parallelize_transformer

        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        parallelize_transformer(model, mesh, tp_plan=tp_plan())
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        parallelize_module(model, mesh["tp"], tp_plan(use_torch=True))
        if "dp" in names:
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    return model, mesh


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from examples.gpt import gpt_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = _config(args.small, args.seq)
    model, mesh = _build(args.worker, args.layout, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    n_dp = 1 if args.layout == "tp" else 2
    dp_index = 0 if args.layout == "tp" else dist.get_rank() // 2
    g = torch.Generator().manual_seed(dp_index)
    rows = args.global_batch // n_dp
    x = torch.randint(0, cfg.vocab_size, (rows, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (rows, args.seq), generator=g)
    times = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = gpt_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({
            "impl": args.worker, "layout": args.layout, "world_size": dist.get_world_size(),
            "params": cfg.num_params(), "step_s": statistics.median(times[args.warmup:]),
            "steps_s": times[args.warmup:], "peak_rss_mb": max(rss), "loss": loss.item(),
        }))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def run_arm(impl: str, layout: str, args) -> dict:
    flags = [
        "--worker", impl, "--layout", layout, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--global-batch", str(args.global_batch),
        "--seq", str(args.seq),
    ] + (["--small"] if args.small else [])  # fmt: skip
    return run_worker(__file__, flags, nproc=2 if layout == "tp" else 4, what=f"tp {impl} {layout}")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    plan = [("ours", "tp"), ("torch", "tp"), ("ours", "fsdp_tp"), ("torch", "fsdp_tp")]
    results = []
    console = Console()
    with Progress(console=console) as progress:
        task = progress.add_task("tp arms", total=len(plan))
        for impl, layout in plan:
            progress.update(task, description=f"{impl} {layout}")
            results.append(run_arm(impl, layout, args))
            progress.advance(task)
    table = Table(title=f"tensor parallelism, GPT {results[0]['params'] / 1e6:.1f}M, global "
                  f"batch {args.global_batch}x{args.seq}, median of {args.steps} steps")  # fmt: skip
    for col in (
        "layout",
        "ws",
        "impl",
        "step (s)",
        "vs torch",
        "peak RSS (MB)",
        "RSS vs torch",
        "loss",
    ):
        table.add_column(col, justify="right")
    for r in results:
        torch_r = next(t for t in results if t["impl"] == "torch" and t["layout"] == r["layout"])
        table.add_row(
            r["layout"], str(r["world_size"]), r["impl"], f"{r['step_s']:.3f}",
            f"{r['step_s'] / torch_r['step_s']:.2f}x", f"{r['peak_rss_mb']:.0f}",
            f"{r['peak_rss_mb'] / torch_r['peak_rss_mb']:.2f}x", f"{r['loss']:.4f}",
        )  # fmt: skip
    console.print(table)
    out = ROOT / "bench_results" / "tp.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
