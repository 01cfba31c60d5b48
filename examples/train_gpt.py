"""Train a small byte-level GPT with fully_shard on every block and on the root.

The text is the source of Python's standard library (every machine with Python has it), read
as bytes, so the vocabulary is 256. ``--data PATH`` trains on any text file or folder.

    make train                                   # torchrun, 2 CPU processes, gloo
    python examples/train_gpt.py --nproc 4 --steps 100 --dim 256
    python examples/train_gpt.py --checkpoint-dir ckpt --checkpoint-every 100
    python examples/train_gpt.py --checkpoint-dir ckpt --steps 1000   # goes on from ckpt
    python examples/train_gpt.py --compile                # every block torch.compile'd
    python examples/train_gpt.py --steps 20 --profile-memory --memory-chart memory.svg

Checkpoints (``dtensor.checkpoint``) go to ``step-NNNNNN`` folders. On start the script
continues from the newest committed one there, at any world size (the checkpoint reshards on
load): step, model, optimizer and data position. The data is one stream of samples, sample
``i`` a function of ``i`` alone; a step at world size ``W`` takes the next ``W x --batch`` of
them, rank ``r`` the ``r``-th ``--batch``, and the checkpoint records how many were taken. So
a run is a function of (checkpoint, world size): resumed at the same world size it is
bit-identical to the run that went on, and at another it continues the same stream.

Elastic, under torchrun's own agents (one per node, here all on one machine): a node that
dies takes its rank with it, the other agents restart their workers at the smaller world
size, and those continue from the newest checkpoint (README, "Elastic training under
torchrun", says why the variable)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=3:4 --nproc-per-node=1 \
        --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 --rdzv-id=gpt \
        examples/train_gpt.py --checkpoint-dir ckpt --checkpoint-every 50

Run without torchrun, the script starts torchrun itself with ``--nproc`` processes. On a
terminal rank 0 shows a progress bar; otherwise (a log file, CI) it prints a line every
``--log-every`` steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtensor import checkpoint as dcp  # noqa: E402
from examples.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402
from fsdp2 import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method  # noqa: E402
from fsdp2.tools import CommLedger, expected_step_comms, format_ledger  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None, help="text file or folder (default: stdlib)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 compute, fp32 gradient reduction. CPUs without native bf16 matrix "
        "instructions (AVX512-BF16 or AMX) emulate it: a bf16 matmul measured 26x slower "
        "than fp32 on this project's AMD EPYC CI machine, so there it only exercises the "
        "code path",
    )
    add_compile_argument(p)
    p.add_argument("--nproc", type=int, default=2, help="processes, when not under torchrun")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--log-every", type=int, default=50, help="steps between loss lines")
    p.add_argument("--temperature", type=float, default=0.8, help="closing sample; 0 = greedy")
    p.add_argument("--top-k", type=int, default=20, help="closing sample: the k likeliest bytes")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="save step-N checkpoints here")
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="fail unless --checkpoint-dir holds a checkpoint (one there is always resumed)",
    )
    p.add_argument(
        "--loss-log",
        type=Path,
        default=None,
        help="rank 0 appends a JSON line per logged step: step, loss, world size, and its "
        "agent's TORCHELASTIC_RESTART_COUNT",
    )
    p.add_argument("--profile-comm", action="store_true", help="communication ledger of every step")
    p.add_argument(
        "--profile-memory",
        action="store_true",
        help="track live tensor bytes by category, phase and module (fsdp2.tools.MemoryTracker), "
        "count each step's collectives against the expectation (fsdp2.tools.CommLedger) "
        "and print rank 0's tables at the end",
    )
    p.add_argument(
        "--memory-chart", type=Path, default=None, help="write rank 0's memory over the last "
        "step, by category, to this .svg (or .html)",
    )  # fmt: skip
    return p.parse_args(argv)


def add_compile_argument(p: argparse.ArgumentParser) -> None:
    """``--compile [BACKEND]``: torch.compile each block (default backend: inductor)."""
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile each block before sharding it (default backend: inductor)",
    )


def torchrun_command(
    args: argparse.Namespace, argv: list[str], script: str = __file__
) -> list[str]:
    """The torchrun command that runs this script with ``args.nproc`` processes.

    ``--nproc`` itself is not passed on: torchrun parses the whole command line and would
    take it for an abbreviation of its own ``--nproc-per-node``.
    """
    forwarded, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            forwarded.append(a)
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", script, *forwarded,
    ]  # fmt: skip


def relaunch_under_torchrun(args: argparse.Namespace) -> int:
    return subprocess.call(torchrun_command(args, sys.argv[1:]))


# ------------------------------------------------------------------------------------ data
def load_bytes(path: Path | None, limit: int = 16 << 20) -> torch.Tensor:
    """Concatenate text files (sorted, so every rank reads the same bytes) up to ``limit``."""
    root = path or Path(sysconfig.get_paths()["stdlib"])
    files = [root] if root.is_file() else sorted(root.rglob("*.py" if path is None else "*"))
    chunks, total = [], 0
    for f in files:
        if not f.is_file():
            continue
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 1024:
        raise SystemExit(f"train_gpt: found only {total} bytes of text under {root}.")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


SEED = 1_000_003_000  # of train_gpt's sample stream


def batch_at(data: torch.Tensor, batch: int, seq: int, seed: int, step: int):
    """The (inputs, targets) of one step: a function of (seed, step), so runs can resume."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()
    return window[:, :-1], window[:, 1:]


