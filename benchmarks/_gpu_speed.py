"""The GPU check's parts 2-4 (``benchmarks/gpu_check.py``): speed, dispatch, the planner.

Each runs in its own process at world size 1 (a one-rank process group on a ``HashStore``:
NCCL on the GPU, gloo on the CPU) and returns a dict for the report. Part 2 writes what it
has measured after every arm, so an arm that runs over the budget keeps the ones before it.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

#: in the order they run: compilation last, so that its fixed cost running over the budget
#: leaves the other modes measured
MODES = ("eager", "ac", "offload", "compiled")
LIBS = ("ours", "torch")
GiB = 2**30


def init_world(device: str) -> None:
    """A one-rank process group for this process (NCCL on CUDA, gloo on the CPU)."""
    if dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def llama_config(settings: dict, **kw):
    from examples.llama import LlamaConfig

    return LlamaConfig(**settings["model"], max_seq_len=settings["seq"], **kw)


# ------------------------------------------------------------------------------ part 2
def _shard(lib: str, mode: str, settings: dict):
    """The arm's model: built on meta, ``fully_shard`` per block and the root (bf16 compute,
    fp32 reduction), blocks compiled first in ``compiled``, materialized and initialized."""
    from examples.llama import Llama

    device = settings["device"]
    if lib == "ours":
        from device_mesh import init_device_mesh
        from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {
        "mesh": init_device_mesh(device, (1,)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    if mode == "offload":
        kw["offload_policy"] = CPUOffloadPolicy()
    with torch.device("meta"):
        model = Llama(llama_config(settings, checkpoint_blocks=mode == "ac"))
    for block in model.blocks:
        if mode == "compiled":
            block.compile(backend=settings["compile_backend"])
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu" if mode == "offload" else device)
    torch.manual_seed(0)
    model.reset_parameters()
    return model


def _sync(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _tracked_peak(model, opt, step) -> int:
    """Peak live tensor bytes of one more step, by PyTorch's MemTracker (the CPU's measure)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def run_arm(lib: str, mode: str, settings: dict) -> dict:
    """Train the arm's warm-up and timed steps; its step time, tokens/s, MFU and peaks."""
    from benchmarks.train_bench import peak_flops
    from examples.gpt import gpt_loss

    device = settings["device"]
    cuda = device == "cuda"
    model = _shard(lib, mode, settings)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    shape = (settings["batch"], settings["seq"])
    x = torch.randint(0, cfg.vocab_size, shape, generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, shape, generator=g).to(device)
    losses, times = [], []

    def step():
        loss = gpt_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    warmup = settings["warmup"]
    steps = settings["offload_steps"] if mode == "offload" else settings["steps"]
    for i in range(warmup + steps):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = _sync(device)
        losses.append(step().item())
        times.append(_sync(device) - t0)
    step_s = statistics.median(times[warmup:])
    tokens = shape[0] * shape[1]
    flops = peak_flops(device)
    out = {
        "lib": lib,
        "mode": mode,
        "params": cfg.num_params(),
        "step_s": step_s,
        "steps_s": times,
        "tokens_per_s": tokens / step_s,
        "mfu": cfg.flops_per_token(shape[1]) * tokens / step_s / flops if flops else None,
        "losses": losses,
    }
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    elif mode != "compiled":  # MemTracker's hooks and a compiled graph do not mix
        out["tracked_peak_gib"] = _tracked_peak(model, opt, step) / GiB
    return out


