"""Soak: train a small GPT for many steps, checkpointing as it goes, and compare a rank's
resources early in the run with the end: nothing may grow.

``make soak`` runs the full soak (1,000 steps, a checkpoint every 100) at world size 2 with
``fully_shard`` and at world size 4 with FSDP x TP (2 x 2), and prints the figures at step 10
and at the last step; tests/test_soak.py runs a short sample of it (60 steps, a checkpoint
every 20) with the same checks. Each rank measures itself, after ``gc.collect()``:

* live tensor bytes: every distinct CPU storage under a ``torch.Tensor`` the collector can
  see (a DTensor counts through its local tensor), which is what ``dtensor``'s and ``fsdp2``'s
  own tensors are made of (counted here over ``gc``; ``fsdp2.tools``' memory tracker counts
  by category inside a step, but it is a dispatch mode over every op, too heavy for 1,000);
* RSS (``/proc/self/status``), then RSS again after ``malloc_trim(0)`` (glibc's free heap
  handed back: what is left is memory in use; the difference is free memory malloc keeps);
  process groups (``torch.distributed``'s table of them); threads (``/proc/self/task``);
  open files (``/proc/self/fd``);
* Python objects, by type (``gc.get_objects``);
* the library's kept buffers: DTensor's collective workspaces (``dtensor/_workspace.py``),
  fsdp2's buffer pools and page banks (``fsdp2/_comm_context.py``) and the mapped host
  regions alive (``fsdp2/_host_memory.py``).

What is held to 1% is the trimmed RSS, the memory the process uses. Raw RSS also counts the
free heap glibc keeps, which moves either way with where the last free chunks sit (one run:
-1.01% on one rank, +2.38% on the other); it is printed, not judged.

PyTorch's own c10d flight recorder (``TORCH_FR_BUFFER_SIZE``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``,
recording every collective, gloo's included) fills a bounded ring of entries as a run goes:
measured alone, a plain ``dist.all_reduce`` loop grows RSS by about 0.5 KB a call until the
ring is full, and a soak with it on grows the trimmed RSS by 0.8-1.0% between step 10 and
step 1,000 (bounded, not a leak; with it at 0, +0.09% / +0.11%). The library records its
collectives itself (``dtensor.debug``'s flight recorder), so the soak runs its workers with
PyTorch's ring off (``TORCH_FR_BUFFER_SIZE=0`` unless set) to see what repeats.

A run saves a checkpoint after step 1 (with the optimizer's state) and measures itself once
there (``--cold`` skips both): one-time caches then fill before step 10 - the ABCs'
``isinstance`` caches the first save fills (135 objects: weak references and their
callbacks), the first ``dist.barrier``'s objects, the first save's heap high-water mark -
and step 10 compares with step 1,000 on what repeats.

    python -m tests.soak                      # both layouts, 1,000 steps
    python -m tests.soak --steps 200 --every 50 --layouts fsdp
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (world size, description) of each layout
LAYOUTS = {"fsdp": (2, "FSDP, 2 ranks"), "2d": (4, "FSDP x TP, 2 x 2 ranks")}
# counts that must be equal at both points
EXACT = ("process_groups", "threads", "open_files", "workspace_buffers", "pool_buffers")
EXACT += ("page_bank_regions", "host_regions", "pending_reduces")
# figures within 1% of each other
WITHIN_1PCT = ("tensor_bytes", "rss_bytes", "rss_trimmed_bytes")  # printed with a percentage
HELD_TO_1PCT = ("tensor_bytes", "rss_trimmed_bytes")  # judged (module docstring)


# ------------------------------------------------------------------------------ measuring
def live_tensor_bytes(objects) -> int:
    """Bytes of the distinct CPU storages under the tensors among ``objects``."""
    from dtensor import DTensor

    seen: dict[int, int] = {}
    for o in objects:
        if not issubclass(type(o), torch.Tensor) or isinstance(o, DTensor) or o.is_meta:
            continue
        try:
            s = o.untyped_storage()
            ptr = s.data_ptr() if s.device.type == "cpu" else 0
        except (RuntimeError, NotImplementedError):
            # a wrapper subclass without storage, or one whose storage is invalid (e.g. a
            # fake tensor an earlier test in this worker left behind)
            continue
        if ptr:
            seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
    return sum(seen.values())


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _trim() -> None:
    """Hand glibc's free heap memory back to the kernel (``malloc_trim(0)``)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _type_name(o) -> str:
    t = type(o)
    return f"{t.__module__}.{t.__qualname__}"


