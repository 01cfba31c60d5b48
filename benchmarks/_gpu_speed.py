"""The GPU check's parts 2-4 (``benchmarks/gpu_check.py``): speed, dispatch, the planner.

Everything runs at world size 1 (a one-rank process group on a ``HashStore``: NCCL on the
GPU, gloo on the CPU). Part 2 runs every arm - one library in one mode - in a process of its
own (``python benchmarks/_gpu_speed.py arm LIB MODE SETTINGS OUT``) with its own deadline, so
an arm that hangs, crashes or runs out of memory costs that arm only, and its peak memory is
its own. Both libraries' arms start from the same weights (drawn on the device from one
seeded generator, [Note: same weights]) and the same batch, so their losses must agree: a
fast arm that trains wrongly is a failure, not a win.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _procs  # noqa: E402

#: in the order they run: compilation last, so that its fixed cost running over the budget
#: leaves the other modes measured
MODES = ("eager", "ac", "offload", "compiled")
LIBS = ("ours", "torch")
GiB = 2**30
#: ours and PyTorch's losses per step, same weights and batch, bf16 compute (relative)
LOSS_RTOL = 2e-2


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


def end_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def llama_config(settings: dict, **kw):
    from examples.llama import LlamaConfig

    return LlamaConfig(**settings["model"], max_seq_len=settings["seq"], **kw)


def remaining(settings: dict) -> float:
    """Seconds left of this part's budget."""
    return settings["deadline"] - time.time()


def _check(name: str, status: str, detail: str = "", t0: float | None = None) -> dict:
    seconds = round(time.monotonic() - t0, 1) if t0 is not None else None
    return {"name": name, "status": status, "detail": detail, "seconds": seconds}


def peak_flops() -> tuple[float | None, str]:
    """Dense bf16 peak FLOP/s of this GPU for MFU, and where the figure comes from."""
    name = torch.cuda.get_device_name()
    table = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
             ("H200", 989e12), ("A100", 312e12))  # fmt: skip
    for key, flops in table:
        if key in name:
            return flops, f"{flops / 1e12:.0f} TFLOP/s dense bf16 ({key} data sheet)"
    return None, f"unknown for {name!r}: MFU not given"


# ------------------------------------------------------------------------------ one arm
def _shard(lib: str, mode: str, settings: dict):
    """The arm's model: built on meta, ``fully_shard`` per block and the root (bf16 compute,
    fp32 reduction), blocks compiled first in ``compiled``, materialized, same weights."""
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
    same_weights(model, device)
    return model


@torch.no_grad()
def same_weights(model, device: str) -> None:
    """[Note: same weights] Every full parameter drawn in name order from one generator
    seeded 0 on ``device``, and copied into its local shard (world size 1: the whole
    tensor). ``reset_parameters`` on sharded parameters draws differently per library
    (PyTorch's DTensor keeps its own offset-based generator on CUDA)."""
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        full = torch.empty(p.shape, dtype=p.dtype, device=device)
        std = model.init_std(name)
        if std is None:
            full.fill_(1.0)
        else:
            full.normal_(0.0, std, generator=gen)
        p.to_local().copy_(full)


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
    from examples.gpt import gpt_loss

    device = settings["device"]
    cuda = device == "cuda"
    init_world(device)
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
    flops, source = peak_flops() if cuda else (None, "no GPU")
    out = {
        "lib": lib,
        "mode": mode,
        "params": cfg.num_params(),
        "step_s": step_s,
        "steps_s": times,
        "tokens_per_s": tokens / step_s,
        "mfu": cfg.flops_per_token(shape[1]) * tokens / step_s / flops if flops else None,
        "peak_flops": source,
        "losses": losses,
    }
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    elif mode != "compiled":  # MemTracker's hooks and a compiled graph do not mix
        out["tracked_peak_gib"] = _tracked_peak(model, opt, step) / GiB
    return out


def _arm_main(argv: list) -> None:
    lib, mode, settings, out = argv[0], argv[1], json.loads(argv[2]), Path(argv[3])
    result = run_arm(lib, mode, settings)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    end_world()