def _free(device: str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def speed(settings: dict, result_path: Path) -> dict:
    """Part 2: ours and PyTorch's FSDP2 in every mode, alternating which goes first."""
    device = settings["device"]
    init_world(device)
    result = {"arms": [], "checks": [], "settings": settings}
    for i, mode in enumerate(MODES):
        if mode == "offload" and not settings["offload_steps"]:
            result["checks"].append(_check(f"{mode}", "skipped", "the compute device is the CPU"))
            continue
        for lib in LIBS if i % 2 == 0 else LIBS[::-1]:
            name = f"{lib} {mode}"
            t0 = time.monotonic()
            try:
                arm = run_arm(lib, mode, settings)
                result["arms"].append(arm)
                result["checks"].append(_check(name, "ok", f"{arm['step_s']:.3f} s/step", t0))
            except Exception as e:  # the next arm still runs; the report says what broke
                result["checks"].append(_check(name, "failed", f"{type(e).__name__}: {e}", t0))
            _free(device)
            result_path.write_text(json.dumps(result, default=str))  # kept if a later arm hangs
    result["comparison"] = compare(result["arms"])
    return result


def compare(arms: list) -> list:
    """Per mode: ours / PyTorch's step time, tokens/s and peak memory, and the losses."""
    rows = []
    for mode in MODES:
        by = {a["lib"]: a for a in arms if a["mode"] == mode}
        if set(by) != set(LIBS):
            continue
        ours, theirs = by["ours"], by["torch"]
        peak = "peak_allocated_gib" if "peak_allocated_gib" in ours else "tracked_peak_gib"
        row = {
            "mode": mode,
            "tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "step_ratio": ours["step_s"] / theirs["step_s"],
            "last_loss_ours": ours["losses"][-1],
            "last_loss_torch": theirs["losses"][-1],
        }
        if peak in ours and peak in theirs:
            row["peak_ratio"] = ours[peak] / theirs[peak]
        rows.append(row)
    return rows


def _check(name: str, status: str, detail: str = "", t0: float | None = None) -> dict:
    seconds = round(time.monotonic() - t0, 1) if t0 is not None else None
    return {"name": name, "status": status, "detail": detail, "seconds": seconds}


# ------------------------------------------------------------------------------ part 3
def dispatch(settings: dict, result_path: Path) -> dict:
    """Part 3: the per-op dispatch table (``benchmarks/dispatch_bench.py``) on the device."""
    from benchmarks import dispatch_bench

    device = settings["device"]
    init_world(device)
    rounds = settings["dispatch_rounds"]
    t0 = time.monotonic()
    tables = dispatch_bench.measure(rounds, 20, rounds, device=device)
    hit, miss = tables["hit"]["geomean"], tables["miss"]["geomean"]
    detail = f"geomean ours/torch: hit {hit:.2f}x, miss {miss:.2f}x"
    return {"tables": tables, "checks": [_check("dispatch table", "ok", detail, t0)]}


# ------------------------------------------------------------------------------ part 4
def planner(settings: dict, result_path: Path) -> dict:
    """Part 4: the planner's predicted peak for each arm of part 2 against its measured peak
    (CUDA: ``max_memory_allocated`` over the timed steps; CPU: PyTorch's MemTracker)."""
    path = Path(settings["speed_result"])
    arms = json.loads(path.read_text()).get("arms", []) if path.exists() else []
    if not arms:
        return {"checks": [_check("planner vs measured", "skipped", "part 2 measured nothing")]}
    from examples.llama import Llama
    from fsdp2.tools.planner import CPU, H100, PlanConfig, estimate, profile_model

    with torch.device("meta"):
        model = Llama(llama_config(settings))
    profile = profile_model(model, seq_len=settings["seq"])
    hardware = H100 if settings["device"] == "cuda" else CPU
    rows, checks = [], []
    for arm in arms:
        measured = arm.get("peak_allocated_gib", arm.get("tracked_peak_gib"))
        if measured is None:
            continue
        cfg = PlanConfig(world_size=1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                         activation_checkpointing=arm["mode"] == "ac",
                         offload=arm["mode"] == "offload", batch_size=settings["batch"])  # fmt: skip
        est = estimate(profile, cfg, hardware)
        rows.append({
            "arm": f"{arm['lib']} {arm['mode']}",
            "predicted_gib": est.peak_gib,
            "measured_gib": measured,
            "predicted_over_measured": est.peak_gib / measured,
            "peak_phase": est.peak_phase,
            "categories_gib": {k: v / GiB for k, v in est.categories.items()},
        })  # fmt: skip
    detail = ", ".join(f"{r['arm']} {r['predicted_over_measured']:.2f}x" for r in rows)
    checks.append(_check("planner vs measured", "ok" if rows else "skipped", detail))
    return {"rows": rows, "checks": checks}
