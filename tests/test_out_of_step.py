"""Fault injection: a rank out of step is named, and a rank that dies or raises ends the job.

Each test starts a small FSDP training job (tests/_faults.py) in child processes of its own
(a forkserver that has imported torch once, so a world starts in well under a second),
makes rank 1 misbehave once at step 2, and checks that every process ends non-zero within
a bound, that none is left running, and what the surviving ranks logged: the rank out of
step and its collective, or the rank that died. The flight recorder's watchdog runs with a
2 s timeout. How long each rank took from the fault to its exit is recorded as a test
property (``pytest --junitxml``): ``detect_s_rank{r}``.

The full matrix (every fault, 3 ranks, torchrun) is marked slow and runs only with
``FAULTS_FULL=1`` in the environment; ``make test`` runs a sample: a skipped FSDP all-gather, a different collective, a sleeping
rank, a killed rank and a kill inside ``dtensor.checkpoint.save``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtensor import debug
from tests import _faults

TIMEOUT_S = 2.0
# a generous bound on a job's whole life on this shared 2-core machine (the detection
# itself takes about TIMEOUT_S; the figures are recorded, not asserted)
DEADLINE_S = 90.0
EXIT = debug.FLIGHT_EXIT_CODE

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "fsdp2", "dtensor.checkpoint", "tests._faults"])
    return _CTX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(fault: str, outdir: Path, world: int = 2):
    """Run the job; return (exit codes, {rank: seconds from the fault to its exit}, logs)."""
    ctx = _context()
    port = _free_port()
    procs = [
        ctx.Process(target=_faults.worker, args=(r, world, port, fault, str(outdir), TIMEOUT_S))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    ended: dict[int, float] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(ended) < world and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.time()
            time.sleep(0.02)
    finally:
        left = [p.pid for p in procs if p.is_alive()]
        for p in procs:  # only the processes this test started, by handle
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    assert not left, f"{fault}: processes {left} still running after {DEADLINE_S:.0f} s"
    fault_file = outdir / "fault_time"
    detect = {}
    if fault_file.exists():
        t_fault = float(fault_file.read_text())
        detect = {r: round(t - t_fault, 3) for r, t in ended.items()}
    logs = {r: _read(outdir / f"rank{r}.log") for r in range(world)}
    return [p.exitcode for p in procs], detect, logs


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _record(record_property, detect: dict) -> None:
    for r, s in detect.items():
        record_property(f"detect_s_rank{r}", s)


# fault -> (text every surviving rank must log, the survivors' exit codes allowed)
OUT_OF_STEP = {
    # gloo paired rank 0's all-gather of blocks.0 with rank 1's of blocks.1 (same size)
    "skip_all_gather": (["ranks diverge at #", "rank 0 #", "fsdp blocks.0", "rank 1 #"], {EXIT}),
    "other_collective": (
        ["ranks diverge at #", "all_gather(dp", "rank 1 #", "all_reduce(dp"],
        {EXIT},
    ),
    "sleep": (["rank 1 is behind: its last collective on group", "rank(s) [0] issued #"], {EXIT}),
    # the loop numbers its steps: rank 1's step 3 met rank 0's step 2 (same sizes)
    "skip_step": (["ranks diverge at #", "step 2)", "step 3)"], {EXIT}),
}
DEATHS = {
    "kill": -signal.SIGKILL,
    "exit": 3,
    "raise_forward": 1,
    "raise_backward": 1,
    "raise_in_collective": 1,
    "kill_in_save": -signal.SIGKILL,
}
FAST = {"skip_all_gather", "other_collective", "sleep", "skip_step", "kill", "kill_in_save"}


# the rest of the matrix: opt-in (FAULTS_FULL=1), as the slow marker does not deselect
FULL = os.environ.get("FAULTS_FULL") == "1"
full_matrix = pytest.mark.skipif(not FULL, reason="the full fault matrix runs with FAULTS_FULL=1")


def _mark(fault: str):
    return () if fault in FAST else (pytest.mark.slow, full_matrix)


@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=_mark(f)) for f in OUT_OF_STEP], ids=list(OUT_OF_STEP)
)
def test_out_of_step_rank_is_named(fault, tmp_path, record_property):
    codes, detect, logs = _run_job(fault, tmp_path)
    _record(record_property, detect)
    expected, allowed = OUT_OF_STEP[fault]
    # every rank caught the verdict as an exception (its handler exits with the watchdog's
    # exit code), having logged it
    assert all(c in allowed for c in codes), (codes, logs)
    for r in (0, 1):
        missing = [e for e in expected if e not in logs[r]]
        assert not missing, f"rank {r} did not log {missing}:\n{logs[r][-3000:]}"
        assert "caught OutOfStepError" in logs[r], logs[r][-3000:]
        assert "ending this process" not in logs[r]  # raised, not ended by a thread
    verdicts = [json.loads((tmp_path / f"verdict-{r}.json").read_text()) for r in (0, 1)]
    assert verdicts[0] == verdicts[1]  # the first verdict wins everywhere
    if fault == "sleep":  # the rank out of step, its collective and module are named
        assert verdicts[0]["rank"] == 1, verdicts[0]
        assert verdicts[0]["collective"].startswith("#"), verdicts[0]
        # its last collective was step 1's checkpoint exchange, which runs in no module
        assert (verdicts[0]["module"] or "") in verdicts[0]["collective"], verdicts[0]
    if fault == "skip_step":  # caught when the next step began, not when the job ran out
        done = {r: int((tmp_path / f"done-{r}").read_text()) for r in (0, 1)}
        assert done[0] <= _faults.FAULT_STEP + 1, done


@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=_mark(f)) for f in DEATHS], ids=list(DEATHS)
)
def test_rank_death_ends_the_job(fault, tmp_path, record_property):
    codes, detect, logs = _run_job(fault, tmp_path)
    _record(record_property, detect)
    assert codes[1] == DEATHS[fault], (codes, logs[1][-3000:])
    assert codes[0] not in (0, None), (codes, logs[0][-3000:])
    # rank 0 says why: the watchdog's verdict or the failed collective's analysis
    if codes[0] != EXIT:
        assert "a collective failed" in logs[0], logs[0][-3000:]
    if DEATHS[fault] < 0 or fault == "exit":  # the process is gone: rank 0 can tell
        assert "rank 1 (pid " in logs[0] and "is no longer running" in logs[0], logs[0][-3000:]
    if fault == "kill_in_save":
        _check_last_checkpoint(tmp_path)


def test_a_rank_that_ran_ahead_is_not_called_behind(tmp_path, record_property):
    """Rank 1 runs an extra forward: its all-gathers meet rank 0's backward, gloo aborts it
    at the first size mismatch (within a second, often before it publishes again), and
    rank 0's report is built from a state up to a poll old. It must say what was seen and
    when, and that rank 1 is gone - not that the rank which ran ahead is "behind"."""
    codes, detect, logs = _run_job("extra_forward", tmp_path)
    _record(record_property, detect)
    assert all(c not in (0, None) for c in codes), (codes, logs)
    assert "rank 1 is behind" not in logs[0], logs[0][-3000:]
    if "caught OutOfStepError" not in logs[0]:  # gloo aborted rank 1 before a verdict
        assert "rank 1 is no longer running; it was last seen " in logs[0], logs[0][-3000:]
        assert "state published " in logs[0], logs[0][-3000:]


@pytest.mark.slow
@full_matrix
def test_a_verdict_no_thread_receives_ends_the_process_after_the_grace(tmp_path):
    """Where the program waits inside the backend (a synchronous collective of its own) or
    sleeps, no wait of ours can raise the verdict: after the grace period (1 s here) the
    watchdog ends the process with the exit code that asks a launcher to restart."""
    codes, _detect, logs = _run_job("blocked", tmp_path)
    assert codes == [EXIT, EXIT], (codes, logs)
    for r in (0, 1):
        assert "no thread received the verdict within 1 s" in logs[r], logs[r][-3000:]
        assert "rank 1 is behind" in logs[r], logs[r][-3000:]


def _check_last_checkpoint(outdir: Path) -> None:
    """The checkpoint the killed save was replacing still loads, with step 1's values."""
    from dtensor import checkpoint as dcp

    expected = torch.load(outdir / "expected-1.pt")
    assert not (outdir / "expected-3.pt").exists()  # the second save never completed
    sd = {"model": _faults._model().state_dict()}
    dcp.load(sd, checkpoint_id=outdir / "ckpt")
    assert sd["model"].keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(sd["model"][k], v), k