def samples_at(data: torch.Tensor, seq: int, seed: int, first: int, count: int):
    """(inputs, targets) of samples ``first .. first + count - 1`` of the stream ``seed``.

    Sample ``i`` is the window at a start drawn from a generator seeded by (seed, i) alone,
    so a rank can read any stretch of the stream without the samples before it.
    """
    high = len(data) - seq - 1
    starts = [
        int(torch.randint(0, high, (1,), generator=torch.Generator().manual_seed(seed + i)))
        for i in range(first, first + count)
    ]
    window = torch.stack([data[s : s + seq + 1] for s in starts]).long()
    return window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------ checkpoints
def training_state(model, opt, step: int, samples: int = 0) -> dict:
    """What a checkpoint holds: sharded model and optimizer state, the next step, and the
    data position: how many samples of the stream the steps before it took (all ranks)."""
    return {
        "model": dcp.get_model_state_dict(model),
        "optim": dcp.get_optimizer_state_dict(model, opt),
        "step": step,
        "samples": samples,
    }


def newest_checkpoint(root: Path | None) -> Path | None:
    """The committed ``step-N`` folder with the highest N under ``root``, if any."""
    if root is None or not root.is_dir():
        return None
    done = [p for p in root.glob("step-*") if (p / "metadata.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def resume(model, opt, root: Path | None) -> tuple[int, int, Path | None]:
    """Load the newest checkpoint under ``root`` in place, at whatever world size this is.

    Returns (step to continue at, samples taken before it, the checkpoint), or
    ``(0, 0, None)`` when there is none.
    """
    path = newest_checkpoint(root)
    if path is None:
        return 0, 0, None
    state = training_state(model, opt, 0, 0)
    dcp.load(state, checkpoint_id=path)
    dcp.set_optimizer_state_dict(model, opt, state["optim"])
    return int(state["step"]), int(state["samples"]), path


# ------------------------------------------------------------------------------------ model
def build_model(args, cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)  # same initial weights on every rank
    with torch.device("meta"):
        model = GPT(cfg)
    policy = MixedPrecisionPolicy()
    if args.bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        if args.compile:  # compiled regions inside FSDP's hooks (docs/compile.md)
            block.compile(backend=args.compile)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    register_fsdp_forward_method(model, "generate")  # gathers parameters around generate()
    model.to_empty(device="cpu")  # each rank allocates only its shards
    model.reset_parameters()
    return model


def lr_at(step: int, args) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def state_bytes(model, opt) -> int:
    """Bytes of this rank's parameter, gradient and optimizer-state shards."""
    total = 0
    for p in model.parameters():
        total += p.to_local().numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.to_local().numel() * p.grad.element_size()
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.ndim:
                total += v.to_local().numel() * v.element_size()
    return total


# ------------------------------------------------------------------------------------ main
def train(args) -> list[tuple[int, float]]:
    """Train on the default process group (made here from torchrun's environment unless one
    exists); returns the logged (step, loss) pairs on every rank."""
    torch.set_num_threads(args.threads)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(
        vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        max_seq_len=args.seq,
    )  # fmt: skip
    model = build_model(args, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    data = load_bytes(args.data)
    first, samples, resumed_from = resume(model, opt, args.checkpoint_dir)
    if args.resume and resumed_from is None:
        raise SystemExit(f"train_gpt: --resume: no committed checkpoint in {args.checkpoint_dir}")
    shown = _Shown.start(args, cfg, data, first, resumed_from) if rank == 0 else _Shown()
    # --profile-comm: each step's collectives beside the expected ones (docs/tools.md)
    ledger = (
        CommLedger(expected_step_comms(model, clip_grad_norm=True))
        if args.profile_comm or args.profile_memory
        else None
    )
    memory = start_memory_tracker(args, model, opt)
    run = _Run(args, model, opt, data, samples, ledger)
    for step in range(first, args.steps):
        run.step(step)
        shown.step(step, run.logged, run.tokens / (time.perf_counter() - run.start), args)
    elapsed = time.perf_counter() - run.start
    if memory is not None:
        memory.__exit__(None, None, None)
    _finish(args, model, opt, run, shown, memory, elapsed)
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()
    return run.logged


class _Run:
    """The training loop's state: the sample cursor, the tokens seen, the logged losses."""

    def __init__(self, args, model, opt, data, samples: int, ledger) -> None:
        self.args, self.model, self.opt, self.data, self.ledger = args, model, opt, data, ledger
        self.samples = samples
        self.tokens = 0
        self.logged: list[tuple[int, float]] = []
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.start = time.perf_counter()

    def step(self, step: int) -> None:
        """One optimizer step on this rank's batch, then its log line and checkpoint."""
        args, ws = self.args, self.ws
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = samples_at(self.data, args.seq, SEED, self.samples + self.rank * args.batch, args.batch)
        self.samples += ws * args.batch
        with self.ledger.step() if self.ledger else contextlib.nullcontext():
            loss = gpt_loss(self.model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad()
        self.tokens += x.numel() * ws
        if step % args.log_every == 0 or step == args.steps - 1:
            self.log(step, loss)
        every = args.checkpoint_every
        if args.checkpoint_dir and ((every and (step + 1) % every == 0) or step == args.steps - 1):
            where = args.checkpoint_dir / f"step-{step + 1:06d}"
            state = training_state(self.model, self.opt, step + 1, self.samples)
            dcp.save(state, checkpoint_id=where)

    def log(self, step: int, loss: torch.Tensor) -> None:
        """The mean loss over the ranks, kept and (rank 0, ``--loss-log``) appended."""
        value = loss.detach().clone()
        dist.all_reduce(value)
        self.logged.append((step, value.item() / self.ws))
        if self.rank == 0 and self.args.loss_log is not None:
            line = {
                "step": step, "loss": self.logged[-1][1], "world_size": self.ws,
                "restart": self.restart,
            }  # fmt: skip
            with open(self.args.loss_log, "a") as f:
                f.write(json.dumps(line) + "\n")


class _Shown:
    """What rank 0 shows while it trains (nothing on the other ranks)."""

    def __init__(self, console=None, progress=None, task=None) -> None:
        self.console, self.progress, self.task = console, progress, task

    @classmethod
    def start(cls, args, cfg, data, first: int, resumed_from) -> _Shown:
        from rich.console import Console

        console = Console()
        console.print(
            f"[bold]fully_shard GPT[/]: {cfg.num_params() / 1e6:.2f}M parameters, "
            f"{dist.get_world_size()} ranks, {len(data) / 1e6:.1f} MB of text, batch "
            f"{args.batch}x{args.seq} per rank" + (", bf16" if args.bf16 else "")
        )
        progress, task = start_progress(console, args.steps)
        if first and progress is not None:
            progress.update(task, completed=first)
        if resumed_from is not None:
            ws = dist.get_world_size()
            console.print(f"resumed from step {first} ({resumed_from}) at world size {ws}")
        return cls(console, progress, task)

    def step(self, step: int, logged, tps: float, args) -> None:
        if self.progress is not None:
            shown = f"{logged[-1][1]:.3f}" if logged else "-"
            self.progress.update(self.task, advance=1, loss=shown, tps=f"{tps:,.0f}")
        elif self.console is not None and (step % args.log_every == 0 or step == args.steps - 1):
            self.console.print(
                f"step {step + 1:5d}/{args.steps}  loss {logged[-1][1]:.4f}  {tps:9,.0f} tok/s",
                highlight=False,
            )


def _finish(args, model, opt, run: _Run, shown: _Shown, memory, elapsed: float) -> None:
    """After the last step: every rank's memory, a sample, and (rank 0) the reports."""
    mine = {
        "rank": run.rank,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_mb": state_bytes(model, opt) / 2**20,
    }
    everyone = [None] * run.ws
    dist.all_gather_object(everyone, mine)
    same_draws = torch.Generator().manual_seed(0)  # every rank samples the same bytes
    sample = model.generate(  # every rank takes part: the parameters are sharded
        torch.tensor([list(b"def ")]),
        48,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=same_draws,
    )
    if run.rank != 0:
        return
    console = shown.console
    if shown.progress is not None:
        shown.progress.stop()
    report(console, run.logged, everyone, run.tokens / max(elapsed, 1e-9), elapsed)
    memory_report(memory, args, console)
    text = bytes(sample[0].tolist()).decode("utf-8", errors="replace")
    console.print("sample:", repr(text))
    ledger = run.ledger
    if ledger is not None and ledger.steps:
        bad = len(ledger.mismatched_steps)
        console.print(format_ledger(ledger.last), f"\n{bad} step(s) differed", highlight=False)


def start_memory_tracker(args, model, opt):
    """``--profile-memory`` / ``--memory-chart``: a started ``MemoryTracker`` (else None)."""
    if not (args.profile_memory or args.memory_chart):
        return None
    from fsdp2.tools import MemoryTracker

    return MemoryTracker(model, opt, timeline=1 if args.memory_chart else False).__enter__()


def memory_report(tracker, args, console) -> None:
    """Print the tracker's tables and write the chart (rank 0, at the end of the run)."""
    if tracker is None:
        return
    if args.profile_memory:
        from fsdp2.tools.tables import print_memory_summary

        print_memory_summary(tracker, console)
    if args.memory_chart:
        from fsdp2.tools.chart import write_memory_chart

        console.print(f"memory chart: {write_memory_chart(tracker, args.memory_chart)}")


def start_progress(console, steps: int):
    """A live progress bar on a terminal; ``(None, None)`` for a log file (plain lines)."""
    if not console.is_terminal:
        return None, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
        TimeRemainingColumn(), console=console,
    )  # fmt: skip
    progress.start()
    return progress, progress.add_task("train", total=steps, loss="-", tps="-")


def report(console, logged, ranks, tps, elapsed) -> None:
    from rich.table import Table

    losses = Table(title="loss")
    losses.add_column("step", justify="right")
    losses.add_column("loss", justify="right")
    for step, value in logged:
        losses.add_row(str(step), f"{value:.4f}")
    console.print(losses)
    mem = Table(title="per-rank memory")
    for col in ("rank", "peak RSS (MB)", "param+grad+optim shards (MB)"):
        mem.add_column(col, justify="right")
    for r in ranks:
        mem.add_row(str(r["rank"]), f"{r['rss_mb']:.0f}", f"{r['state_mb']:.1f}")
    console.print(mem)
    if not logged:  # resumed from the last step's checkpoint: nothing left to train
        return
    first, last = logged[0][1], logged[-1][1]
    console.print(
        f"tokens/s {tps:,.0f} over {elapsed:.1f} s; loss {first:.4f} -> {last:.4f} "
        f"({100 * (first - last) / first:.1f}% lower)"
    )


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        raise SystemExit(relaunch_under_torchrun(args))
    train(args)


if __name__ == "__main__":
    main()
