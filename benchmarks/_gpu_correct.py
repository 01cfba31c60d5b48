"""The GPU check's parts 1 and 5 (``benchmarks/gpu_check.py``): correctness, determinism.

Multi-rank checks run as ``torchrun`` jobs of this file (``python -m torch.distributed.run
... benchmarks/_gpu_correct.py JOB DIR DEVICE``), so NCCL and CUDA state stay in their own
processes. On one GPU, NCCL takes one device per rank, and this library's gloo routes send
host memory: a check that needs more ranks than GPUs either runs on a smaller mesh or on the
CPU side of a reshard, and the report says which.

Jobs:

* ``fsdp_tp``: FSDP x TP on a ``(dp, 2)`` mesh (2 x 2 on four GPUs, 1 x 2 on two or on the
  CPU; skipped on one GPU) against the plain model trained on the whole batch in one
  process.
* ``ckpt_cpu``: the CPU side of a checkpoint reshard: 2 ranks load what one process on the
  device saved, compare with the full tensors written beside it (``torch.save``) bit for
  bit, train a step and save for the device side to load and compare.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _procs  # noqa: E402
from benchmarks._gpu_speed import _check, _write, end_world, init_world, remaining  # noqa: E402

STEPS = 3
#: tests/test_fsdp_gpu.py's checks (tests/gpu_checks.py), and the GPUs each needs
GPU_TESTS = {"bf16": 1, "offload": 1, "memory": 1, "parity2": 2}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(settings: dict, cmd: list, timeout: float, env=None) -> tuple[int | None, str]:
    """``cmd`` in the repository root for at most ``timeout`` s; its output goes to the
    run's log; nothing it starts outlives it (``benchmarks/_procs.py``)."""
    env = dict(os.environ, **(env or {}))
    sys.stdout.flush()
    return _procs.run(cmd, timeout, env=env, cwd=ROOT, log_path=settings.get("log"))


def _torchrun(settings: dict, script: str, args: list, nproc: int, timeout: float):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, *args]  # fmt: skip
    return _run(settings, cmd, timeout, env={"OMP_NUM_THREADS": "1"})


#: A torchrun job on a GPU spends ~10 s starting (interpreter, CUDA context, NCCL) before
#: its check runs: a share of a small budget below this would kill a check that passes (the
#: first H100 run killed the bf16 check after it printed "ok").
MIN_JOB_S = 30.0


def _budget(settings: dict, share: float, reserve: float = 5.0) -> float:
    """``share`` of what is left of the part's budget, less ``reserve`` seconds, but at least
    ``MIN_JOB_S`` while that much is left."""
    left = remaining(settings) - reserve
    return max(1.0, share * left, min(MIN_JOB_S, left))


def _step(checks: list, name: str, fn, *args) -> bool:
    """Run one step of a part; an exception becomes a failed check naming it."""
    t0 = time.monotonic()
    try:
        found = fn(*args)
    except Exception as e:  # the report says what broke; the next step still runs
        checks.append(_check(name, "failed", f"{type(e).__name__}: {e}"[:800], t0))
        return False
    checks += found if isinstance(found, list) else [found]
    return True


# ------------------------------------------------------------------------------ part 1
def correctness(settings: dict, result_path: Path) -> dict:
    """Part 1: the GPU tests, FSDP x TP on a 2-D mesh, a checkpoint resharded across sizes."""
    result = {"checks": []}
    checks = result["checks"]
    for name, nproc in GPU_TESTS.items():
        left = len(GPU_TESTS) - list(GPU_TESTS).index(name) + 2  # this one, the rest, 2 more
        _step(checks, f"test_fsdp_gpu: {name}", _gpu_test, settings, name, nproc, 1 / left)
        _write(result_path, result)
    _step(checks, "FSDP x TP on a 2-D mesh", _fsdp_tp, settings, 0.5)
    _write(result_path, result)
    _step(checks, "checkpoint reshard", _reshard, settings)
    return result