@pytest.mark.slow
@full_matrix
def test_three_ranks_one_sleeps(tmp_path, record_property):
    codes, detect, logs = _run_job("sleep", tmp_path, world=3)
    _record(record_property, detect)
    assert codes == [EXIT] * 3, codes
    for r in range(3):
        assert "rank 1 is behind" in logs[r], logs[r][-3000:]


@pytest.mark.slow
@full_matrix
@pytest.mark.parametrize("fault", ["kill", "sleep"])
def test_under_torchrun(fault, tmp_path):
    """torchrun's agent ends the job non-zero and leaves no worker behind."""
    root = Path(__file__).resolve().parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "tests._faults"]
    cmd += [fault, str(tmp_path), str(TIMEOUT_S)]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S * 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out.decode()[-3000:]
    pids = _worker_pids(tmp_path)
    assert pids, "the workers wrote no pid files"
    alive = [p for p in pids if _alive(p)]
    assert not alive, f"workers {alive} outlived torchrun"


def _worker_pids(outdir: Path) -> list[int]:
    return [int(p.read_text()) for p in outdir.glob("pid-*")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------------ the analysis, in-process
def _state(entries, untracked=False):
    """A published state of group "7" (ranks 0-2) from ``[(kind, scope), ...]``."""
    import zlib

    ring, crc = [], 0
    for seq, (kind, scope) in enumerate(entries, 1):
        crc = zlib.crc32(f"{kind}|dp|3|{scope}".encode(), crc)
        ring.append((seq, kind, "dp", 3, 1024, scope, crc, 100.0 + seq))
    seq = ring[-1][0] if ring else 0
    crc = ring[-1][6] if ring else 0
    return {"pid": 1, "host": "h", "groups": {"7": ((0, 1, 2), seq, crc, untracked, ring)}}


def test_analysis_names_the_rank_behind_and_where_ranks_diverge():
    from dtensor import _flight

    step = [("all_gather", "fsdp a"), ("all_gather", "fsdp b"), ("reduce_scatter", "fsdp b")]
    states = {0: _state(step), 1: _state(step[:2]), 2: _state(step)}
    text = _flight.analyse("7", states, now=110.0, stalled=True).text
    assert "rank 1 is behind: its last collective on group 7 (ranks 0,1,2) was #2 " in text
    assert "all_gather(dp, 3 ranks, 1.0 KB, fsdp b)" in text
    assert "rank(s) [0, 2] issued #3 reduce_scatter(dp, 3 ranks, 1.0 KB, fsdp b)" in text
    assert "diverge" not in text

    skipped = [step[1], step[2]]  # rank 2 skipped the all-gather of a: same op, other module
    finding = _flight.analyse(
        "7", {0: _state(step[:2]), 1: _state(step[:2]), 2: _state(skipped)}, now=110.0
    )
    text = finding.text
    assert finding.rank == 2 and finding.entry[5] == "fsdp b"  # the one alone is named
    assert "ranks diverge at #1 on group 7" in text
    assert "rank 0 #1 all_gather(dp, 3 ranks, 1.0 KB, fsdp a)" in text
    assert "rank 2 #1 all_gather(dp, 3 ranks, 1.0 KB, fsdp b)" in text
    assert "behind" not in text

    text = _flight.analyse("7", {0: _state(step), 1: None, 2: _state(step)}, now=110.0).text
    assert "rank(s) [1] published no record of group 7" in text


def test_analysis_says_only_what_is_known():
    """A state is what a rank published, when it did: a rank that died (gloo aborts a rank
    whose collective met one of another size) or a group that has not stalled yet is
    reported as last seen, with the age of what was seen - never "behind" from an old state
    (issue 39: the survivor called the rank that ran ahead "behind")."""
    from dtensor import _flight

    step = [("all_gather", "fsdp a"), ("all_gather", "fsdp b"), ("reduce_scatter", "fsdp b")]
    states = {0: _state(step), 1: _state(step[:2]), 2: _state(step)}
    for r, t in ((0, 109.0), (1, 104.5), (2, 109.0)):
        states[r]["t"] = t
    gone = _flight.analyse("7", states, now=110.0, gone=frozenset({1}), stalled=True)
    assert "behind" not in gone.text and "ahead" not in gone.text, gone.text
    assert "rank 1 is no longer running; it was last seen at #2 all_gather(" in gone.text
    assert "(state published 5.5 s ago)" in gone.text, gone.text
    moving = _flight.analyse("7", states, now=110.0).text  # not stalled: states may be old
    assert "behind" not in moving and "rank 1 was last seen at #2 " in moving, moving
    early = {0: _state(step), 1: _state([]), 2: _state(step)}  # published before collectives
    early[1]["t"] = 100.0
    text = _flight.analyse("7", early, now=110.0, gone=frozenset({1})).text
    assert "no collective yet" not in text
    assert "rank 1 is no longer running; it was last seen before its first collective on group 7 " in text
    assert "(state published 10.0 s ago)" in text, text


class _DictStore:
    """The two calls of a c10d store the watchdog's ``read`` makes, over a dict."""

    def __init__(self):
        self.data = {}

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_an_unchanged_peer_state_is_read_once():
    # a rank at rest publishes the same bytes poll after poll: decoding them each time made
    # new tuples of plain values, which the collector tracks until its next collection (the
    # soak counted them as ~100 objects that came and went)
    from types import SimpleNamespace

    from dtensor import _flight

    store = _DictStore()
    watchdog = SimpleNamespace(store=store, last_read={}, _decoded={})
    step = [("all_gather", "fsdp a"), ("reduce_scatter", "fsdp a")]
    assert _flight._Watchdog.read(watchdog, 1) is None  # nothing published yet
    store.data["state/1"] = _flight.encode_state(_state(step[:1]))
    first = _flight._Watchdog.read(watchdog, 1)
    assert _flight._Watchdog.read(watchdog, 1) is first  # the same objects, not a new copy
    store.data["state/1"] = _flight.encode_state(_state(step))
    second = _flight._Watchdog.read(watchdog, 1)
    assert second is not first and second == _state(step)  # tuples again, as published
    assert watchdog.last_read[1] is second


def test_a_peer_state_is_data_never_code():
    """What a peer published is JSON: bytes that would run code when unpickled are refused
    as unreadable, not executed (issue 39: peer state read from the store is data)."""
    import pickle

    from dtensor import _flight

    assert "import pickle" not in Path(_flight.__file__).read_text()
    with pytest.raises(ValueError, match="state is not readable"):
        _flight.decode_state(pickle.dumps(_state([("all_gather", "x")])))
    with pytest.raises(ValueError, match="state is not readable"):
        _flight.decode_state(b'{"groups": {"7": [1, 2]}}')
    # the watchdog reads such a peer as not published (it goes on watching the others)
    from types import SimpleNamespace

    store = _DictStore()
    store.data["state/1"] = pickle.dumps(_state([("all_gather", "x")]))
    watchdog = SimpleNamespace(store=store, last_read={}, _decoded={})
    assert _flight._Watchdog.read(watchdog, 1) is None


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="expected a number of seconds >= 0 or None"):
        debug.set_collective_timeout(-1)
    with pytest.raises(ValueError, match="entries must be an int >= 1"):
        debug.set_flight_recorder(True, entries=0)


