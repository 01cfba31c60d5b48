"""Step time and memory of one GPT workload under our fully_shard, torch's FSDP2, DDP, and one
process, in one run.

    python benchmarks/train_bench.py                 # the full table (about 100M parameters)
    python benchmarks/train_bench.py --small         # a quick smoke run
    python benchmarks/train_bench.py --device cuda --size 1b --bf16   # the GPU arm (one GPU)

Each arm runs in its own ``torchrun`` job (so peak RSS is that arm's alone) with the same
global batch, one torch thread per rank, the same number of warm-up and timed steps. Step
time is the median over the timed steps of forward + backward + AdamW step. Memory, on rank 0:
peak RSS (what the OS gives the process, allocator fragmentation included); the peak of live
tensor bytes over one more step, measured by PyTorch's own ``MemTracker`` for every arm (it
does not see buffers gloo allocates inside its C++ collectives); and the bytes of parameter,
gradient and optimizer-state tensors at rest.
Results go to a rich table and to ``bench_results/train.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._arms import run_worker  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="fully_shard training benchmark")
    p.add_argument("--small", action="store_true", help="a small model, for a quick check")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip-ws4", action="store_true", help="skip the world-size-4 memory rows")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: ours vs torch FSDP2 vs the plain model on one GPU (NCCL)",
    )
    p.add_argument("--size", choices=("100m", "1b"), default="100m", help="GPT size")
    p.add_argument("--bf16", action="store_true", help="bf16 params, fp32 reduce (both FSDPs)")
    p.add_argument("--offload", action="store_true", help="also run ours with CPUOffloadPolicy")
    p.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # compile_bench
    return p.parse_args(argv)


def model_config(small: bool, seq: int, size: str = "100m", layers: int | None = None):
    from examples.gpt import GPTConfig

    if size == "1b":  # ~1.0B parameters
        return GPTConfig(vocab_size=32000, dim=2048, n_layers=layers or 18, n_heads=16,
                         max_seq_len=seq)  # fmt: skip
    if small:
        return GPTConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=seq)
    return GPTConfig(vocab_size=8192, dim=768, n_layers=12, n_heads=12, max_seq_len=seq)


# ------------------------------------------------------------------------------ one arm
def build(arm: str, cfg, device: str = "cpu", bf16: bool = False, compile: bool = False):
    """The arm's model; ``compile``: each block through ``torch.compile`` (inductor) before
    ``fully_shard``, the per-block recipe both FSDPs document."""
    import torch

    from examples.gpt import GPT

    torch.manual_seed(0)
    if arm in ("ours", "torch_fsdp", "ours_offload"):
        if arm == "torch_fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            extra = {}
        else:
            from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            extra = {"offload_policy": CPUOffloadPolicy()} if arm == "ours_offload" else {}
        if bf16:
            extra["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        with torch.device("meta"):
            model = GPT(cfg)
        for block in model.blocks:
            if compile:
                block.compile()
            fully_shard(block, **extra)
        fully_shard(model, **extra)
        model.to_empty(device="cpu" if arm == "ours_offload" else device)
        torch.manual_seed(0)
        model.reset_parameters()
        return model
    model = GPT(cfg).to(device)
    if arm == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def peak_flops(device: str) -> float | None:
    """Dense bf16 peak of the GPU, for MFU (None when unknown): the GPU check's table."""
    if device != "cuda":
        return None
    from benchmarks._gpu_speed import peak_flops as gpu_peak_flops

    return gpu_peak_flops()[0]


def local_bytes(model, opt) -> int:
    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0)
        total += sum(nbytes(v) for v in opt.state.get(p, {}).values() if v.ndim)
    return total