def _gpu_test(settings: dict, check: str, nproc: int, share: float) -> dict:
    """One check of ``tests/test_fsdp_gpu.py``, run as that test runs it (torchrun of
    ``tests/gpu_checks.py``), with a time limit of its own."""
    name = f"test_fsdp_gpu: {check}"
    if settings["device"] != "cuda":
        return _check(name, "skipped", "needs CUDA (tests/test_fsdp_gpu.py skips it here too)")
    if _gpus() < nproc:
        return _check(name, "skipped", f"needs {nproc} GPUs, this machine has {_gpus()}")
    t0 = time.monotonic()
    rc, tail = _torchrun(settings, "tests/gpu_checks.py", [check], nproc, _budget(settings, share))
    if rc == 0 and f"gpu check {check}: ok" in tail:
        return _check(name, "ok", "", t0)
    why = "ran over its time (killed)" if rc is None else f"exit {rc}"
    return _check(name, "failed", f"{why}: {tail[-800:]}", t0)


def _fsdp_tp(settings: dict, share: float) -> dict:
    """FSDP x TP on a ``(dp, 2)`` mesh: 2 x 2 on four GPUs, 1 x 2 on two GPUs or the CPU
    (``make test`` runs the CPU one: two processes start faster than four). One GPU cannot
    hold it (NCCL takes a device per rank; a 1 x 1 mesh applies neither TP nor sharding)."""
    device = settings["device"]
    nproc = 2 if device == "cpu" else (4 if _gpus() >= 4 else 2 if _gpus() >= 2 else 1)
    if nproc == 1:
        why = "needs 2 GPUs: NCCL takes one device per rank, and a 1x1 mesh tests nothing"
        return _check("FSDP x TP on a 2-D mesh vs one process", "skipped", why)
    t0 = time.monotonic()
    outdir = Path(settings["tmp"]) / "fsdp_tp"
    outdir.mkdir()
    args = ["fsdp_tp", str(outdir), device]
    rc, tail = _torchrun(settings, str(Path(__file__)), args, nproc, _budget(settings, share))
    name = f"FSDP x TP on a {nproc // 2}x2 mesh vs one process"
    if rc != 0:
        return _check(name, "failed", f"exit {rc}: {tail[-800:]}", t0)
    return _check(name, "ok", (outdir / "summary").read_text(), t0)


def _reshard(settings: dict) -> list:
    """One process on the device saves at world size 1; 2 CPU ranks load that (and compare),
    train a step and save; the device process loads it back (and compares)."""
    device = settings["device"]
    base = Path(settings["tmp"]) / "reshard"
    base.mkdir()
    init_world(device)
    checks = []
    t0 = time.monotonic()
    model = _ckpt_model(device, seed=0)
    _train_one_step(model, device)
    _save(model, base, "from-device")
    checks.append(_check(f"checkpoint save (1 rank, {device})", "ok", "", t0))
    t0 = time.monotonic()
    rc, tail = _torchrun(settings, str(Path(__file__)), ["ckpt_cpu", str(base), "cpu"], 2,
                         _budget(settings, 0.8))  # fmt: skip
    name = "checkpoint load, train, save (2 ranks, cpu)"
    if rc != 0:
        return checks + [_check(name, "failed", f"exit {rc}: {tail[-800:]}", t0)]
    checks.append(_check(name, "ok", "loaded bit for bit", t0))
    t0 = time.monotonic()
    _load_and_compare(base, "from-cpu", device, seed=2)
    what = f"loaded bit for bit onto {device}"
    checks.append(_check(f"checkpoint load (1 rank, {device})", "ok", what, t0))
    end_world()
    return checks


