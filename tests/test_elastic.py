"""Elastic resume under torchrun's own agents: a node dies at world size 4, the job comes back
at world size 3 from the newest checkpoint, resharded on load, and goes on as a run started
at world size 3 from that checkpoint would.

Four ``torchrun --nnodes=3:4`` agents (one worker each) meet at a c10d rendezvous on this
machine. Once the step-4 checkpoint is committed the test ends one node: it SIGKILLs an agent
(not the one hosting the rendezvous store) and then its worker, by pid. Killing the worker
alone would not shrink the job: its agent is alive, restarts it and the job comes back at
world size 4. The three workers left fail in their next collective, their agents restart them,
the rendezvous closes its next round at three nodes (``--nnodes`` minimum) and the new workers
resume from the newest committed checkpoint at world size 3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found.update(int(c) for c in (task / "children").read_text().split())
    except OSError:  # the process is gone
        pass
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_elastic_job(
    directory: Path, *, steps: int, every: int, timeout_s: float = 480.0
) -> tuple[list[dict], list[int], list[int]]:
    """Run the 4-agent job, end one node once the job has logged step ``every`` at world
    size 4 (so the step-``every`` checkpoint is committed), wait for the rest.

    Returns (loss-log lines, surviving agents' exit codes, every pid this started or saw).
    Every process is gone on return, whatever happened.
    """
    port = _free_port()
    log = directory / "loss.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # pytorch/pytorch#135712, see README
    script = [str(ROOT / "examples" / "train_gpt.py"), "--data", str(ROOT / "README.md")]
    script += MODEL + ["--steps", str(steps), "--log-every", "1", "--loss-log", str(log)]
    script += ["--checkpoint-dir", str(directory / "ckpt"), "--checkpoint-every", str(every)]
    agents: list[subprocess.Popen] = []
    seen: set[int] = set()
    try:
        for i in range(4):
            conf = (
                f"is_host={int(i == 0)},last_call_timeout=3,keep_alive_interval=1,read_timeout=300"
            )
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=3:4"]
            cmd += ["--nproc-per-node=1", "--max-restarts=2", "--monitor-interval=0.1"]
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
            cmd += ["--rdzv-id=elastic-test", f"--rdzv-conf={conf}", *script]
            out = open(directory / f"agent{i}.log", "w")  # noqa: SIM115 - closed by Popen's owner
            agents.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
            out.close()
        seen.update(a.pid for a in agents)
        deadline = time.monotonic() + timeout_s
        victim = agents[3]
        while not _logged(log, every, 4):
            seen.update(_children(victim.pid))
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                raise AssertionError(f"no first checkpoint: {_tails(directory)}")
            time.sleep(0.02)
        workers = _children(victim.pid)
        assert len(workers) == 1, workers
        _kill(victim.pid)  # the node goes: its agent first, so nothing restarts its worker
        for w in workers:
            _kill(w)
        victim.wait(timeout=10)
        survivors = agents[:3]
        while any(a.poll() is None for a in survivors):
            for a in survivors:
                seen.update(_children(a.pid))
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not finish in {timeout_s}s: {_tails(directory)}")
            time.sleep(0.05)
        codes = [a.returncode for a in survivors]
    finally:
        for a in agents:  # on failure: end the agents, then any worker that outlived them
            if a.poll() is None:
                seen.update(_children(a.pid))
                a.kill()
                a.wait(timeout=10)
        for pid in seen:
            if _alive(pid):
                _kill(pid)
    lines = [json.loads(s) for s in log.read_text().splitlines()] if log.is_file() else []
    return lines, codes, sorted(seen)


def _logged(log: Path, step: int, world_size: int) -> bool:
    try:
        lines = [json.loads(s) for s in log.read_text().splitlines() if s.endswith("}")]
    except FileNotFoundError:
        return False
    return any(x["step"] == step and x["world_size"] == world_size for x in lines)


def segments(lines: list[dict]) -> list[list[dict]]:
    """The log cut into runs of one world size with consecutive steps (one per restart)."""
    out: list[list[dict]] = []
    for x in lines:
        last = out[-1][-1] if out else None
        if last and x["world_size"] == last["world_size"] and x["step"] == last["step"] + 1:
            out[-1].append(x)
        else:
            out.append([x])
    return out


def _tails(directory: Path) -> str:
    return "".join(
        f"\n----- {p.name} -----\n" + p.read_text()[-3000:] for p in sorted(directory.glob("*.log"))
    )


def _reference(directory: str, steps: int) -> None:
    """The uninterrupted run: train_gpt's own loop, at this pool's world size, from the
    checkpoint in ``directory``."""
    from examples import train_gpt

    argv = ["--data", str(ROOT / "README.md"), *MODEL, "--steps", str(steps)]
    argv += ["--log-every", "1", "--checkpoint-dir", directory]
    argv += ["--loss-log", str(Path(directory) / "loss.jsonl"), "--resume"]
    train_gpt.train(train_gpt.parse_args(argv))


def elastic_and_reference(directory: Path, steps: int = 20, every: int = 4):
    """The elastic job, checked, and the reference run from the checkpoint it resumed.

    Returns (every logged line, the ws 4 run that was killed, the ws 3 run that resumed, the
    reference run's lines).
    """
    lines, codes, pids = run_elastic_job(directory, steps=steps, every=every)
    assert codes == [0, 0, 0], _tails(directory)
    assert not [p for p in pids if _alive(p)]
    # [ws 3 from step 0 when the first round closed before the 4th agent came, then] ws 4
    # from the start or a checkpoint, killed; ws 3 from the newest checkpoint to the end
    *_, before, after = segments(lines)
    assert before[0]["world_size"] == 4 and after[0]["world_size"] == 3, lines
    resumed_at = after[0]["step"]
    assert resumed_at % every == 0 and every <= resumed_at <= before[-1]["step"] + 1, lines
    assert after[-1]["step"] == steps - 1, lines

    ref = directory / "reference"
    name = f"step-{resumed_at:06d}"
    shutil.copytree(directory / "ckpt" / name, ref / name)
    run_on_ranks(3, _reference, timeout_s=300, directory=str(ref), steps=steps)
    reference = [json.loads(s) for s in (ref / "loss.jsonl").read_text().splitlines()]
    return lines, before, after, reference


@pytest.mark.nightly  # torchrun restarts: make test-all runs it
@pytest.mark.timeout(600)  # about 40 s alone; 11 torch imports on a loaded machine take long
def test_killed_node_resumes_at_world_size_3_as_a_run_from_the_checkpoint(tmp_path):
    lines, before, after, reference = elastic_and_reference(tmp_path)
    assert [(x["step"], x["loss"]) for x in after] == [(x["step"], x["loss"]) for x in reference]
    # the curve goes on: the first resumed loss is near the losses the original run logged
    # around that step (other samples, so not equal), below the untrained start (ln 256)
    resumed_at = after[0]["step"]
    near = [x["loss"] for x in before if abs(x["step"] - resumed_at) <= 2]
    assert abs(after[0]["loss"] - sum(near) / len(near)) < 0.2, (after[0], near)
    assert after[0]["loss"] < lines[0]["loss"], (after[0], lines[0])


if __name__ == "__main__":  # the loss table: python -m tests.test_elastic [DIR]
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from tests import harness

    d = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    d.mkdir(parents=True, exist_ok=True)
    try:
        lines, before, after, reference = elastic_and_reference(d)
    finally:
        harness.shutdown_all()
    table = Table(title="elastic resume: losses by step")
    for col in ("step", "ws 4 (killed)", "ws 3 (resumed)", "ws 3 reference", "equal"):
        table.add_column(col, justify="right")
    by = [{x["step"]: x["loss"] for x in run} for run in (before, after, reference)]
    for step in sorted(set().union(*by)):
        a, b, c = (f"{m[step]:.6f}" if step in m else "" for m in by)
        same = "yes" if step in by[1] and by[1][step] == by[2].get(step) else ""
        table.add_row(str(step), a, b, c, same)
    Console().print(table)