# ------------------------------------------------------------------------------ part 2
def _compile_toolchain() -> str | None:
    """Why inductor cannot build its GPU kernels here (Triton, a C compiler, ``Python.h``
    for the launchers Triton builds), or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: inductor has no GPU backend"
    compilers = [os.environ.get("CC"), "cc", "gcc", "clang"]
    if not any(c and shutil.which(c) for c in compilers):
        return "no C compiler ($CC, cc, gcc, clang): Triton cannot build its launchers"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        return f"no {header}: Triton cannot build its launchers"
    return None


def _arm_process(lib: str, mode: str, settings: dict, timeout: float) -> tuple[dict | None, str]:
    """The arm in a process of its own; its result (also when only its exit hung after
    writing it), or None and why."""
    out = Path(settings["tmp"]) / f"arm-{lib}-{mode}.json"
    cmd = [sys.executable, __file__, "arm", lib, mode, json.dumps(settings), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1") if settings["device"] == "cpu" else None
    rc, tail = _procs.run(cmd, timeout, env=env, cwd=ROOT, log_path=settings.get("log"))
    if out.exists():
        return json.loads(out.read_text()), "" if rc == 0 else f" (exit {rc} after its result)"
    why = f"ran over its {timeout:.0f} s (killed)" if rc is None else f"exit {rc}"
    last = [ln for ln in tail.splitlines() if ln.strip()][-3:]
    return None, f"{why}: {' / '.join(last)[-600:]}"


def speed(settings: dict, result_path: Path) -> dict:
    """Part 2: ours and PyTorch's FSDP2 in every mode, each arm a process of its own with a
    cap on its time; an arm that the part's deadline would cut is not started."""
    result = {"arms": [], "checks": []}
    no_compile = _compile_toolchain() if settings["device"] == "cuda" else None
    for mode in MODES:
        skip = no_compile if mode == "compiled" else None
        if mode == "offload" and not settings["offload_steps"]:
            skip = "the compute device is the CPU"
        least, most = settings["arm_s"][mode]
        for lib in LIBS:
            name = f"{lib} {mode}"
            left = remaining(settings) - 5.0  # the part's own ending
            if skip or left < least:
                why = skip or f"out of time: {left:.0f} s left of the part, an arm needs {least}"
                result["checks"].append(_check(name, "skipped", why))
                continue
            t0 = time.monotonic()
            arm, why = _arm_process(lib, mode, settings, min(most, left))
            if arm is None and min(most, left) < most and "killed" in why:
                result["checks"].append(
                    _check(name, "skipped", f"cut at the part's end: {why}", t0)
                )
            elif arm is None:
                result["checks"].append(_check(name, "failed", why, t0))
            else:
                result["arms"].append(arm)
                detail = f"{arm['step_s']:.3f} s/step{why}"
                result["checks"].append(_check(name, "ok", detail, t0))
            _write(result_path, result)  # kept if the part is killed later
        result["checks"] += _losses_agree(result["arms"], mode)
        _write(result_path, result)
    result["comparison"] = compare(result["arms"])
    return result


def _losses_agree(arms: list, mode: str) -> list:
    by = {a["lib"]: a for a in arms if a["mode"] == mode}
    if set(by) != set(LIBS):
        return []
    ours, theirs = by["ours"]["losses"], by["torch"]["losses"]
    name = f"{mode}: ours trains like PyTorch's FSDP2"
    if not all(math.isfinite(v) for v in ours + theirs):
        return [_check(name, "failed", f"a loss is not finite: ours {ours}, PyTorch's {theirs}")]
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(ours, theirs))
    status = "ok" if worst <= LOSS_RTOL else "failed"
    detail = f"largest relative difference {worst:.1e} over {len(ours)} steps (bound {LOSS_RTOL})"
    return [_check(name, status, detail)]


def _write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, path)


def compare(arms: list) -> list:
    """Per mode: ours / PyTorch's step time, tokens/s and peak memory, and the losses."""
    rows = []
    for mode in MODES:
        by = {a["lib"]: a for a in arms if a["mode"] == mode}
        if set(by) != set(LIBS):
            continue
        ours, theirs = by["ours"], by["torch"]
        if not all(math.isfinite(v) for v in ours["losses"] + theirs["losses"]):
            continue  # a run that diverged has no speed to compare (its check failed)
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


# ------------------------------------------------------------------------------ part 3
def dispatch(settings: dict, result_path: Path) -> dict:
    """Part 3: the per-op dispatch table (``benchmarks/dispatch_bench.py``) on the device."""
    from benchmarks import dispatch_bench

    device = settings["device"]
    init_world(device)
    rounds = settings["dispatch_rounds"]
    t0 = time.monotonic()
    tables = dispatch_bench.measure(rounds, 20, rounds, device=device)
    end_world()
    hit, miss = tables["hit"]["geomean"], tables["miss"]["geomean"]
    detail = f"geomean ours/torch: hit {hit:.2f}x, miss {miss:.2f}x (host time per call)"
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
    rows = []
    for arm in arms:
        measured = arm.get("peak_allocated_gib", arm.get("tracked_peak_gib"))
        if measured is None:
            continue
        cfg = PlanConfig(world_size=1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                         activation_checkpointing=arm["mode"] == "ac",
                         offload=arm["mode"] == "offload", batch_size=settings["batch"])  # fmt: skip
        est = estimate(profile, cfg, hardware)
        label = f"{arm['lib']} {arm['mode']}"
        if arm["mode"] == "compiled":
            label += " (predicted as eager: compilation is not modelled)"
        rows.append({
            "arm": label,
            "predicted_gib": est.peak_gib,
            "measured_gib": measured,
            "predicted_over_measured": est.peak_gib / measured,
            "peak_phase": est.peak_phase,
            "categories_gib": {k: v / GiB for k, v in est.categories.items()},
        })  # fmt: skip
    detail = ", ".join(
        f"{r['arm'].split(' (')[0]} {r['predicted_over_measured']:.2f}x" for r in rows
    )
    return {"rows": rows, "checks": [_check("planner vs measured", "ok", detail)]}


if __name__ == "__main__" and sys.argv[1] == "arm":
    _arm_main(sys.argv[2:])
