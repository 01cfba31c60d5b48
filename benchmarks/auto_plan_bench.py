"""``auto_parallelize``'s choice against the layouts its search considered, run for real.

    python benchmarks/auto_plan_bench.py                       # both cases (a few minutes)
    python benchmarks/auto_plan_bench.py --cases ac-some --top 4 --steps 4 --json out.json

For each case the parent profiles a GPT on meta and runs the layout search once at world
size 2 on the ``CPU`` hardware preset (``fsdp2.tools.search.search_layouts``, as
``auto_parallelize`` does, default margin), with a memory budget derived from the planner's
own predictions:

* ``ac-some``: activations dominate and the budget is what a layout with some of its
  blocks checkpointed needs (tensor parallelism left out), so the search must checkpoint
  some blocks but not all;
* ``tp-vs-fsdp``: the budget is just under what FSDP alone needs without checkpointing
  (every tensor-parallel degree allowed), so FSDP needs checkpointing where tensor
  parallelism of degree 2 does not: the search weighs TP's collectives against FSDP's
  recomputation (on this CPU TP's many small collectives cost more: 2.2 ms each).

Then the chosen layout and up to ``--top`` of the other layouts that fit (distinct configs;
at least one of each other kind when there is one: another tensor-parallel degree, another
number of checkpointed blocks, keeping the last group gathered, keeping every group, another
grouping) each run as a real job: two processes on gloo, one torch thread each. A rank
builds the model on meta, applies the plan (``AutoPlan.from_estimate(...).apply(model,
mesh)`` on ``init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)``),
materializes it (``reset_parameters`` under one seed), trains with AdamW: 2 warm-up steps,
``--steps`` timed steps (forward, backward, ``opt.step()``, ``zero_grad()``; a barrier
before each; rank 0's median), then one more step under ``fsdp2.tools.MemoryTracker``
(rank 0's peak of live tensor bytes).

Resident set: before the baseline the rank runs one step of a tiny plain GPT (so the
library code a step runs is paged in: the growth is training's memory, not shared
libraries' code), collects garbage and trims the heap (``malloc_trim``: memory freed
earlier cannot hide the growth); then, right before the model is built, it writes ``5`` to
``/proc/self/clear_refs`` (Linux: the peak RSS, ``VmHWM``, reset to the current RSS) and
reads ``VmRSS`` (the baseline: torch imported, the process group and the mesh up, the
batch made). After the timed steps (before the tracked step, whose bookkeeping is not
training's) it reads ``VmHWM``: the peak above the baseline covers materializing, the
warm-up (the first optimizer step allocates the state) and the timed steps. The larger of
the two ranks is reported. Where ``clear_refs`` cannot be written it falls back to
``ru_maxrss`` (a lifetime peak: an over-estimate) and says so.

The machine is shared: every layout runs ``--rounds`` times (2), the rounds interleaved
(all layouts, then all again), and its smallest median counts. Each run also measures how
much of the machine other processes used while its steps were timed (``/proc/stat``'s busy
time less the two ranks' CPU time); a layout whose every run saw more than 15% is run again
(up to ``--extra`` times, interleaved, while ``--time-limit`` allows). The table gives the
counted run's median CPU time of rank 0 too, which other processes change least (an
information line compares it; not a verdict). Memory columns: the larger over the runs.
Verdicts: the search's decision is the case's; the chosen layout's measured step within
10% of the fastest measured layout; its tracker peak <= budget; its RSS above baseline <=
budget. Exit code 1 when one fails. ``--json FILE`` saves everything (every step time,
the RSS after every step, the contention of every run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
WORLD = 2
TOLERANCE = 0.10  # the chosen layout's step may be this much slower than the fastest
CONTENDED = 0.15  # a run during which other processes used more of the machine is rerun

# name: the GPT, the global batch and sequence, how the budget is derived, tp degrees allowed
CASES = {
    "ac-some": dict(
        model=dict(
            vocab_size=509, dim=192, n_layers=6, n_heads=4, max_seq_len=256, fused_qkv=False
        ),  # fmt: skip
        batch=4,
        seq=256,
        tp_degrees=(1,),
        # the budget: what plain FSDP with the first `ac_blocks` blocks checkpointed needs
        budget=dict(kind="ac", ac_blocks=2),
        what="activations dominate; the budget fits FSDP with 2 of 6 blocks checkpointed",
    ),
    "tp-vs-fsdp": dict(
        model=dict(
            vocab_size=509, dim=256, n_layers=4, n_heads=4, max_seq_len=256, fused_qkv=False
        ),  # fmt: skip
        batch=4,
        seq=256,
        tp_degrees=None,
        # the budget: 2% under what plain FSDP needs without checkpointing (with the margin)
        budget=dict(kind="fsdp-no-ac", under=0.02),
        what="the budget is 2% under FSDP alone without checkpointing, so FSDP must recompute "
        "where TP 2 need not; every tp degree",
    ),
}


def decision_holds(case: str, result, n_blocks: int) -> tuple[bool, str]:
    """Whether the search's choice is what the case is about, and why (a line)."""
    cfg = result.best.config
    n_ac = len(cfg.checkpointed(n_blocks))
    if case == "ac-some":
        ok = cfg.tp == 1 and 1 <= n_ac < n_blocks
        return ok, f"{n_ac} of {n_blocks} blocks checkpointed (some, not all?)"
    if case == "tp-vs-fsdp":
        # the question: TP's collectives against FSDP's recomputation; the step verdict says
        # whether the search weighed them as this machine does
        fsdp = [e for e in result.fits if e.config.tp == 1]
        needs_ac = bool(fsdp) and all(e.config.checkpointed(n_blocks) for e in fsdp)
        tp_free = [
            e for e in result.fits if e.config.tp == 2 and not e.config.checkpointed(n_blocks)
        ]
        ok = needs_ac and bool(tp_free)
        return ok, (
            f"TP 2 without checkpointing fits: {bool(tp_free)}; the {len(fsdp)} FSDP-alone "
            f"layouts that fit all checkpoint: {needs_ac}; chosen tp {cfg.tp} with {n_ac} "
            "checkpointed blocks"
        )
    return True, ""


