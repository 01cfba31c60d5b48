"""``python -m fsdp2.plan``: rank the layouts that fit a per-GPU memory budget.

    python -m fsdp2.plan --model gpt --params 7e9 --world-size 64 --gpu-memory 80GB
    python -m fsdp2.plan --hf-config path/to/config.json --world-size 256 --gpu-memory 80GB
    python -m fsdp2.plan --model gpt --params 7e9 --world-size 64 --tp 8 --ac   # one layout

Prints the layouts that fit, fastest first (predicted step time), with each one's peak
memory by category, and a breakdown of the best one; when none fits, what would
(``fsdp2.tools.advice``).
Weights, gradients and optimizer state are planned in the master dtype (``--master-dtype``,
fp32 by default, whatever a config's ``torch_dtype`` says), compute in ``--dtype``.
Assumptions (H100 SXM, NVLink 450 GB/s, InfiniBand 50 GB/s per GPU, 40% MFU) are options.
docs/tools.md ("Memory planner") says what the model counts and how it was validated.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
from rich.console import Console
from rich.table import Table

from fsdp2.plan import build_model
from fsdp2.tools.advice import nothing_fits_advice
from fsdp2.tools.planner import (
    CATEGORIES,
    CPU,
    H100,
    PlanConfig,
    parse_bytes,
    profile_model,
    rank_configs,
)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DECIMAL = {"KB": 3, "MB": 6, "GB": 9, "TB": 12}
_STATE = {"adamw": "AdamW state", "sgd": "SGD momentum", "sgd-nomomentum": ""}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: What the peak is, and what the allocator holds above it (measured; docs/tools.md).
LIVE_BYTES_NOTE = (
    "peak = live tensor bytes (what fsdp2.tools.MemoryTracker and "
    "torch.cuda.max_memory_allocated count); the allocator holds more: reserved / allocated "
    "was 1.11-1.34 on an H200 (eager, AC, offload, compiled), and on CPU the resident set "
    "9-22% above the live bytes plus about 315 MiB of runtime"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fsdp2.plan", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="model size in parameters, e.g. 7e9")
    src.add_argument("--hf-config", help="a Hugging Face config.json (or its folder)")
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                   help="with --params: examples/gpt.py's GPT or transformers' Llama")  # fmt: skip
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--gpu-memory", default=None,
                   help="per-rank budget: 79.6GiB (binary) or 80GB (decimal: 80e9 bytes)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (default: one per data-parallel rank of tp=1)")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                   help="compute dtype: the mixed-precision policy's param_dtype (reduce in fp32)")  # fmt: skip
    p.add_argument("--master-dtype", choices=sorted(_MASTER_DTYPES), default="fp32",
                   help="dtype of the weights at rest, their gradients and the optimizer state "
                        "(default fp32; a config's torch_dtype is ignored)")  # fmt: skip
    p.add_argument("--optimizer", choices=("adamw", "sgd", "sgd-nomomentum"), default="adamw")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy")
    p.add_argument("--hardware", choices=("h100", "cpu"), default="h100")
    p.add_argument("--flops", type=float, help="peak FLOP/s per device (override)")
    p.add_argument("--mfu", type=float, help="fraction of peak reached (override)")
    p.add_argument("--intra-bw", type=float, help="bytes/s per device within a node")
    p.add_argument("--inter-bw", type=float, help="bytes/s per device across nodes")
    p.add_argument("--devices-per-node", type=int)
    p.add_argument("--tp", type=int, default=None, help="only this tensor-parallel degree")
    p.add_argument("--replicate", type=int, default=None, help="only this HSDP replica count")
    p.add_argument("--ac", action="store_true", help="only layouts with activation checkpointing")
    p.add_argument("--top", type=int, default=12, help="rows to show")
    p.add_argument("--auto", action="store_true",
                   help="search block by block (checkpointing, keep-last, dtypes, offload as a "
                        "last resort) and print the chosen layout as fsdp2.auto_parallelize "
                        "would apply it")  # fmt: skip
    p.add_argument("--apply-check", action="store_true",
                   help="with --auto: dry-run the chosen plan at --world-size on the fake "
                        "process group and print the plan and what the library built side "
                        "by side")  # fmt: skip
    p.add_argument("--margin", type=float, default=None,
                   help="--auto: fit peak * (1 + margin) in the budget (default: the "
                        "hardware's measured allocator overhead)")  # fmt: skip
    return p.parse_args(argv)


def hardware_of(args):
    """The ``Hardware`` of the options (a preset, then any overrides)."""
    hw = H100 if args.hardware == "h100" else CPU
    overrides = {
        "flops": args.flops,
        "efficiency": args.mfu,
        "intra_node_bw": args.intra_bw,
        "inter_node_bw": args.inter_bw,
        "devices_per_node": args.devices_per_node,
    }
    return replace(hw, **{k: v for k, v in overrides.items() if v is not None})


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _moments(phases: dict) -> dict:
    """The moments to show: every phase but the per-block backward ones, of which only the
    highest (``"backward blocks[i]"``)."""
    per_block = {k: v for k, v in phases.items() if k.startswith("backward blocks")}
    out = {}
    for name, cats in phases.items():
        if name in per_block:
            worst = max(per_block, key=lambda k: sum(per_block[k].values()))
            if name == worst:
                out[name] = cats
        else:
            out[name] = cats
    return out


def precision(args) -> tuple[torch.dtype, torch.dtype | None, torch.dtype | None]:
    """``(master, param_dtype, reduce_dtype)`` of the options: the parameters' dtype at rest
    and the ``MixedPrecisionPolicy`` dtypes (None: the parameters' own). Reductions run in
    fp32 unless everything is fp32 already.

    Example:
        >>> precision(parse_args(["--params", "7e9", "--world-size", "8"]))
        (torch.float32, torch.bfloat16, torch.float32)
    """
    master = _MASTER_DTYPES[args.master_dtype]
    compute = _DTYPES[args.dtype]
    param_dtype = None if compute == master else compute
    reduce_dtype = None if compute == master == torch.float32 else torch.float32
    return master, param_dtype, reduce_dtype


def precision_line(args) -> str:
    """The header's line on dtypes, e.g. ``"weights and AdamW state fp32 (master), compute
    bf16, reduce fp32"``.

    Example:
        >>> precision_line(parse_args(["--params", "7e9", "--world-size", "8"]))
        'weights and AdamW state fp32 (master), compute bf16, reduce fp32'
    """
    master, param_dtype, reduce_dtype = precision(args)
    state = _STATE[args.optimizer]
    what = f"weights and {state}" if state else f"weights ({args.optimizer}: no state)"
    compute = param_dtype or master
    return (
        f"{what} {_NAMES[master]} (master), compute {_NAMES[compute]}, "
        f"reduce {_NAMES[reduce_dtype or compute]}"
    )


def budget_line(text: str | None, budget: int | None, hw) -> str:
    """How the budget was read: GiB, and for a decimal unit (``80GB`` is ``80e9`` bytes,
    74.5 GiB) a note on what a GPU sold as "80GB" has.

    Example:
        >>> budget_line("80GB", parse_bytes("80GB"), H100)
        "budget 74.5 GiB a rank (80GB read as 80e9 bytes; an '80GB' H100 has 79.6 GiB: --gpu-memory 79.6GiB)"
        >>> budget_line("79.6GiB", parse_bytes("79.6GiB"), H100)
        'budget 79.6 GiB a rank'
    """
    if budget is None:
        return "no budget"
    line = f"budget {_gib(budget)} GiB a rank"
    if text is None:
        return f"{line} (the {hw.name.split(' (')[0]} preset: {budget / 2**20:,.0f} MiB)"
    s = str(text).strip().upper().replace(" ", "")
    unit = s.lstrip("0123456789.")
    if unit not in _DECIMAL:
        return line
    number = s[: -len(unit)]
    note = f"{text.strip()} read as {number}e{_DECIMAL[unit]} bytes"
    if hw.memory and hw.device != "cpu" and budget == 80 * 10**9:  # the H100's nominal size
        real = _gib(hw.memory)
        note += f"; an '80GB' {hw.name.split(' ')[0]} has {real} GiB: --gpu-memory {real}GiB"
    else:
        binary = f"{number}{unit[0]}iB"
        note += f"; {binary} would be --gpu-memory {binary}"
    return f"{line} ({note})"


def _rank(args, profile, hw, budget):
    """``(fits, too_big)`` of ``rank_configs`` over the layouts the options allow."""
    _master, param_dtype, reduce_dtype = precision(args)
    base = PlanConfig(
        world_size=args.world_size,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        optimizer=args.optimizer,
        offload=args.offload,
    )
    tps = (args.tp,) if args.tp else (1, 2, 4, 8)
    return rank_configs(
        profile,
        args.world_size,
        budget,
        hardware=hw,
        global_batch=args.global_batch,
        tp_degrees=tps,
        replicate_degrees=[args.replicate] if args.replicate else None,
        activation_checkpointing=(True,) if args.ac else (False, True),
        base=base,
    )


def _print_header(console, label: str, args, hw, budget) -> None:
    """The model, the dtypes, the budget, the hardware assumed and what the peak counts."""
    console.print(f"[bold]{label}[/bold]; seq {args.seq_len}, {args.optimizer}", markup=True)
    console.print(precision_line(args) + ("; CPU offload" if args.offload else ""))
    console.print(
        f"{args.world_size} ranks, {budget_line(args.gpu_memory, budget, hw)}",
        markup=False,
    )
    console.print(
        f"{hw.name}, {hw.flops / 1e12:.0f} TFLOP/s at {hw.efficiency:.0%} MFU, "
        f"{hw.devices_per_node} devices a node"
    )
    console.print(LIVE_BYTES_NOTE, style="dim", markup=False)


def _layouts_table(fits, too_big, top: int) -> Table:
    """The first ``top`` layouts that fit, one row each with its peak by category group."""
    table = Table(
        title=f"layouts that fit ({len(fits)} of {len(fits) + len(too_big)}), fastest first"
    )
    for col in ("#", "layout", "batch", "peak GiB", "state", "unsharded", "activations",
                "comm buf", "step s", "comm s"):  # fmt: skip
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for i, e in enumerate(fits[:top]):
        c = e.categories
        table.add_row(
            str(i + 1),
            e.config.describe(),
            str(e.config.batch_size),
            _gib(e.peak_bytes),
            _gib(c["sharded_params"] + c["sharded_grads"] + c["optimizer_state"]),
            _gib(c["unsharded_params"] + c["unsharded_grads"]),
            _gib(c["activations"] + c["temporaries"]),
            _gib(c["comm_buffers"]),
            f"{e.step_s:.3f}",
            f"{e.comm_s:.3f}",
        )
    return table


def _breakdown_table(best) -> Table:
    """The best layout's memory by category at each moment shown."""
    detail = Table(title=f"best: {best.config.describe()} (peak at {best.peak_phase})")
    detail.add_column("category")
    shown = _moments(best.phases)
    for label in shown:
        detail.add_column(label, justify="right")
    for c in CATEGORIES:
        detail.add_row(c, *(_gib(m[c]) for m in shown.values()))
    detail.add_row("total", *(_gib(sum(m.values())) for m in shown.values()))
    return detail


def _collectives_table(best) -> Table:
    """The best layout's collectives of one step: count and bytes by kind and mesh dim."""
    comm = Table(title="collectives of one step (FSDP; per rank)")
    for col in ("kind", "mesh dim", "count", "GB contributed"):
        comm.add_column(col)
    for (kind, dim), (count, nbytes) in best.collectives.items():
        comm.add_row(kind, str(dim), str(count), f"{nbytes / 1e9:.2f}")
    return comm


def auto_plan(args, console, profile, model, tp_plan, hw, budget) -> int:
    """``--auto`` / ``--apply-check``: the search's choice as an ``AutoPlan`` (its table and
    the calls that apply it) and, with ``--apply-check``, a dry run of it at the world size
    beside the plan. Returns the exit code (1: nothing fits, or the dry run differs)."""
    from fsdp2.auto import AutoPlan, verify_plan
    from fsdp2.tools.search import NothingFitsError, search_layouts

    if budget is None:
        console.print("[red]error:[/red] --auto needs a budget: --gpu-memory")
        return 2
    _master, param_dtype, reduce_dtype = precision(args)
    try:
        result = search_layouts(
            profile,
            args.world_size,
            budget,
            hardware=hw,
            global_batch=args.global_batch,
            margin=args.margin,
            tp_degrees=(args.tp,) if args.tp else None,
            replicate_degrees=[args.replicate] if args.replicate else None,
            param_dtypes=[(param_dtype, reduce_dtype)],
            offload=True if args.offload else "last-resort",
            optimizer=args.optimizer,
        )
    except (NothingFitsError, ValueError) as e:
        console.print(f"[red]{e}[/red]", highlight=False)
        return 1
    plan = AutoPlan.from_estimate(
        result.best, profile, budget=budget, margin=result.margin, considered=result.considered
    )
    console.print(str(plan), markup=False, highlight=False, soft_wrap=True)
    console.print("\n# the calls that apply it (plan.calls())", style="dim")
    console.print("\n".join(plan.calls()), markup=False, highlight=False, soft_wrap=True)
    if not args.apply_check:
        return 0
    check = verify_plan(plan, model, world_size=args.world_size, tp_plan=tp_plan)
    console.print(_check_table(plan, check))
    style = "green" if check.ok else "red"
    console.print(check.summary(), style=style, markup=False, highlight=False)
    return 0 if check.ok else 1


def _check_table(plan, check) -> Table:
    """The plan's collectives and shard sizes beside what the dry run built and issued."""
    table = Table(title=f"plan vs dry run at {plan.world_size} simulated ranks")
    for col in ("what", "plan", *(f"dry run, rank {r.rank}" for r in check.reports), "agree"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for (kind, dim), (count, nbytes) in sorted(plan.collectives.items()):
        seen = [
            f"{r.counts.get((kind, dim), 0)} / {r.bytes.get((kind, dim), 0) / 2**20:,.1f} MiB"
            for r in check.reports
        ]
        same = all(
            (r.counts.get((kind, dim), 0), r.bytes.get((kind, dim), 0)) == (count, nbytes)
            for r in check.reports
        )
        table.add_row(f"{kind} ({dim})", f"{count} / {nbytes / 2**20:,.1f} MiB", *seen,
                      "yes" if same else "NO")  # fmt: skip
    wanted = {r.rank: plan.shard_numel_for(r.rank) for r in check.reports}
    for g in plan.groups:
        cells = [
            f"{r.shard_numel.get(g.name, 0):,} of {wanted[r.rank][g.name]:,}" for r in check.reports
        ]
        same = all(r.shard_numel.get(g.name) == wanted[r.rank][g.name] for r in check.reports)
        table.add_row(f"shard elements of {g.name}", f"{g.shard_numel:,} (rank 0)", *cells,
                      "yes" if same else "NO")  # fmt: skip
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 120))
    try:
        budget = parse_bytes(args.gpu_memory) if args.gpu_memory else None
        model, tp_plan, label = build_model(
            args.model,
            params=args.params,
            hf_config=args.hf_config,
            seq_len=args.seq_len,
            dtype=_MASTER_DTYPES[args.master_dtype],
        )
    except (ValueError, ImportError, OSError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    hw = hardware_of(args)
    budget = budget if budget is not None else hw.memory
    profile = profile_model(model, seq_len=args.seq_len, tp_plan=tp_plan)
    if args.auto or args.apply_check:
        _print_header(console, label, args, hw, budget)
        return auto_plan(args, console, profile, model, tp_plan, hw, budget)
    fits, too_big = _rank(args, profile, hw, budget)
    _print_header(console, label, args, hw, budget)
    if not fits and not too_big:
        console.print("[red]no layout: the global batch divides by no data-parallel size[/red]")
        return 1
    console.print(_layouts_table(fits, too_big, args.top))
    if not fits:
        console.print("[red]nothing fits[/red]")
        if budget is not None:
            for line in nothing_fits_advice(profile, too_big[0], budget, hw):
                console.print(f"  - {line}", markup=False, highlight=False)
        return 1
    console.print(_breakdown_table(fits[0]))
    console.print(_collectives_table(fits[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
