"""Train the byte-level GPT with 2-D parallelism: tensor parallelism inside a group of
``--tp`` ranks, FSDP across the ``--dp`` groups (HSDP with ``--replicate``), all on one
named mesh laid out by ``fsdp2.parallelize_transformer``.

    make train-2d                                    # torchrun, 4 CPU processes: dp=2, tp=2
    python examples/train_2d.py --dp 2 --tp 2 --steps 100
    python examples/train_2d.py --compile                   # blocks torch.compile'd

Ranks of one tensor-parallel group see the same batch; each data-parallel group its own.
Output as ``examples/train_gpt.py``: progress (or log lines), a loss table, per-rank memory.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from device_mesh import init_device_mesh  # noqa: E402
from dtensor.parallel import loss_parallel  # noqa: E402
from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan  # noqa: E402
from examples.train_gpt import (  # noqa: E402
    add_compile_argument,
    batch_at,
    load_bytes,
    lr_at,
    report,
    start_progress,
    state_bytes,
    torchrun_command,
)
from fsdp2 import parallelize_transformer, register_fsdp_forward_method  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None, help="text file or folder (default: stdlib)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP) size")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicas (x dp ranks each)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--loss-parallel", action="store_true", help="keep logits vocab-sharded")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    add_compile_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--log-every", type=int, default=50, help="steps between loss lines")
    args = p.parse_args(argv)
    args.nproc = args.replicate * args.dp * args.tp
    return args


def build(args):
    names, shape = ("dp", "tp"), (args.dp, args.tp)
    if args.replicate > 1:
        names, shape = ("dp_replicate", "dp_shard", "tp"), (args.replicate, args.dp, args.tp)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    cfg = GPTConfig(
        vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        max_seq_len=args.seq, fused_qkv=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    parallelize_transformer(
        model,
        mesh,
        tp_plan=tp_plan(loss_parallel=args.loss_parallel),
        activation_checkpointing=args.checkpoint,
        compile=args.compile or False,
    )
    register_fsdp_forward_method(model, "generate")
    model.to_empty(device="cpu")  # each rank allocates only its shards
    torch.manual_seed(0)
    model.reset_parameters()
    return mesh, cfg, model


def train(args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh, cfg, model = build(args)
    dp_index = rank // args.tp  # ranks of one tp group share a batch
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    data = load_bytes(args.data)
    n_dp = ws // args.tp

    progress = console = task = None
    if rank == 0:
        from rich.console import Console

        console = Console()
        console.print(
            f"[bold]2-D GPT[/]: {cfg.num_params() / 1e6:.2f}M parameters, mesh "
            f"{dict(zip(mesh.mesh_dim_names, mesh.shape))}, batch {args.batch}x{args.seq} per "
            "data-parallel rank" + (", loss_parallel" if args.loss_parallel else "")
        )
        progress, task = start_progress(console, args.steps)

    logged: list[tuple[int, float]] = []
    tokens = 0
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = batch_at(data, args.batch, args.seq, 1000 + dp_index, step)
        if args.loss_parallel:
            with loss_parallel():
                loss = gpt_loss(model, x, y)
                loss.backward()
            loss = loss.to_local()
        else:
            loss = gpt_loss(model, x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        tokens += x.numel() * n_dp
        logs_now = step % args.log_every == 0 or step == args.steps - 1
        if logs_now:
            value = loss.detach().clone()
            dist.all_reduce(value)  # tp ranks hold equal losses: the mean over all is right
            logged.append((step, value.item() / ws))
        tps = tokens / (time.perf_counter() - start)
        if progress is not None:
            progress.update(task, advance=1, loss=f"{logged[-1][1]:.3f}", tps=f"{tps:,.0f}")
        elif console is not None and logs_now:
            console.print(
                f"step {step + 1:5d}/{args.steps}  loss {logged[-1][1]:.4f}  {tps:9,.0f} tok/s",
                highlight=False,
            )
    elapsed = time.perf_counter() - start
    mine = {
        "rank": rank,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_mb": state_bytes(model, opt) / 2**20,
    }
    everyone = [None] * ws
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        if progress is not None:
            progress.stop()
        report(console, logged, everyone, tokens / elapsed, elapsed)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        import subprocess

        raise SystemExit(subprocess.call(torchrun_command(args, sys.argv[1:], __file__)))
    train(args)


if __name__ == "__main__":
    main()