# ------------------------------------------------------------------------------ the model
def build_meta_model(model_cfg: dict):
    import torch

    from examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**model_cfg))


def profile_of(model_cfg: dict, seq: int):
    """The planner's profile of the GPT ``model_cfg`` (on meta), with ``tp_plan_for``'s
    plan, as ``auto_parallelize`` profiles it."""
    from fsdp2.plan import tp_plan_for
    from fsdp2.tools.planner import profile_model

    model = build_meta_model(model_cfg)
    return profile_model(model, seq_len=seq, tp_plan=tp_plan_for(model))


def config_to_dict(cfg) -> dict:
    d = asdict(cfg)
    for k in ("param_dtype", "reduce_dtype"):
        d[k] = None if d[k] is None else str(d[k]).removeprefix("torch.")
    if d["checkpointed_blocks"] is not None:
        d["checkpointed_blocks"] = list(d["checkpointed_blocks"])
    return d


def config_from_dict(d: dict):
    import torch

    from fsdp2.tools.planner import PlanConfig

    d = dict(d)
    for k in ("param_dtype", "reduce_dtype"):
        d[k] = None if d[k] is None else getattr(torch, d[k])
    if d["checkpointed_blocks"] is not None:
        d["checkpointed_blocks"] = tuple(d["checkpointed_blocks"])
    return PlanConfig(**d)


