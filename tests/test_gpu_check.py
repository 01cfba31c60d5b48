"""The GPU check (``benchmarks/gpu_check.py``) end to end on the CPU, so it cannot rot
before a GPU comes: every part runs (or says why it skipped), the report has every table,
and a part that runs over its budget is reported and does not stop the next one."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


def _run(out: Path, *flags: str, timeout: float = 280, env=None):
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--cpu", "--out", str(out), *flags]
    env = dict(os.environ, **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)  # fmt: skip
    report = json.loads((out / "gpu-report.json").read_text())
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    return proc, report, log


@pytest.mark.nightly  # a minute of make test's five; make test-all and make gpu-check run it
def test_cpu_mode_runs_every_part_and_writes_the_report(tmp_path):
    proc, report, log = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-5000:]
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    for name, part in parts.items():
        assert part["status"] in ("ok", "skipped"), (name, part)
        assert part["seconds"] <= part["budget_s"] + gpu_check.grace(part["budget_s"])
    checks = {c["name"]: c for p in parts.values() for c in p["checks"]}
    # what runs on a CPU does run: the 2-D mesh, the reshard both ways, the two seeded runs
    ran = [n for n, c in checks.items() if c["status"] == "ok"]
    assert any("FSDP x TP on a 1x2 mesh" in n for n in ran), checks
    assert sum(n.startswith("checkpoint") for n in ran) == 3, checks
    assert any("math attention" in n for n in ran), checks
    # the speed table: both libraries in every mode the CPU has, same data, same losses
    arms = {(a["lib"], a["mode"]): a for a in parts["speed"]["arms"]}
    assert set(arms) == {(lib, m) for lib in ("ours", "torch") for m in ("eager", "compiled", "ac")}
    for mode in ("eager", "compiled", "ac"):
        ours, theirs = arms[("ours", mode)]["losses"], arms[("torch", mode)]["losses"]
        assert all(math.isfinite(v) for v in ours)
        assert ours == theirs or max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-2, mode
    assert {r["mode"] for r in parts["speed"]["comparison"]} == {"eager", "compiled", "ac"}
    for mode in ("eager", "compiled", "ac"):  # same weights and batch: the losses agree
        assert checks[f"{mode}: ours trains like PyTorch's FSDP2"]["status"] == "ok", checks
    assert len(parts["dispatch"]["tables"]["hit"]["ops"]) == 8
    assert {r["arm"] for r in parts["planner"]["rows"]} >= {"ours eager", "ours ac"}
    md = (tmp_path / "gpu-report.md").read_text()
    for heading in ("## correctness", "## speed", "## dispatch", "## planner", "## determinism"):
        assert heading in md, md


@pytest.mark.nightly  # 9 s of waiting on a hung part: make test-all
def test_a_part_over_its_budget_is_reported_and_the_next_part_runs(tmp_path):
    # the dispatch part hangs (a test hook) and is killed at its 8 s + 1.6 s of grace; the
    # planner then runs on what is left (about 5 s: it takes 2), finds no speed results and
    # says so
    hang = {gpu_check.HANG_FOR_TESTS: "dispatch"}
    proc, report, _ = _run(tmp_path, "--budget", "16", "--parts", "dispatch,planner", env=hang)
    assert proc.returncode == 1
    assert report["parts"]["dispatch"]["status"] == "timeout"
    assert "ran over its budget" in report["parts"]["dispatch"]["error"]
    assert report["parts"]["planner"]["status"] == "skipped", report["parts"]["planner"]
    assert "TIMEOUT" in (tmp_path / "gpu-report.md").read_text()


def test_sizes_scale_with_the_budget():
    full = gpu_check.settings_for(480, cpu=False)
    half = gpu_check.settings_for(240, cpu=False)
    assert full["model"]["n_layers"] == 18 and full["device"] == "cuda"
    assert half["model"]["n_layers"] == 9 and half["steps"] < full["steps"]
    from examples.llama import LlamaConfig

    params = LlamaConfig(**full["model"]).num_params()
    assert 0.9e9 < params < 1.1e9, params  # the "~1B" the report claims


def test_nothing_a_part_starts_outlives_it(tmp_path):
    """A grandchild in a session of its own (as torchrun starts its workers) is killed when
    its parent runs over, and the call returns at the deadline, not when the grandchild ends.
    (In a process of its own: ``_procs.run`` makes its caller a child subreaper.)"""
    marker = tmp_path / "pid"
    grandchild = (
        "import os, time; open(os.environ['MARK'], 'w').write(str(os.getpid())); time.sleep(60)"
    )
    child = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}], start_new_session=True); "
        "time.sleep(60)"
    )
    caller = (
        "import sys, time; from benchmarks import _procs; t0 = time.monotonic(); "
        f"rc, _ = _procs.run([sys.executable, '-c', {child!r}], 3.0); "
        "print(rc, round(time.monotonic() - t0, 1))"
    )
    env = dict(os.environ, MARK=str(marker), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", caller], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    rc, seconds = out.stdout.split()
    assert rc == "None" and float(seconds) < 15, out.stdout + out.stderr
    assert not Path(f"/proc/{int(marker.read_text())}").exists()