# ------------------------------------------------------------------------------ jobs
def _init(device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")


def _gpt_cfg(**kw):
    from examples.gpt import GPTConfig

    # awkward sizes: a vocabulary not divisible by 2 or 4, fewer position rows than ranks+1
    # no biases: a key bias gets a zero gradient in exact arithmetic (softmax ignores a shift)
    # and rounding noise otherwise, which AdamW turns into steps of its full learning rate
    return GPTConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4, max_seq_len=6, bias=False,
                     **kw)  # fmt: skip


def _batches(cfg, n: int, rows: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len), generator=g),
             torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len), generator=g))
            for _ in range(n)]  # fmt: skip


def job_fsdp_tp(outdir: Path, device: str) -> None:
    from device_mesh import init_device_mesh
    from examples.gpt import GPT, gpt_loss, tp_plan
    from fsdp2 import parallelize_transformer

    _init(device)
    ws = dist.get_world_size()
    tp = min(ws, 2)
    mesh = init_device_mesh(device, (ws // tp, tp), mesh_dim_names=("dp", "tp"))
    cfg = _gpt_cfg(fused_qkv=False)
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    parallelize_transformer(model, mesh, tp_plan=tp_plan())
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    # SGD: a rounding difference stays that size (AdamW's normalized step can blow one up)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for x, y in _batches(cfg, STEPS, 2 * dp):
        x, y = x.to(device), y.to(device)
        rows = slice(2 * dp_rank, 2 * dp_rank + 2)
        losses = (gpt_loss(model, x[rows], y[rows]), gpt_loss(ref, x, y))
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
    worst = 0.0
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got, want = p.full_tensor().detach(), full[name].detach()
        diff = (got - want).abs().max().item()
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"{name}: differs from one process by up to {diff:.2e}")
        worst = max(worst, diff)
    if dist.get_rank() == 0:
        (outdir / "summary").write_text(f"{STEPS} SGD steps, largest difference {worst:.1e}")
    dist.destroy_process_group()


def _ckpt_model(device: str, seed: int):
    from device_mesh import init_device_mesh
    from examples.gpt import GPT
    from fsdp2 import fully_shard

    torch.manual_seed(seed)
    model = GPT(_gpt_cfg()).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_one_step(model, device: str) -> None:
    from examples.gpt import gpt_loss

    (x, y), = _batches(model.cfg, 1, 2)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gpt_loss(model, x.to(device), y.to(device)).backward()
    opt.step()


def _save(model, outdir: Path, name: str) -> None:
    from dtensor import checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=outdir / name)
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, outdir / f"{name}.expected.pt")


def _load_and_compare(outdir: Path, name: str, device: str, seed: int):
    """A differently seeded model, loaded from ``name``: its values must be the saved ones,
    on ``device``."""
    from dtensor import checkpoint as dcp

    model = _ckpt_model(device, seed=seed)
    dcp.load({"model": model.state_dict()}, checkpoint_id=outdir / name)
    expected = torch.load(outdir / f"{name}.expected.pt")
    for k, v in model.state_dict().items():
        if not torch.equal(v.full_tensor().cpu(), expected[k]):
            raise AssertionError(f"{k}: loaded values differ from the saved ones")
        if v.to_local().device.type != device:
            raise AssertionError(f"{k}: loaded onto {v.to_local().device}, not {device}")
    return model


def job_ckpt_cpu(outdir: Path, device: str) -> None:
    """The CPU side of the reshard: load what one device rank saved, train, save."""
    _init(device)
    model = _load_and_compare(outdir, "from-device", device, seed=1)
    _train_one_step(model, device)
    _save(model, outdir, "from-cpu")
    dist.destroy_process_group()


JOBS = {"fsdp_tp": job_fsdp_tp, "ckpt_cpu": job_ckpt_cpu}