def _resting_objects() -> list:
    """Every object the collector tracks, taken with the process at rest.

    Two things move the count without anything growing. The collector stops tracking a
    tuple of plain values (numbers, strings) only when a collection looks at it, so tuples
    made since the last collection count and the same tuples a moment later do not; the
    collective watchdog (``dtensor/_flight.py``) makes such tuples whenever it reads a peer's
    changed state, which happens in the second or two after a step's last collective. And
    the watchdog's own work between polls holds a few objects only while it runs (its
    ``Event.wait`` a waiter lock and a bound method, its step a copy of the records). So
    the count is taken right after a full collection, again ~2 ms later and again, until
    three counts agree: that is the resting figure, and the objects returned are the take
    that made it three. (A collection of the youngest generation alone would be faster
    but leaves tracked a dict or tuple that became untrackable after it grew older; one
    such dict failed the fast soak test.)
    """
    seen: collections.Counter = collections.Counter()
    for _ in range(9):
        gc.collect()
        objects = gc.get_objects()
        seen[len(objects)] += 1
        if seen[len(objects)] == 3:
            return objects
        del objects
        time.sleep(0.002)
    gc.collect()
    return gc.get_objects()  # never at rest: the count shows what moved


def snapshot() -> dict:
    """This process's figures now (after a full collection)."""
    from dtensor._workspace import Workspace
    from fsdp2._collectives import BufferPool
    from fsdp2._comm_context import CommContext
    from fsdp2._host_memory import HostRegion, PageBank

    gc.collect()
    rss = _rss()  # before this function's own lists take memory
    _trim()
    rss_trimmed = _rss()
    objects = gc.get_objects()
    tensor_bytes = live_tensor_bytes(objects)
    # counted after: the storage objects that measuring made live on with their storages
    del objects
    objects = _resting_objects()
    by_type = collections.Counter(_type_name(o) for o in objects)
    figures = {
        "tensor_bytes": tensor_bytes,
        "rss_bytes": rss,
        "rss_trimmed_bytes": rss_trimmed,
        "process_groups": len(dist.distributed_c10d._world.pg_map),
        "threads": len(os.listdir("/proc/self/task")),
        "open_files": len(os.listdir("/proc/self/fd")),
        "objects": len(objects),
        "workspace_buffers": sum(len(o._buffers) for o in objects if type(o) is Workspace),
        "pool_buffers": sum(len(o._free) for o in objects if type(o) is BufferPool),
        "page_bank_regions": sum(len(o._held) for o in objects if type(o) is PageBank),
        "host_regions": sum(1 for o in objects if type(o) is HostRegion),
        "pending_reduces": sum(len(o.pending) for o in objects if type(o) is CommContext),
        "by_type": dict(by_type),
    }
    del objects
    return figures


# ------------------------------------------------------------------------------- training
def _build(layout: str, dim: int, layers: int, seq: int):
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=256, dim=dim, n_layers=layers, n_heads=4, max_seq_len=seq,
        fused_qkv=layout == "fsdp",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    if layout == "fsdp":
        from fsdp2 import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        from device_mesh import init_device_mesh
        from examples.gpt import tp_plan
        from fsdp2 import parallelize_transformer

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_transformer(model, mesh, tp_plan=tp_plan())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    return model