# ------------------------------------------------------------------ in the harness's pool
def _records_fsdp_scopes():
    import threading

    import torch.distributed as dist

    from device_mesh import init_device_mesh
    from fsdp2 import fully_shard

    model = _faults._model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def last_seq():
        entries = debug.flight_record(mesh.get_group())
        return int(entries[-1].split()[0][1:]) if entries else -1

    # the pool's group may have run earlier tests' collectives: its ring can be full already,
    # so progress is read from the sequence numbers, not from the ring's length
    before = last_seq()
    model(torch.randn(4, 32)).sum().backward()
    entries = debug.flight_record(mesh.get_group())
    assert last_seq() > before
    seqs = [int(e.split()[0][1:]) for e in entries]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    text = "\n".join(entries[-12:])
    for what in ("all_gather(", "reduce_scatter(", "fsdp blocks.0", "fsdp blocks.1", "fsdp root"):
        assert what in text, text
    # one watchdog thread per process, however many groups and steps
    names = [t.name for t in threading.enumerate()]
    assert names.count("dtensor-flight-recorder") == 1, names


def test_fsdp_collectives_are_recorded_with_their_module():
    from tests.harness import run_on_ranks

    run_on_ranks(2, _records_fsdp_scopes)


# ------------------------------------------------------------------ waits and step numbers
def test_step_numbers_count_steps_that_communicate_and_follow_the_loop():
    """``new_step()`` numbers, per group, the steps in which the group has a collective (two
    marks with none between are one step; a step on another group does not count here); a
    number from the loop wins from then on; a new default group starts over."""
    import threading
    from types import SimpleNamespace

    from dtensor import _flight

    seen = []

    def thread_body():
        g, other = SimpleNamespace(step=0, epoch=None), SimpleNamespace(step=0, epoch=None)
        _flight.new_step()
        _flight.new_step()  # no collective since the last mark: the same step
        seen.append(_flight._step_for(g))
        seen.append(_flight._step_for(g))  # the step's later collectives
        _flight.new_step()
        seen.append(_flight._step_for(other))  # a step with collectives on another group only
        _flight.new_step()
        seen.append(_flight._step_for(g))
        _flight.new_step(7)  # the loop's own number
        seen.append(_flight._step_for(g))
        _flight.new_step()  # fully_shard's automatic mark: ignored from now on
        seen.append(_flight._step_for(g))
        _flight.new_step(8)
        seen.append(_flight._step_for(g))
        _flight._clear_verdict()  # what a new default group does
        seen.append(_flight._step_for(g))

    t = threading.Thread(target=thread_body)
    t.start()
    t.join()
    assert seen == [1, 1, 1, 2, 7, 7, 8, None], seen