# ------------------------------------------------------------------------------ part 5
def _determinism_run(settings: dict, math_attention: bool) -> tuple[list, dict]:
    """Four seeded bf16 steps of a small Llama under ``fully_shard`` at world size 1."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks._gpu_speed import _shard
    from examples.gpt import gpt_loss

    small = dict(settings, model=dict(settings["model"], n_layers=2, dim=min(512, settings["model"]["dim"])),
                 seq=min(256, settings["seq"]))  # fmt: skip
    small["model"]["ffn_dim"] = min(small["model"]["ffn_dim"], 1024)
    device = settings["device"]
    model = _shard("ours", "eager", small)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    shape = (small["batch"], small["seq"])
    kernels = sdpa_kernel([SDPBackend.MATH]) if math_attention else contextlib.nullcontext()
    losses = []
    with kernels:
        for _ in range(4):
            x = torch.randint(0, model.cfg.vocab_size, shape, generator=g).to(device)
            loss = gpt_loss(model, x, x.roll(-1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    params = {k: p.full_tensor().detach().cpu() for k, p in model.named_parameters()}
    return losses, params


def _bitwise_equal(a: dict, b: dict) -> list:
    return [k for k in a if not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))]


def determinism(settings: dict, result_path: Path) -> dict:
    """Part 5: two seeded runs bit for bit (deterministic algorithms, the math attention
    kernel; then the default attention kernels, still under deterministic algorithms,
    reported as found), and out-of-step detection on NCCL when two GPUs can each run a rank."""
    device = settings["device"]
    init_world(device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    result = {"checks": []}
    checks = result["checks"]
    runs = ((True, "deterministic algorithms, math attention"),
            (False, "deterministic algorithms, default attention kernels (reported)"))  # fmt: skip
    for math_attention, name in runs:
        _step(checks, f"two runs, {name}", _two_runs, settings, math_attention, name)
        _write(result_path, result)
    end_world()
    _step(checks, "out-of-step detection on NCCL", _out_of_step, settings)
    return result


def _two_runs(settings: dict, math_attention: bool, name: str) -> dict:
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # deterministic algorithms' alerts name the op
        (l1, p1), (l2, p2) = (_determinism_run(settings, math_attention) for _ in range(2))
    alerts = sorted({str(w.message).split(" does not have a deterministic")[0][:120]
                     for w in caught if "deterministic" in str(w.message)})  # fmt: skip
    differ = _bitwise_equal(p1, p2)
    same = not differ and l1 == l2
    status = "ok" if same or not math_attention else "failed"
    detail = "bit-identical" if same else f"differ: losses {l1} vs {l2}; params {differ[:5]}"
    if alerts:
        detail += f"; nondeterministic ops: {alerts[:5]}"
    return _check(f"two runs, {name}", status, detail, t0)


def _out_of_step(settings: dict) -> dict:
    name = "out-of-step detection on NCCL (a rank skips an all-gather)"
    if settings["device"] != "cuda" or _gpus() < 2:
        why = "needs two GPUs: NCCL takes one device per rank" if settings["device"] == "cuda" \
            else "NCCL needs GPUs (make test runs the gloo version, tests/test_out_of_step.py)"  # fmt: skip
        return _check(name, "skipped", why)
    t0 = time.monotonic()
    outdir = Path(settings["tmp"]) / "faults"
    outdir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tests._faults", "skip_all_gather", str(outdir), "2.0"]  # fmt: skip
    env = {"FAULTS_DEVICE": "cuda"}
    rc, tail = _run(settings, cmd, _budget(settings, 1.0, reserve=2.0), env=env)
    logs = "".join((outdir / f"rank{r}.log").read_text() for r in (0, 1)
                   if (outdir / f"rank{r}.log").exists())  # fmt: skip
    named = "ranks diverge at #" in logs or "is behind" in logs
    status = "ok" if rc not in (0, None) and named else "failed"
    verdict = next((ln for ln in logs.splitlines() if "diverge" in ln or "behind" in ln), "")
    return _check(name, status, f"exit {rc}; {verdict[:300] or tail[-500:]}", t0)


if __name__ == "__main__":  # under torchrun: JOB OUTDIR DEVICE
    JOBS[sys.argv[1]](Path(sys.argv[2]), sys.argv[3])