def tracked_peak_bytes(model, opt, loss_fn, device) -> int:
    """Peak live tensor bytes over one training step, by PyTorch's MemTracker (an oracle
    that measures every arm the same way)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        loss_fn().backward()
        opt.step()
        opt.zero_grad()
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from examples.gpt import gpt_loss

    arm = args.worker
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    if arm != "single":
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if arm != "single" else 0
    ws = dist.get_world_size() if arm != "single" else 1
    cfg = model_config(args.small, args.seq, args.size, args.layers)
    device = "cuda" if cuda else "cpu"
    model = build(arm, cfg, device, args.bf16, args.compile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    per_rank = args.global_batch // ws
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (per_rank, args.seq), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (per_rank, args.seq), generator=g).to(device)
    autocast = torch.autocast(
        "cuda", torch.bfloat16, enabled=cuda and args.bf16 and arm == "single"
    )

    def mark() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    times, phases = [], {"forward": [], "backward": [], "optimizer": []}
    for _ in range(args.warmup + args.steps):
        if arm != "single":
            dist.barrier()
        t0 = mark()
        with autocast:
            loss = gpt_loss(model, x, y)
        t1 = mark()
        loss.backward()
        t2 = mark()
        opt.step()
        opt.zero_grad()
        t3 = mark()
        times.append(t3 - t0)
        for name, span in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[name].append(span)
    gpu_peak = torch.cuda.max_memory_allocated() if cuda else 0
    # Training's peak RSS, read before the instrumented step below (MemTracker's own hooks
    # and bookkeeping are not part of training).
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tracked = (
        0 if args.compile else tracked_peak_bytes(model, opt, lambda: gpt_loss(model, x, y), dev)
    )
    step_s = statistics.median(times[args.warmup :])
    flops = peak_flops(args.device)
    result = {
        "arm": arm,
        "world_size": ws,
        "params": cfg.num_params(),
        "step_s": step_s,
        "gpu_peak_mb": gpu_peak / 2**20,
        "mfu": 6 * cfg.num_params() * args.global_batch * args.seq / step_s / flops / ws
        if flops
        else None,
        "steps_s": times[args.warmup :],
        "phases_s": {k: statistics.median(v[args.warmup :]) for k, v in phases.items()},
        "peak_rss_mb": peak_rss,
        "state_mb": local_bytes(model, opt) / 2**20,
        "tracked_peak_mb": tracked / 2**20,
        "loss": loss.item(),
    }
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    if arm != "single":
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ driver
def run_arm(arm: str, ws: int, args, progress=None) -> dict:
    flags = [
        "--worker", arm, "--steps", str(args.steps), "--warmup",
        str(args.warmup), "--global-batch", str(args.global_batch), "--seq", str(args.seq),
        "--device", args.device, "--size", args.size,
    ] + (["--small"] if args.small else []) + (["--bf16"] if args.bf16 else []) + (
        ["--layers", str(args.layers)] if args.layers else []) + (
        ["--compile"] if getattr(args, "compile", False) else [])  # fmt: skip
    nproc = None if arm == "single" else ws
    return run_worker(__file__, flags, nproc=nproc, what=f"{arm} (ws {ws})")


def _ratio(r: dict, other: dict | None, key: str) -> str:
    return f"{r[key] / other[key]:.2f}x" if other else "-"


def _scaling_table(results: list, find):
    """Where the time goes, against perfect scaling: the floor at ``ws`` ranks is the one-process
    step divided by ``ws`` (each rank does 1/ws of the work); the phases are medians of the same
    steps (forward includes the loss; optimizer includes ``zero_grad``)."""
    from rich.table import Table

    single = find("single", 1)
    table = Table(title="scaling: step vs the perfect-scaling floor (one-process step / ws)")
    for col in ("arm", "ws", "step (s)", "floor (s)", "vs floor", "forward", "backward",
                "optimizer"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        floor = single["step_s"] / r["world_size"] if single else None
        ph = r.get("phases_s", {})
        table.add_row(
            r["arm"], str(r["world_size"]), f"{r['step_s']:.3f}",
            f"{floor:.3f}" if floor else "-", f"{r['step_s'] / floor:.2f}x" if floor else "-",
            *(f"{ph[k]:.3f}" if k in ph else "-" for k in ("forward", "backward", "optimizer")),
        )  # fmt: skip
    return table


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    if args.device == "cuda":
        plan = [("ours", 1), ("torch_fsdp", 1), ("single", 1)]
        plan += [("ours_offload", 1)] if args.offload else []
    else:
        plan = [("ours", 2), ("torch_fsdp", 2), ("ddp", 2), ("single", 1), ("ours", 1)]
        if not args.skip_ws4:
            plan += [("ours", 4), ("torch_fsdp", 4), ("ddp", 4)]
    results = []
    console = Console()
    with Progress(console=console) as progress:
        task = progress.add_task("benchmark arms", total=len(plan))
        for arm, ws in plan:
            progress.update(task, description=f"{arm} ws={ws}")
            results.append(run_arm(arm, ws, args))
            progress.advance(task)

    def find(arm, ws):
        return next((r for r in results if r["arm"] == arm and r["world_size"] == ws), None)

    table = Table(title=f"GPT {results[0]['params'] / 1e6:.1f}M params, global batch "
                  f"{args.global_batch}x{args.seq}, median of {args.steps} steps")  # fmt: skip
    for col in ("arm", "ws", "step (s)", "vs torch FSDP2", "vs DDP", "peak RSS (MB)",
                "RSS vs DDP", "tracked peak (MB)", "tracked vs DDP", "state (MB)"):  # fmt: skip
        table.add_column(col, justify="right")
    cuda = args.device == "cuda"
    if cuda:
        table.add_column("GPU peak (MB)", justify="right")
        table.add_column("MFU", justify="right")
    for r in results:
        ws = r["world_size"]
        fsdp, ddp = find("torch_fsdp", ws), find("ddp", ws)
        if ws == 1:
            ddp = find("single", 1)  # at one rank, compare with the plain model
        ratio_f = f"{r['step_s'] / fsdp['step_s']:.2f}x" if fsdp else "-"
        ratio_d = f"{r['step_s'] / ddp['step_s']:.2f}x" if ddp else "-"
        gpu = [f"{r['gpu_peak_mb']:.0f}", f"{r['mfu']:.1%}" if r["mfu"] else "-"] if cuda else []
        table.add_row(
            r["arm"], str(ws), f"{r['step_s']:.3f}", ratio_f, ratio_d,
            f"{r['peak_rss_mb']:.0f}", _ratio(r, ddp, "peak_rss_mb"), f"{r['tracked_peak_mb']:.0f}",
            _ratio(r, ddp, "tracked_peak_mb"), f"{r['state_mb']:.0f}", *gpu,
        )  # fmt: skip
    console.print(table)
    console.print("(at ws=1 the 'vs DDP' column compares with the plain single-process model)")
    if not cuda:
        console.print(_scaling_table(results, find))
    out = ROOT / "bench_results" / ("train_cuda.json" if cuda else "train.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
