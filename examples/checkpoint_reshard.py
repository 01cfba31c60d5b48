"""Train 4-way FSDP, save, resume as 2-way FSDP x 2-way tensor parallelism, and continue.

    python examples/checkpoint_reshard.py                 # launches torchrun, 4 CPU processes
    python examples/checkpoint_reshard.py --dir ckpt --steps-before 20 --steps-after 10

One job of 4 processes:

1. the byte-level GPT trains ``--steps-before`` steps as FSDP over all 4 ranks, then saves
   model + AdamW state with ``dtensor.checkpoint.save``;
2. that run goes on for ``--steps-after`` steps: the reference losses;
3. a fresh model, differently initialized, is laid out on a 2 x 2 mesh (FSDP over ``dp``,
   tensor parallelism over ``tp``), loads the checkpoint (every rank reads only the slices
   of its new shards) and trains the same ``--steps-after`` steps on the same batches.

The two continuations must agree: the table shows both losses per step, and the script
exits with status 1 if they differ by more than ``--tolerance`` (summation order differs
between layouts, so they agree to rounding, not bit for bit).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from device_mesh import init_device_mesh  # noqa: E402
from dtensor import checkpoint as dcp  # noqa: E402
from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan  # noqa: E402
from examples.train_gpt import batch_at, load_bytes, torchrun_command  # noqa: E402
from fsdp2 import parallelize_transformer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="checkpoint folder (default: a temp)")
    p.add_argument("--data", type=Path, default=None, help="text file or folder (default: stdlib)")
    p.add_argument("--steps-before", type=int, default=8)
    p.add_argument("--steps-after", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, over all ranks")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest loss difference")
    args = p.parse_args(argv)
    args.nproc = 4
    if args.batch % 4:
        p.error(f"--batch {args.batch} must divide among 4 data-parallel ranks")
    return args


def build(args, shape: tuple[int, ...], names: tuple[str, ...], seed: int):
    """The GPT on a mesh of ``shape``: FSDP over ``dp``, tensor parallelism over ``tp`` if any."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    cfg = GPTConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                    max_seq_len=args.seq, fused_qkv=False)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg)
    parallelize_transformer(model, mesh, tp_plan=tp_plan() if "tp" in names else None)
    model.to_empty(device="cpu")  # each rank allocates only its shards
    torch.manual_seed(seed)
    model.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    return mesh, model, opt


def train(model, opt, mesh, args, data, steps: range) -> list[float]:
    """Run ``steps``; the data-parallel ranks split each global batch by rows."""
    n_dp, dp = mesh.size(0), mesh.get_local_rank("dp")
    rows = slice(dp * args.batch // n_dp, (dp + 1) * args.batch // n_dp)
    losses = []
    for step in steps:
        x, y = batch_at(data, args.batch, args.seq, 1000, step)
        loss = gpt_loss(model, x[rows], y[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)  # ranks of one tp group hold the same loss
        losses.append(value.item() / dist.get_world_size())
    return losses


def state(model, opt, step: int) -> dict:
    return {"model": dcp.get_model_state_dict(model),
            "optim": dcp.get_optimizer_state_dict(model, opt), "step": step}  # fmt: skip


def run(args) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = load_bytes(args.data)
    root = args.dir
    if root is None:  # rank 0 picks a temporary folder; the others learn its name
        name = [tempfile.mkdtemp(prefix="reshard-") if rank == 0 else None]
        dist.broadcast_object_list(name)
        root = Path(name[0])
    ckpt = root / f"step-{args.steps_before:06d}"
    before, after = (
        range(args.steps_before),
        range(args.steps_before, args.steps_before + args.steps_after),
    )

    mesh, model, opt = build(args, (4,), ("dp",), seed=0)
    train(model, opt, mesh, args, data, before)
    dcp.save(state(model, opt, args.steps_before), checkpoint_id=ckpt)
    reference = train(model, opt, mesh, args, data, after)
    del model, opt

    mesh, model, opt = build(args, (2, 2), ("dp", "tp"), seed=1)  # another init, overwritten
    loaded = state(model, opt, 0)
    dcp.load(loaded, checkpoint_id=ckpt)
    dcp.set_optimizer_state_dict(model, opt, loaded["optim"])
    resumed = train(model, opt, mesh, args, data, range(loaded["step"], after.stop))

    worst = max(abs(a - b) for a, b in zip(reference, resumed, strict=True))
    if rank == 0:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"resumed from {ckpt} (saved by FSDP 4, loaded as FSDP 2 x TP 2)")
        for col in ("step", "FSDP 4 (went on)", "FSDP 2 x TP 2 (resumed)", "difference"):
            table.add_column(col, justify="right")
        for step, a, b in zip(after, reference, resumed, strict=True):
            table.add_row(str(step + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}")
        console = Console()
        console.print(table)
        verdict = "match" if worst <= args.tolerance else "[red]DIFFER[/red]"
        console.print(
            f"losses {verdict}: largest difference {worst:.1e} (tolerance {args.tolerance:.0e})"
        )
    dist.barrier()
    if args.dir is None and rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    return 0 if worst <= args.tolerance else 1


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        import subprocess

        raise SystemExit(subprocess.call(torchrun_command(args, sys.argv[1:], __file__)))
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
