"""The memory planner's predicted peak against the memory tracker's measured peak, per config.

    python benchmarks/plan_validation.py            # the benchmark GPT (train_bench.py's)
    python benchmarks/plan_validation.py --small    # a small GPT, quick
    python benchmarks/plan_validation.py --only ws2-fsdp,ws4-hsdp

Every configuration runs in its own ``torchrun`` job on gloo (CPU): the model is built on
meta, laid out by ``fsdp2.parallelize_transformer`` (per-block ``fully_shard`` and the root,
tensor parallelism, activation checkpointing, mixed precision as the config says),
materialized, and trained one step with AdamW (so the optimizer state exists); the next
step - forward, backward, ``opt.step()``, ``zero_grad()`` - runs under
``fsdp2.tools.memory.MemoryTracker`` and rank 0 reports its peak of live tensor bytes. The
planner predicts the same step from a meta copy of the model, without running anything
(``fsdp2.tools.planner.estimate`` with the ``CPU`` hardware: gloo's routes, one reduction
in flight). The table gives both, their ratio, and the categories at each peak.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: world size, tp, HSDP replicas, activation checkpointing, bf16, reshard_after_forward
CONFIGS = {
    "ws1-plain": dict(ws=1),
    "ws2-fsdp": dict(ws=2),
    "ws4-fsdp": dict(ws=4),
    "ws4-hsdp": dict(ws=4, rep=2),
    "ws4-fsdp-tp": dict(ws=4, tp=2),
    "ws2-bf16": dict(ws=2, bf16=True),
    "ws2-ac": dict(ws=2, ac=True),
    "ws4-bf16-ac": dict(ws=4, bf16=True, ac=True),
    "ws2-keep-fwd": dict(ws=2, raf=False),
    "ws1-bf16": dict(ws=1, bf16=True),
}


def model_config(small, tp: int, seq: int):
    """``benchmarks/train_bench.py``'s GPT (``small``: True for its small one, "medium" for the
    tests' size); separate q/k/v with tensor parallelism."""
    from examples.gpt import GPTConfig

    if small == "medium":  # the tests' size: 8.4M parameters, blocks on gloo's direct route
        cfg = GPTConfig(vocab_size=2048, dim=512, n_layers=2, n_heads=8, max_seq_len=seq)
    elif small:
        cfg = GPTConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=seq)
    else:
        cfg = GPTConfig(vocab_size=8192, dim=768, n_layers=12, n_heads=12, max_seq_len=seq)
    cfg.fused_qkv = tp == 1
    return cfg


def plan_config(spec: dict, global_batch: int, seq: int):
    """The planner's ``PlanConfig`` of a validation spec."""
    import torch

    from fsdp2.tools.planner import PlanConfig

    tp, rep = spec.get("tp", 1), spec.get("rep", 1)
    dp = spec["ws"] // tp
    bf16 = spec.get("bf16", False)
    return PlanConfig(
        world_size=spec["ws"],
        tp=tp,
        dp_replicate=rep,
        activation_checkpointing=spec.get("ac", False),
        reshard_after_forward=spec.get("raf", True),
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
        batch_size=global_batch // dp,
    )


def predict(spec: dict, *, small: bool, global_batch: int, seq: int):
    """The planner's ``Estimate`` for ``spec`` (no process group, nothing allocated)."""
    import torch

    from examples.gpt import GPT, tp_plan
    from fsdp2.tools.planner import CPU, estimate, profile_model

    cfg = model_config(small, spec.get("tp", 1), seq)
    with torch.device("meta"):
        model = GPT(cfg)
    profile = profile_model(model, seq_len=seq, tp_plan=tp_plan())
    return estimate(profile, plan_config(spec, global_batch, seq), CPU)


