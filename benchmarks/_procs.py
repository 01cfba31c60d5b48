"""Child processes with a time limit that leave nothing behind (the GPU check's parts).

``torchrun`` starts each worker in a session of its own, so killing a process group misses
them; a worker whose parent died is re-parented and keeps the GPU. Here a process that runs
children first becomes a *child subreaper* (Linux ``prctl``): orphans below it are re-parented
to it, not to init. After a child ends - by itself or killed at its deadline - every process
that appeared below this one since the child started is killed (the whole tree, collected
before the first signal) and waited for. The child's output goes straight to a log file
(append mode, never a pipe), so a part that hangs still leaves its output, and a surviving
grandchild cannot block a read.

Example:
    >>> rc, tail = run([sys.executable, "-c", "print('hi')"], timeout=10)
    >>> rc, tail.strip()
    (0, 'hi')
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36
_subreaper = False


def become_subreaper() -> None:
    """Make orphans below this process its children (Linux; elsewhere a no-op)."""
    global _subreaper
    if _subreaper:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _subreaper = True


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process visible in /proc (empty if it cannot be read)."""
    out = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return out
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first."""
    parents = _parents()
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        found += sorted(frontier)
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def kill_below(keep: set[int] = frozenset()) -> int:
    """SIGKILL every process below this one except ``keep``, wait until they are gone (our
    own children reaped, orphans re-parented to us included); returns how many."""
    victims = [p for p in descendants(os.getpid()) if p not in keep]
    for p in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    for p in victims:
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(p, os.WNOHANG)
            if _gone(p):
                break
            time.sleep(0.01)
    return len(victims)


def run(cmd: list, timeout: float, *, env=None, cwd=None, log_path=None) -> tuple[int | None, str]:
    """Run ``cmd`` for at most ``timeout`` seconds; ``(exit code, or None when it ran over;
    the last 3,000 characters of its output)``. Its output is appended to ``log_path`` when
    given (else to a temporary file). Nothing it started survives the call."""
    become_subreaper()
    keep = set(descendants(os.getpid()))  # what this process ran before: not ours to kill
    with open(log_path, "ab+") if log_path else tempfile.TemporaryFile("ab+") as log:
        start = log.seek(0, os.SEEK_END)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            rc = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            rc = None
            proc.kill()  # first the child itself, even if /proc cannot be read
        kill_below(keep)  # whatever it left behind, either way
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        log.seek(start)
        text = log.read().decode(errors="replace")
    return rc, text[-3000:]
