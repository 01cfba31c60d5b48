"""The GPU check: correctness, speed, dispatch, the planner and determinism on the GPU in
hand, in one run of about eight minutes, with one report.

    python3 benchmarks/gpu_check.py --out DIR                # on a GPU machine, its own python3
    python3 benchmarks/gpu_check.py --out DIR --budget 240   # a smaller model, fewer steps
    python3 benchmarks/gpu_check.py --out DIR --cpu          # the same script end to end on CPU
    make gpu-check GPU_REPORT=DIR [GPU_ARGS=--cpu]

It needs no venv and installs nothing: PyTorch (2.11 to 2.13), numpy and safetensors as the
machine has them. Each part runs in a process of its own with its own time budget (a share
of ``--budget``); a part that fails, crashes or runs over is reported as such and the next
part runs. Parts (``--parts`` picks some):

1. ``correctness``: ``tests/test_fsdp_gpu.py``'s checks (bf16 against PyTorch's FSDP2, CPU
   offload against no offload, CUDA's memory counters against the tracker), each the torchrun
   job that test runs, with its own time limit; FSDP x TP on a 2-D mesh (two GPUs or more,
   and the CPU) against one process; a checkpoint saved on the device at one rank, loaded
   by 2 CPU ranks, and back.
2. ``dispatch``: ``benchmarks/dispatch_bench.py``'s per-op table with tensors on the device.
3. ``determinism``: two seeded runs bit-identical on the device; out-of-step detection on
   NCCL when two GPUs can run one rank each.
4. ``speed``: a Llama-style model (~1B parameters at the full budget) in bf16 at world size
   1, our ``fully_shard`` against PyTorch's FSDP2 from the same weights: eager, with
   activation checkpointing, with CPU offload, and compiled; step time, tokens/s, MFU, peak
   memory, and the losses of both, which must agree. Each arm is a process of its own.
5. ``planner``: the planner's predicted peak against the measured peaks of part 4.

The cheap parts run first and time a part leaves unused goes to the parts after it, so the
speed part runs on all that is left.

Writes ``DIR/gpu-report.json``, ``DIR/gpu-report.md`` (again after every part, so a run cut
short keeps what it measured) and ``DIR/gpu-check.log`` (every part's output), and exits 1
when any part failed or ran over, 0 otherwise (a skip is not a failure). Every process a
part starts (torchrun's workers too) is killed when the part ends or runs over.
``--cpu`` runs everything on the CPU with tiny sizes (``tests/test_gpu_check.py`` runs it in
``make test``, so the script cannot rot before a GPU comes); there, compiled arms use the
``aot_eager`` backend (no C++ build) and the offload arms are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _gpu_report, _procs  # noqa: E402

#: Each part's share of what is left when it starts, over the shares of the parts still to
#: run: time a part does not use goes to the ones after it. The cheap parts run first, so
#: the speed part, which uses all it gets, runs on what they left; the planner reads its
#: results. A part may also run a grace period past its share to end cleanly (write its
#: result, stop its processes) before it is killed; none runs past the run's deadline.
SHARES = {
    "correctness": 0.30,
    "dispatch": 0.06,
    "determinism": 0.10,
    "speed": 0.48,
    "planner": 0.06,
}
PARTS = tuple(SHARES)


def grace(budget_s: float) -> float:
    """Seconds a part may run past its deadline before it is killed: 15, or a fifth of a
    small budget."""
    return min(15.0, 0.2 * budget_s)


RESERVE_S = 5.0  # for the report, at the end
SUPPORTED_TORCH = ((2, 11), (2, 13))  # the oldest and newest minor releases tested
DEFAULT_BUDGET_S = 480.0
#: tests/test_gpu_check.py: the part named in this environment variable hangs
HANG_FOR_TESTS = "GPU_CHECK_TEST_HANG"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu-report.json / .md and the log")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for all parts together (default 480); sizes scale with it")  # fmt: skip
    p.add_argument("--cpu", action="store_true", help="run on the CPU with tiny sizes")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, of {PARTS} (they run in that order)")  # fmt: skip
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one part, in its process
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # the environment, to FILE
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown part(s) {unknown}; choose from {list(PARTS)}")
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget}")
    return args


# ------------------------------------------------------------------------------ sizes
def settings_for(budget_s: float, cpu: bool) -> dict:
    """Model and step counts for a budget: the full Llama-style ~1B at 480 s, fewer blocks
    and steps below it (compilation's fixed cost does not shrink), tiny on the CPU.
    ``arm_s``: per speed mode, the seconds an arm needs at least to be started, and the
    most it may take."""
    if cpu:
        model = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160)
        return dict(device="cpu", model=model, batch=2, seq=32, warmup=2, steps=3,
                    offload_steps=0, compile_backend="aot_eager", dispatch_rounds=5,
                    arm_s={"eager": (3, 60), "ac": (3, 60), "offload": (3, 60),
                           "compiled": (5, 90)})  # fmt: skip
    scale = min(1.0, budget_s / DEFAULT_BUDGET_S)
    model = dict(vocab_size=32000, dim=2048, n_layers=max(2, round(18 * scale)), n_heads=16,
                 n_kv_heads=8, ffn_dim=5632)  # fmt: skip
    # 3 warm-up steps: a fresh process's second step still fills caches (measured on CPU:
    # ours 31.6 ms at step 2, 13.5 ms from step 3 on; PyTorch's 53.7 and 22-40 ms)
    return dict(device="cuda", model=model, batch=4, seq=2048, warmup=3,
                steps=max(2, round(6 * scale)), offload_steps=max(1, round(2 * scale)),
                compile_backend="inductor", dispatch_rounds=max(11, round(41 * scale)),
                arm_s={"eager": (25, 90), "ac": (25, 90), "offload": (40, 120),
                       "compiled": (60, 240)})  # fmt: skip


# ------------------------------------------------------------------------------ environment
def environment(cpu: bool) -> dict:
    """What this machine has: PyTorch, CUDA, the GPUs, NCCL; whether the torch is supported.
    Runs in the probe's own process (``--probe``): the driver never touches the GPU."""
    import torch

    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_supported": SUPPORTED_TORCH[0] <= version <= SUPPORTED_TORCH[1],
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "mode": "cpu" if cpu else "cuda",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpus=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            bf16=torch.cuda.is_bf16_supported(),
            nccl=".".join(str(v) for v in torch.cuda.nccl.version()),
        )
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def _probe(cpu: bool, tmp: str) -> dict:
    out = Path(tmp) / "environment.json"
    cmd = [sys.executable, __file__, "--out", tmp, "--probe", str(out)] + ["--cpu"] * cpu
    rc, tail = _procs.run(cmd, 120, cwd=ROOT)  # the driver itself never touches the GPU
    if rc != 0 or not out.exists():
        return {"mode": "cpu" if cpu else "cuda", "error": f"the probe failed ({rc}): {tail}"}
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------ one part
def run_part(part: str, settings: dict, budget_s: float, log_path: Path) -> dict:
    """Run ``part`` in a process of its own: its deadline is ``budget_s`` from now, and it
    is killed ``grace(budget_s)`` after that. Its result dict, or one that says how it failed.
    Nothing it started outlives it."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        result_file = Path(tmp) / "result.json"
        settings = dict(settings, tmp=tmp, deadline=time.time() + budget_s, log=str(log_path))
        cmd = [sys.executable, __file__, "--out", tmp, "--part", part,
               "--result", str(result_file), "--settings", json.dumps(settings)]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if settings["device"] == "cuda":
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # determinism's cuBLAS
        with open(log_path, "a") as log:
            log.write(f"\n===== part {part} (budget {budget_s:.0f} s) =====\n")
        t0 = time.monotonic()
        rc, _ = _procs.run(cmd, budget_s + grace(budget_s), env=env, cwd=ROOT, log_path=log_path)
        elapsed = time.monotonic() - t0
        try:
            result = json.loads(result_file.read_text()) if result_file.exists() else {}
        except ValueError:  # cut short while writing (parts write atomically, but still)
            result = {}
    result.setdefault("checks", [])
    if result.get("complete"):  # it finished its work; only its exit went wrong, if anything
        if rc != 0:
            result["note"] = f"exit {rc} after writing its result"
        result.setdefault("status", _status_of(result["checks"]))
    elif rc is None:
        result["status"] = "timeout"
        result["error"] = f"ran over its budget of {budget_s:.0f} s (killed)"
    else:
        result["status"] = "failed"
        result.setdefault("error", f"exited with {rc} (see gpu-check.log)")
    result.update(seconds=round(elapsed, 1), budget_s=round(budget_s, 1))
    return result


def _status_of(checks: list) -> str:
    statuses = {c["status"] for c in checks}
    if "failed" in statuses:
        return "failed"
    if statuses and statuses <= {"skipped"}:
        return "skipped"
    return "ok"


def _part_main(args) -> None:
    """Inside a part's process: run it, write its result (atomically); an exception is
    recorded as the part's error, with the checks it had written so far."""
    from benchmarks import _gpu_correct, _gpu_speed

    if os.environ.get(HANG_FOR_TESTS) == args.part:
        time.sleep(3600)
    settings = json.loads(args.settings)
    fn = {
        "correctness": _gpu_correct.correctness,
        "speed": _gpu_speed.speed,
        "dispatch": _gpu_speed.dispatch,
        "planner": _gpu_speed.planner,
        "determinism": _gpu_correct.determinism,
    }[args.part]
    path = Path(args.result)
    try:
        result = fn(settings, path)
    except Exception as e:
        import traceback

        traceback.print_exc()
        result = json.loads(path.read_text()) if path.exists() else {"checks": []}
        result.update(status="failed", error=f"{type(e).__name__}: {e}"[:1000])
    result["complete"] = True
    _gpu_speed._write(path, result)
    _gpu_speed.end_world()