def measure(spec: dict, *, small: bool, global_batch: int, seq: int) -> dict:
    """Run on every rank of an initialized gloo world of ``spec["ws"]`` ranks: one warm-up
    step, then one tracked step; returns this rank's ``{"peak", "categories"}``."""
    import torch
    import torch.distributed as dist

    from device_mesh import init_device_mesh
    from dtensor.debug import CommDebugMode
    from examples.gpt import GPT, gpt_loss, tp_plan
    from fsdp2 import MixedPrecisionPolicy, parallelize_transformer
    from fsdp2.tools.dry_run import mesh_for
    from fsdp2.tools.memory import MemoryTracker

    ws, tp, rep = spec["ws"], spec.get("tp", 1), spec.get("rep", 1)
    if dist.get_world_size() != ws:
        raise ValueError(f"measure: {spec} needs {ws} ranks, got {dist.get_world_size()}.")
    cfg = model_config(small, tp, seq)
    shape, names = mesh_for(ws, tp=tp, dp_replicate=rep)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = GPT(cfg)
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if spec.get("bf16") else None
    parallelize_transformer(
        model,
        mesh,
        tp_plan=tp_plan() if tp > 1 else None,
        activation_checkpointing=spec.get("ac", False),
        mp_policy=mp,
        reshard_after_forward=spec.get("raf", True),
    )
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    dp_rank = dist.get_rank() // tp
    g = torch.Generator().manual_seed(dp_rank)
    per_dp = global_batch // (ws // tp)
    x = torch.randint(0, cfg.vocab_size, (per_dp, seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (per_dp, seq), generator=g)

    def step() -> None:
        gpt_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer state exists from here on, as in every later step
    with CommDebugMode() as comm, MemoryTracker(model, opt) as tracker:
        step()
    counts: dict[str, list[int]] = {}
    for r in comm.records:
        entry = counts.setdefault(f"{r.kind}@{r.mesh_dim}", [0, 0])
        entry[0] += 1
        entry[1] += r.bytes
    return {"peak": tracker.peak, "categories": tracker.by_category("peak"), "comms": counts}


def _comms_match(est, measured) -> str:
    """Whether the step's collectives under ``CommDebugMode`` (count and bytes by kind and
    mesh dim) equal the planner's (``est.collectives``: the ledger's model); the tensor-
    parallel ones are compared only where the planner models them (no checkpointing)."""
    if measured is None:
        return "-"
    got = {tuple(k.split("@")): tuple(v) for k, v in measured.items()}
    cfg = est.config
    modelled_tp = cfg.tp > 1 and not cfg.activation_checkpointing
    got = {k: v for k, v in got.items() if k[1] != "tp" or modelled_tp}
    want = {(kind, str(dim)): tuple(v) for (kind, dim), v in est.collectives.items()}
    if got == want:
        return f"equal ({sum(c for c, _ in want.values())})"
    diff = sorted(set(got.items()) ^ set(want.items()))
    return f"DIFFER: {diff[:4]}"


def _size(args):
    return "medium" if args.medium else args.small


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="a small GPT, for a quick check")
    p.add_argument("--medium", action="store_true", help="the tests' GPT (8.4M parameters)")
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--only", default=None, help="comma-separated config names")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument(
        "--measured",
        default=None,
        help="reuse the measurements of an earlier --json file; only predict again",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        got = measure(
            CONFIGS[args.worker], small=_size(args), global_batch=args.global_batch, seq=args.seq
        )
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()
    os.environ.pop("RANK", None)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    from benchmarks._arms import run_worker

    names = args.only.split(",") if args.only else list(CONFIGS)
    earlier = {}
    if args.measured:
        for r in json.loads(Path(args.measured).read_text()):
            earlier[r["config"]] = {
                "peak": r["measured"],
                "categories": r["measured_categories"],
                "comms": r.get("measured_comms"),
            }
        names = [n for n in names if n in earlier]
    rows = []
    for name in names:
        spec = CONFIGS[name]
        est = predict(spec, small=_size(args), global_batch=args.global_batch, seq=args.seq)
        flags = ["--worker", name, "--global-batch", str(args.global_batch), "--seq", str(args.seq)]
        flags += ["--small"] if args.small else ["--medium"] if args.medium else []
        got = earlier.get(name) or run_worker(__file__, flags, nproc=spec["ws"], what=name)
        rows.append(
            {
                "config": name,
                "layout": est.config.describe(),
                "predicted": est.peak_bytes,
                "measured": got["peak"],
                "phase": est.peak_phase,
                "predicted_categories": est.categories,
                "measured_categories": got["categories"],
                "measured_comms": got.get("comms"),
                "comms_match": _comms_match(est, got.get("comms")),
            }
        )
    mib = 1 << 20
    table = Table(title="memory planner: predicted vs measured peak (rank 0, MiB)")
    for col in ("config", "layout", "predicted", "measured", "error", "planner's peak",
                "collectives"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("config", "layout") else "right")
    for r in rows:
        err = (r["predicted"] - r["measured"]) / r["measured"]
        style = "" if abs(err) <= 0.10 else "red"
        table.add_row(
            r["config"],
            r["layout"],
            f"{r['predicted'] / mib:.1f}",
            f"{r['measured'] / mib:.1f}",
            f"[{style}]{err:+.1%}[/{style}]" if style else f"{err:+.1%}",
            r["phase"],
            r["comms_match"],
        )
    console = Console()
    console.print(table)
    cats = Table(title="by category at each peak (MiB): predicted / measured")
    keys = sorted(
        {k for r in rows for k in (*r["predicted_categories"], *r["measured_categories"])}
    )
    cats.add_column("config")
    for k in keys:
        cats.add_column(k.replace("_", " "), justify="right")
    for r in rows:
        p, m = r["predicted_categories"], r["measured_categories"]
        cats.add_row(
            r["config"], *(f"{p.get(k, 0) / mib:.0f}/{m.get(k, 0) / mib:.0f}" for k in keys)
        )
    console.print(cats)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
