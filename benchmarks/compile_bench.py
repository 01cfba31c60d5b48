"""Step time of compiled vs eager FSDP: ours and torch's FSDP2, world size 2, in one run.

    python benchmarks/compile_bench.py            # the ~100M benchmark GPT (as train_bench.py)
    python benchmarks/compile_bench.py --small    # a quick smoke run

Four arms, each its own ``torchrun`` job with one torch thread per rank and the same global
batch: our ``fully_shard`` eager and with every block compiled by ``torch.compile``
(inductor) before ``fully_shard``, and torch's FSDP2 the same two ways. Step time is the
median of the timed steps (forward + backward + AdamW), after warm-up steps that include
the compilation. Results: a rich table and ``bench_results/compile.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.train_bench import run_arm  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a small model, for a quick check")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation included)")
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)
    args.device, args.size, args.bf16, args.layers = "cpu", "100m", False, None
    return args


def main() -> None:
    args = parse_args()
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    plan = [("ours", False), ("ours", True), ("torch_fsdp", False), ("torch_fsdp", True)]
    results = {}
    console = Console()
    with Progress(console=console) as progress:
        task = progress.add_task("arms", total=len(plan))
        for arm, compiled in plan:
            progress.update(task, description=f"{arm} {'compiled' if compiled else 'eager'}")
            args.compile = compiled
            results[(arm, compiled)] = run_arm(arm, 2, args)
            progress.advance(task)
    params = results[("ours", False)]["params"]
    table = Table(title=f"GPT {params / 1e6:.1f}M params, world size 2, global batch "
                  f"{args.global_batch}x{args.seq}, median of {args.steps} steps")  # fmt: skip
    for col in ("arm", "mode", "step (s)", "compiled vs eager", "vs torch FSDP2 same mode",
                "peak RSS (MB)"):  # fmt: skip
        table.add_column(col, justify="right")
    for (arm, compiled), r in results.items():
        eager = results[(arm, False)]["step_s"]
        torch_same = results[("torch_fsdp", compiled)]["step_s"]
        table.add_row(
            arm, "compiled" if compiled else "eager", f"{r['step_s']:.3f}",
            f"{r['step_s'] / eager:.2f}x" if compiled else "-",
            f"{r['step_s'] / torch_same:.2f}x", f"{r['peak_rss_mb']:.0f}",
        )  # fmt: skip
    console.print(table)
    out = ROOT / "bench_results" / "compile.json"
    out.parent.mkdir(exist_ok=True)
    rows = [{**r, "compiled": compiled} for (_, compiled), r in results.items()]
    out.write_text(json.dumps(rows, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