# ------------------------------------------------------------------------------ driver
def _finite(value):
    """``value`` with every NaN or infinity as a string (strict JSON readers refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _write_report(out: Path, report: dict) -> None:
    report = _finite(report)
    for name, text in (("gpu-report.json", json.dumps(report, indent=2, default=str)),
                       ("gpu-report.md", _gpu_report.markdown(report))):  # fmt: skip
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        Path(args.probe).write_text(json.dumps(environment(args.cpu)))
        return 0
    if args.part:
        _part_main(args)
        return 0
    deadline = time.monotonic() + args.budget - RESERVE_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = settings_for(args.budget, args.cpu)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        env = _probe(args.cpu, tmp)
    report = {"environment": env, "budget_s": args.budget, "settings": settings, "parts": {}}
    if "error" in env:
        report["error"] = env["error"]
    elif not args.cpu and not env["cuda_available"]:
        report["error"] = "no CUDA device: run on a GPU machine, or pass --cpu"
    else:
        _run_parts(args, settings, report, out, deadline)
    _write_report(out, report)
    print(_gpu_report.markdown(_finite(report)))
    bad = [p for p, r in report["parts"].items() if r["status"] in ("failed", "timeout")]
    return 1 if bad or "error" in report else 0


def _run_parts(args, settings: dict, report: dict, out: Path, deadline: float) -> None:
    speed_file = out / ".speed.json"  # the planner part reads part 2's measurements
    speed_file.unlink(missing_ok=True)  # never an earlier run's
    log_path = out / "gpu-check.log"
    log_path.write_text("")
    todo = [p for p in PARTS if p in args.parts.split(",")]
    for i, part in enumerate(todo):
        left = deadline - time.monotonic()
        share = SHARES[part] / sum(SHARES[p] for p in todo[i:])
        budget = min(share * left, left - grace(share * left))
        if budget < 2.0:
            result = {"status": "skipped", "checks": [], "seconds": 0.0, "budget_s": 0.0,
                      "error": "no time left of --budget"}  # fmt: skip
        else:
            report["parts"][part] = {"status": "running", "checks": [], "seconds": 0.0,
                                     "budget_s": round(budget, 1)}  # fmt: skip
            _write_report(out, report)  # a run killed now still says where it was
            result = run_part(part, dict(settings, speed_result=str(speed_file)), budget,
                              log_path)  # fmt: skip
        report["parts"][part] = result
        if part == "speed":
            speed_file.write_text(json.dumps(_finite(result)))
        print(_gpu_report.part_line(part, result), flush=True)
        _write_report(out, report)  # a run killed later keeps every part so far
    speed_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