# ------------------------------------------------------------------------------ the search
def derive_budget(spec: dict, profile) -> int:
    """The case's budget in bytes, from the planner's predictions and the default margin."""
    from fsdp2.tools.planner import CPU, PlanConfig, peak_bytes
    from fsdp2.tools.search import default_margin

    margin = default_margin(CPU)
    plain = PlanConfig(world_size=WORLD, batch_size=spec["batch"] // WORLD, checkpointed_blocks=())
    how = spec["budget"]
    if how["kind"] == "ac":
        cfg = replace(plain, checkpointed_blocks=tuple(range(how["ac_blocks"])))
        return math.ceil(peak_bytes(profile, cfg, CPU) * (1 + margin))
    if how["kind"] == "fsdp-no-ac":
        return math.floor(peak_bytes(profile, plain, CPU) * (1 + margin) * (1 - how["under"]))
    raise ValueError(f"unknown budget kind {how['kind']!r}")


def search_case(spec: dict, profile, budget: int):
    """``search_layouts`` as ``auto_parallelize`` calls it for a world of 2 ranks on CPU
    (``tp_degrees=(1,)`` is what a mesh without a tp dim gives it)."""
    from fsdp2.tools.planner import CPU
    from fsdp2.tools.search import search_layouts

    tps = spec["tp_degrees"]
    return search_layouts(
        profile,
        WORLD,
        budget,
        hardware=CPU,
        global_batch=spec["batch"],
        tp_degrees=tps,
        replicate_degrees=(1,) if tps else None,
    )


def _kinds(cfg, n_blocks: int) -> dict:
    return {
        "tp": cfg.tp,
        "checkpointed": len(cfg.checkpointed(n_blocks)),
        "keep-last": cfg.reshard_after_forward and cfg.keep_last_groups > 0,
        "keep-fwd": not cfg.reshard_after_forward,
        "grouping": cfg.blocks_per_group,
        "replicas": cfg.dp_replicate,
    }


def select_layouts(result, n_blocks: int, top: int) -> list:
    """The chosen layout, then one fitting layout of each other kind (the fastest
    predicted), then the fastest others, ``top`` in all."""
    fits = list(result.fits)
    chosen = result.best
    picked = [chosen]
    mine = _kinds(chosen.config, n_blocks)
    for kind in ("tp", "checkpointed", "keep-last", "keep-fwd", "grouping", "replicas"):
        for e in fits:
            if len(picked) >= top:
                break
            if _kinds(e.config, n_blocks)[kind] != mine[kind]:
                if all(p.config != e.config for p in picked):
                    picked.append(e)
                break
    for e in fits:
        if len(picked) >= top:
            break
        if all(p.config != e.config for p in picked):
            picked.append(e)
    return picked


# ------------------------------------------------------------------------------ a worker
def _status() -> dict:
    """``/proc/self/status``'s memory lines in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _trim_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc's ``malloc_trim``), so the growth
    measured from the baseline is not hidden by memory freed before it."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _machine_busy() -> float:
    """CPU seconds every core of the machine has been busy so far (``/proc/stat``: all but
    idle and iowait; steal included: another guest had the core)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _n_cpus() -> int:
    with open("/proc/stat") as f:
        return sum(1 for line in f if line.startswith("cpu") and line[3].isdigit())


def _peak_rss() -> int:
    import resource

    return max(_status()["VmHWM"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _page_in_kernels(torch) -> None:
    """One step of a tiny plain GPT with AdamW, so the library code a training step runs
    (matmuls, attention, the loss, the optimizer) is paged in before the baseline: the
    resident set then grows by what training holds, not by shared libraries' code."""
    from examples.gpt import GPT, GPTConfig, gpt_loss

    model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=16,
                          fused_qkv=False))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 64, (2, 16))
    gpt_loss(model, idx, idx).backward()
    opt.step()
    opt.zero_grad()


def worker(job: dict, rank: int, port: int) -> None:
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        out = _train(job, rank, gc, torch, dist)
        Path(job["out"] + f".{rank}").write_text(json.dumps(out))
        dist.barrier()  # both done before the group goes
    finally:
        dist.destroy_process_group()