def soak_rank(
    directory: str,
    layout: str,
    steps: int,
    every: int,
    early: int = 10,
    also: tuple = (),
    warm: bool = True,
    dim: int = 192,
    layers: int = 2,
    seq: int = 64,
    batch: int = 4,
) -> None:
    """Train ``steps`` steps with a checkpoint every ``every``; measure after step ``early``
    and after the last one (each after that step's checkpoint, if it has one). Each rank
    writes its figures to ``directory/rank-R.json``. Runs on an initialized default group.
    """
    from dtensor import checkpoint as dcp
    from examples.gpt import gpt_loss
    from examples.train_gpt import samples_at

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = _build(layout, dim, layers, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = torch.frombuffer(bytearray((ROOT / "README.md").read_bytes()), dtype=torch.uint8)
    dp_rank, dp_size = (rank, ws) if layout == "fsdp" else (rank // 2, ws // 2)
    root = Path(directory) / "ckpt"
    points, losses = {}, {}

    def save(done: int) -> None:
        state = {
            "model": dcp.get_model_state_dict(model),
            "optim": dcp.get_optimizer_state_dict(model, opt),
            "step": done,
        }
        dcp.save(state, checkpoint_id=root / f"step-{done:06d}")
        if rank == 0:  # keep the newest two
            for old in sorted(root.glob("step-*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)

    for step in range(steps):
        first = (step * dp_size + dp_rank) * batch
        x, y = samples_at(data, seq, 7, first, batch)
        loss = gpt_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        done = step + 1
        if done % every == 0:
            save(done)
        elif warm and done == 1:  # one-time caches fill before the first measurement
            save(done)  # (module docstring): after a step, so with the optimizer's state
            snapshot()
            dist.barrier()
        if done in (early, steps, *also):
            losses[done] = loss.detach().item()
            del loss, x, y
            points[done] = json.dumps(snapshot())  # a str: no object the collector tracks
            dist.barrier()  # every rank measured before any goes on
    points = {k: json.loads(v) for k, v in points.items()}
    out = {"rank": rank, "layout": layout, "steps": steps, "losses": losses, "points": points}
    Path(directory, f"rank-{rank}.json").write_text(json.dumps(out))


# ------------------------------------------------------------------------------- checking
def problems(result: dict, early: int, last: int, rss: bool = True) -> list[str]:
    """What grew between the two points on one rank (empty: nothing did); ``rss=False``
    leaves the trimmed RSS out (see tests/test_soak.py)."""
    a, b = result["points"][str(early)], result["points"][str(last)]
    out = [f"{k}: {a[k]} -> {b[k]}" for k in EXACT if a[k] != b[k]]
    for k in HELD_TO_1PCT if rss else ("tensor_bytes",):
        if abs(b[k] - a[k]) > 0.01 * a[k]:
            out.append(f"{k}: {a[k]:,} -> {b[k]:,} ({100 * (b[k] - a[k]) / a[k]:+.2f}%)")
    if b["objects"] > a["objects"]:
        grown = ", ".join(f"{n} +{d}" for n, d in top_growth(a, b))
        out.append(f"objects: {a['objects']:,} -> {b['objects']:,} ({grown})")
    return out


def top_growth(a: dict, b: dict, n: int = 5) -> list[tuple[str, int]]:
    """The ``n`` types whose object counts grew most from ``a`` to ``b``."""
    ta, tb = a["by_type"], b["by_type"]
    grown = [(k, tb[k] - ta.get(k, 0)) for k in tb if tb[k] > ta.get(k, 0)]
    return sorted(grown, key=lambda kv: -kv[1])[:n]


def read_results(directory: Path, world_size: int) -> list[dict]:
    return [json.loads((directory / f"rank-{r}.json").read_text()) for r in range(world_size)]


def run(
    layout: str,
    steps: int,
    every: int,
    early: int = 10,
    also: tuple = (),
    warm: bool = True,
    directory: Path | None = None,
    **model,
):
    """Run one soak on new workers of a harness pool; returns every rank's result.
    ``model``: ``dim``, ``layers``, ``seq``, ``batch`` of ``soak_rank``.

    New workers, because a soak measures what one program holds: in ``make test``'s pool an
    earlier test's PyTorch FSDP2 model (test_comm_ledger's comparison arm, kept alive through
    autograd nodes and hooks the collector cannot see into) was freed in the middle of the
    fast soak, which read it as its own change (live tensor bytes -15% on one rank)."""
    from tests.harness import fresh_pool, run_on_ranks

    world_size = LAYOUTS[layout][0]
    fresh_pool(world_size)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        run_on_ranks(
            world_size,
            soak_rank,
            timeout_s=max(300.0, steps * 3.0),  # a loaded machine: about 0.1 s a step alone
            directory=d,
            layout=layout,
            steps=steps,
            every=every,
            early=early,
            also=tuple(also),
            warm=warm,
            **model,
        )
        return read_results(Path(d), world_size)


def table(layout: str, results: list[dict], early: int, last: int):
    from rich.table import Table

    t = Table(title=f"soak: {LAYOUTS[layout][1]}, step {early} vs step {last}")
    for col in ("rank", "figure", f"step {early}", f"step {last}", "change"):
        t.add_column(col, justify="right" if col != "figure" else "left")
    for r in results:
        a, b = r["points"][str(early)], r["points"][str(last)]
        for k in (*WITHIN_1PCT, "objects", *EXACT):
            change = b[k] - a[k]
            pct = f" ({100 * change / a[k]:+.2f}%)" if k in WITHIN_1PCT and a[k] else ""
            t.add_row(str(r["rank"]), k, f"{a[k]:,}", f"{b[k]:,}", f"{change:+,}{pct}")
        grown = ", ".join(f"{n.rsplit('.', 1)[-1]} +{d}" for n, d in top_growth(a, b)) or "none"
        t.add_row(str(r["rank"]), "top object growth", "", "", grown)
        t.add_row(str(r["rank"]), "loss", f"{r['losses'][str(early)]:.4f}", "", "")
        t.add_row(str(r["rank"]), "", "", f"{r['losses'][str(last)]:.4f}", "", end_section=True)
    return t


def main(argv=None) -> int:
    from rich.console import Console

    from tests import harness

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--early", type=int, default=10, help="the step compared with the last")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--also", nargs="*", type=int, default=[], help="more steps to measure")
    p.add_argument("--cold", action="store_true", help="no checkpoint at step 0 (module docstring)")
    args = p.parse_args(argv)
    # PyTorch's c10d flight recorder off in the workers (module docstring); before they start
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # end the workers on the way out
    console = Console()
    failed = False
    try:
        for layout in args.layouts:
            results = run(layout, args.steps, args.every, args.early, args.also, not args.cold)
            console.print(table(layout, results, args.early, args.steps))
            for a in args.also:
                console.print(table(layout, results[:1], args.early, a))
            for r in results:
                for line in problems(r, args.early, args.steps):
                    failed = True
                    console.print(f"[red]rank {r['rank']} ({layout}): {line}[/]")
    finally:
        harness.shutdown_all()
    console.print("[red]growth found[/]" if failed else "[green]nothing grew[/]")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