def _a_verdict_interrupts_a_wait():
    import threading
    import time as _time

    import torch.distributed as dist

    from dtensor import _flight

    t = torch.ones(2)
    debug.note_collective("all_reduce", None, 8)  # recorded as user code should: the
    w = _flight._watchdog  # recorder (and its watchdog) are running
    assert w is not None and w.slice is not None, "the pool's gloo waits are sliced"
    if dist.get_rank() == 0:
        work = dist.all_reduce(t, async_op=True)  # rank 1 joins 2 slices later
        _flight._delivered.set()  # (no peer to wait for: this is not the watchdog's verdict)
        verdict = {"report": "test verdict", "rank": 1, "group": "0", "collective": "#1 x"}
        threading.Timer(0.2, lambda: setattr(_flight, "_verdict", verdict)).start()
        start = _time.monotonic()
        with pytest.raises(debug.OutOfStepError) as e:
            _flight.wait(work)
        assert e.value.rank == 1 and e.value.collective == "#1 x", e.value
        assert _time.monotonic() - start < 2 * w.poll + 1.0  # within a slice, not at the end
        _flight._verdict = None  # (else this worker would end at exit; a new world clears it)
        _flight._delivered.clear()
        work.wait()  # the interrupted collective completes when rank 1 joins
    else:
        _time.sleep(2 * w.poll + 0.5)
        dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]


def test_a_verdict_interrupts_a_gloo_wait():
    from tests.harness import run_on_ranks

    run_on_ranks(2, _a_verdict_interrupts_a_wait)