def _train(job, rank, gc, torch, dist) -> dict:
    from device_mesh import init_device_mesh
    from examples.gpt import gpt_loss
    from fsdp2.auto import AutoPlan
    from fsdp2.tools import MemoryTracker
    from fsdp2.tools.planner import CPU, estimate

    profile = profile_of(job["model"], job["seq"])
    est = estimate(profile, config_from_dict(job["config"]), CPU)
    plan = AutoPlan.from_estimate(est, profile, budget=job["budget"], margin=job["margin"])
    if plan.config.describe() != job["describe"] or plan.predicted_peak != job["predicted"]:
        raise RuntimeError(f"the worker's plan is not the parent's: {plan.config.describe()}")
    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    del profile, est
    # the data of this rank's data-parallel coordinate (a tp group feeds the same rows)
    dp_rank = rank // plan.tp
    g = torch.Generator().manual_seed(1000 + dp_rank)
    vocab = job["model"]["vocab_size"]
    x = torch.randint(0, vocab, (plan.batch_size, job["seq"]), generator=g)
    y = torch.randint(0, vocab, (plan.batch_size, job["seq"]), generator=g)
    _page_in_kernels(torch)
    gc.collect()
    _trim_heap()
    dist.barrier()
    reset = _reset_peak_rss()
    base = _status()
    trace = []  # (what, peak RSS above the baseline, RSS above it) after each stage

    def mark(what: str) -> None:
        now = _status()
        trace.append((what, now["VmHWM"] - base["VmRSS"], now["VmRSS"] - base["VmRSS"]))

    model = build_meta_model(job["model"])
    plan.apply(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    mark("materialized")

    def step() -> None:
        gpt_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()

    times, cpu = [], []
    for i in range(job["warmup"] + job["steps"]):
        if i == job["warmup"]:  # the timed window opens: what the machine does meanwhile
            stat0, w0, p0 = _machine_busy(), time.perf_counter(), time.process_time()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        mark(f"step {i + 1}")
    busy = _machine_busy() - stat0
    window, own = time.perf_counter() - w0, time.process_time() - p0
    peak_rss = _peak_rss()
    end = _status()
    with MemoryTracker(model, opt) as tracker:
        step()
    return {
        "rank": rank,
        "times": times[job["warmup"] :],
        "cpu_times": cpu[job["warmup"] :],
        "window": {"wall_s": window, "own_cpu_s": own, "machine_busy_s": busy},
        "rss_trace": trace,
        "median_s": statistics.median(times[job["warmup"] :]),
        "tracker_peak": int(tracker.peak),
        "tracker_categories": tracker.by_category("peak"),
        "rss_above_baseline": peak_rss - base["VmRSS"],
        "rss_method": "clear_refs" if reset else "ru_maxrss (lifetime peak: an over-estimate)",
        "baseline_status": base,
        "end_status": end,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobFailed(RuntimeError):
    """A run's workers failed before both wrote their results."""


def run_job(job: dict, timeout: float = 300.0) -> tuple[list[dict], list[int]]:
    """Two worker processes for ``job``: their results (rank order) and exit codes. When one
    fails, the other gets a few seconds, then both are ended by their pids (and at the
    deadline). Results both ranks wrote count even if a rank failed after (at teardown);
    else ``JobFailed`` with the output's tails."""
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(job, out=str(Path(tmp) / "result"))
        spec_path = Path(tmp) / "job.json"
        spec_path.write_text(json.dumps(job))
        port = _free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=str(ROOT))  # fmt: skip
        logs = [open(Path(tmp) / f"log{r}", "w+") for r in range(WORLD)]  # noqa: SIM115
        cmd = [sys.executable, __file__, "--worker", str(spec_path), "--port", str(port)]
        procs = [
            subprocess.Popen(
                [*cmd, "--rank", str(r)],
                stdout=logs[r],
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )  # fmt: skip
            for r in range(WORLD)
        ]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    deadline = min(deadline, time.monotonic() + 5.0)
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
            codes = [p.returncode for p in procs]
            tails = []
            for r, log in enumerate(logs):
                log.seek(0)
                tails.append(f"--- rank {r} (exit {codes[r]}) ---\n{log.read()[-3000:]}")
                log.close()
        outs = [Path(job["out"] + f".{r}") for r in range(WORLD)]
        if not all(o.exists() for o in outs):
            raise JobFailed("\n".join(tails))
        return [json.loads(o.read_text()) for o in outs], codes


# ------------------------------------------------------------------------------ the parent
def plan_case(case: str, spec: dict, top: int) -> dict:
    profile = profile_of(spec["model"], spec["seq"])
    budget = derive_budget(spec, profile)
    result = search_case(spec, profile, budget)
    picked = select_layouts(result, profile.n_blocks, top)
    decision, why = decision_holds(case, result, profile.n_blocks)
    return {
        "case": case,
        "decision": decision,
        "decision_why": why,
        "what": spec["what"],
        "model": spec["model"],
        "batch": spec["batch"],
        "seq": spec["seq"],
        "budget": budget,
        "margin": result.margin,
        "considered": len(result.considered),
        "fit": len(result.fits),
        "chosen": result.best.config.describe(),
        "layouts": [
            {
                "describe": e.config.describe(),
                "config": config_to_dict(e.config),
                "predicted_step_s": e.step_s,
                "predicted_compute_s": e.compute_s,
                "predicted_comm_s": e.comm_s,
                "predicted_peak": int(e.peak_bytes),
                "chosen": e.config == result.best.config,
                "runs": [],
            }
            for e in picked
        ],
    }


def run_layout(plan: dict, row: dict, steps: int, log, what: str) -> None:
    """One real run of ``row``'s layout; its results appended to ``row["runs"]``."""
    t0 = time.monotonic()
    job = {
        "case": plan["case"],
        "model": plan["model"],
        "seq": plan["seq"],
        "config": row["config"],
        "describe": row["describe"],
        "predicted": row["predicted_peak"],
        "budget": plan["budget"],
        "margin": plan["margin"],
        "steps": steps,
        "warmup": 2,
    }
    try:
        ranks, codes = run_job(job)
    except JobFailed as e:  # once more, on a fresh port, before giving up
        log(f"  {plan['case']}: {row['describe']} failed; once more. Its output:\n{e}")
        try:
            ranks, codes = run_job(job)
        except JobFailed as e2:
            raise SystemExit(
                f"layout {row['describe']!r} of {plan['case']} failed:\n{e2}"
            ) from None
    if any(codes):
        log(f"  {plan['case']}: {row['describe']}: both ranks wrote results, exit codes {codes}")
    w = ranks[0]["window"]
    own = sum(r["window"]["own_cpu_s"] for r in ranks)
    # the share of the machine other processes used while the steps were timed
    others = max(w["machine_busy_s"] - own, 0.0) / (_n_cpus() * w["wall_s"])
    row["runs"].append(
        {
            "median_s": ranks[0]["median_s"],
            "others": others,
            "times": [r["times"] for r in ranks],
            "cpu_times": [r["cpu_times"] for r in ranks],
            "window": [r["window"] for r in ranks],
            "rss_trace": [r["rss_trace"] for r in ranks],
            "tracker_peak": ranks[0]["tracker_peak"],
            "tracker_categories": ranks[0]["tracker_categories"],
            "rss_above_baseline": [r["rss_above_baseline"] for r in ranks],
            "rss_method": ranks[0]["rss_method"],
            "status": [{"baseline": r["baseline_status"], "end": r["end_status"]} for r in ranks],
            "exit_codes": codes,
        }
    )
    log(
        f"  {plan['case']} {what}: {row['describe']:<30} {ranks[0]['median_s']:.3f} s/step, "
        f"other processes {others:.0%} of the machine  ({time.monotonic() - t0:.0f} s)"
    )


def rerun_contended(plans: list, args, start: float, log) -> None:
    """Run again, interleaved, the layouts whose every run shared the machine with other
    processes (more than ``CONTENDED`` of it), up to ``args.extra`` times each, while the
    time limit allows."""
    per_run = (time.monotonic() - start) / max(sum(len(p["layouts"]) for p in plans), 1)
    per_run /= max(args.rounds, 1)
    for extra in range(args.extra):
        todo = [
            (plan, row)
            for plan in plans
            for row in plan["layouts"]
            if min(r["others"] for r in row["runs"]) > CONTENDED
        ]
        for plan, row in todo:
            if time.monotonic() - start + 1.5 * per_run > args.time_limit:
                log(f"  (time limit: {row['describe']} of {plan['case']} not run again)")
                return
            run_layout(plan, row, args.steps, log, f"contended, again ({extra + 1})")


def best_run(row: dict) -> dict:
    return min(row["runs"], key=lambda r: r["median_s"])


def summarize_case(plan: dict) -> None:
    """The table's numbers: the smallest median step of a layout's runs (and that run's CPU
    time and contention), the largest memory; the verdicts."""
    for row in plan["layouts"]:
        run = best_run(row)
        row["measured_step_s"] = run["median_s"]
        row["cpu_step_s"] = statistics.median(run["cpu_times"][0])
        row["others"] = run["others"]
        row["tracker_peak"] = max(r["tracker_peak"] for r in row["runs"])
        row["rss_above_baseline"] = max(max(r["rss_above_baseline"]) for r in row["runs"])
    best = min(row["measured_step_s"] for row in plan["layouts"])
    best_cpu = min(row["cpu_step_s"] for row in plan["layouts"])
    for row in plan["layouts"]:
        row["ratio_to_best"] = row["measured_step_s"] / best
        row["cpu_ratio_to_best"] = row["cpu_step_s"] / best_cpu
    chosen = next(row for row in plan["layouts"] if row["chosen"])
    # not a verdict (the wall clock is the step time): CPU time is what other processes on
    # the machine change least, so it tells a slow layout from an unlucky run
    plan["cpu_within_10pct"] = chosen["cpu_ratio_to_best"] <= 1 + TOLERANCE
    plan["verdicts"] = {
        "decision_is_the_cases": plan["decision"],
        "step_within_10pct": chosen["ratio_to_best"] <= 1 + TOLERANCE,
        "tracker_within_budget": chosen["tracker_peak"] <= plan["budget"],
        "rss_within_budget": chosen["rss_above_baseline"] <= plan["budget"],
    }


def render(plan: dict, console) -> None:
    from rich.table import Table

    m = plan["model"]
    title = (
        f"{plan['case']}: GPT dim {m['dim']}, {m['n_layers']} blocks, global batch "
        f"{plan['batch']} x {plan['seq']} tokens, 2 ranks (gloo); budget "
        f"{plan['budget'] / MiB:.1f} MiB, margin {plan['margin']:.0%}; "
        f"{plan['fit']} of {plan['considered']} considered layouts fit, "
        f"{len(plan['layouts'])} run"
    )
    table = Table(title=title)
    cols = ("layout", "predicted step s", "measured step s", "/ best", "CPU s (rank 0)",
            "others' CPU",
            "predicted peak MiB", "tracker peak MiB", "RSS above base MiB", "budget MiB",
            "chosen")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c == "layout" else "right")
    for row in plan["layouts"]:
        table.add_row(
            row["describe"],
            f"{row['predicted_step_s']:.3f}",
            f"{row['measured_step_s']:.3f}",
            f"{row['ratio_to_best']:.2f}",
            f"{row['cpu_step_s']:.3f}",
            f"{row['others']:.0%}",
            f"{row['predicted_peak'] / MiB:.1f}",
            f"{row['tracker_peak'] / MiB:.1f}",
            f"{row['rss_above_baseline'] / MiB:.1f}",
            f"{plan['budget'] / MiB:.1f}",
            "<- chosen" if row["chosen"] else "",
        )
    console.print(table)
    chosen = next(row for row in plan["layouts"] if row["chosen"])
    v = plan["verdicts"]
    budget = plan["budget"] / MiB

    def mark(ok: bool) -> str:
        return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"

    ratios = [row["rss_above_baseline"] / row["tracker_peak"] for row in plan["layouts"]]
    console.print(f"{mark(v['decision_is_the_cases'])} the decision: {plan['decision_why']}")
    console.print(
        f"{mark(v['step_within_10pct'])} chosen ({chosen['describe']}) step "
        f"{chosen['measured_step_s']:.3f} s is {chosen['ratio_to_best']:.2f}x the measured "
        f"best (within {TOLERANCE:.0%}?)"
    )
    cpu_ok = "yes" if plan["cpu_within_10pct"] else "no"
    console.print(
        f"  (info) its CPU time {chosen['cpu_step_s']:.3f} s is {chosen['cpu_ratio_to_best']:.2f}x "
        f"the smallest of the layouts run (within {TOLERANCE:.0%}: {cpu_ok})"
    )
    console.print(
        f"{mark(v['tracker_within_budget'])} tracker peak {chosen['tracker_peak'] / MiB:.1f} "
        f"MiB <= budget {budget:.1f} MiB"
    )
    console.print(
        f"{mark(v['rss_within_budget'])} RSS above baseline "
        f"{chosen['rss_above_baseline'] / MiB:.1f} MiB <= budget {budget:.1f} MiB"
        f"  (RSS / tracker peak over the layouts run: {min(ratios):.2f}-{max(ratios):.2f})"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--top", type=int, default=6, help="layouts run per case, the chosen included")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved runs of every layout")
    p.add_argument(
        "--extra", type=int, default=2, help="more runs of a layout whose runs were contended"
    )
    p.add_argument(
        "--time-limit", type=float, default=450.0, help="no extra runs past this many seconds"
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()), args.rank, args.port)
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    start = time.monotonic()
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    plans = []
    for case in cases:
        plan = plan_case(case, CASES[case], args.top)
        console.print(
            f"{case}: searched {plan['considered']} layouts, {plan['fit']} fit; chosen "
            f"{plan['chosen']}; running {len(plan['layouts'])} x {args.rounds}"
        )
        for rnd in range(args.rounds):  # interleaved: every layout, then every layout again
            for row in plan["layouts"]:
                run_layout(plan, row, args.steps, console.print, f"round {rnd + 1}")
        plans.append(plan)
    rerun_contended(plans, args, start, console.print)
    for plan in plans:
        summarize_case(plan)
        render(plan, console)
    elapsed = time.monotonic() - start
    method = plans[0]["layouts"][0]["runs"][0]["rss_method"] if plans else ""
    console.print(
        f"step time: rank 0's median of {args.steps} timed steps (after 2 warm-up), the "
        f"smallest over {args.rounds} interleaved runs of each layout (and up to {args.extra} "
        f"more where other processes took over {CONTENDED:.0%} of the machine); CPU s: that "
        f"run's median process CPU time. Memory: the larger over the runs; RSS: peak above "
        f"the pre-model baseline, larger rank, via {method}. {elapsed:.0f} s in all"
    )
    ok = all(all(p["verdicts"].values()) for p in plans)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cases": plans,
                    "elapsed_s": elapsed,
                    "ok": ok,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "extra": args.extra,
                },
                indent=1,
            )  # fmt: skip
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
