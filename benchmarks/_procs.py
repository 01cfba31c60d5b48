"""Child processes with a time limit that leave nothing behind (the GPU check's parts).

``torchrun`` starts each worker in a session of its own, so killing a process group misses
them; a worker whose parent died is re-parented and keeps the GPU. Here a process that runs
children first becomes a *child subreaper* (Linux ``prctl``): orphans below it are re-parented
to it, not to init. After a child ends - by itself or killed at its deadline - every process
still below this one is killed (its whole tree, collected before the first signal) and reaped.
Output goes to a file, never a pipe, so a surviving grandchild cannot block the read.

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
    """``{pid: parent pid}`` of every process visible in /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first."""
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def kill_below(pid: int | None = None) -> int:
    """SIGKILL every process below ``pid`` (default: this process) and reap those that
    are this process's children; returns how many were killed."""
    pid = os.getpid() if pid is None else pid
    victims = descendants(pid)
    for p in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    for p in victims:  # reap our own children (orphans re-parented to us included)
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                break  # not our child, or already reaped
            if done:
                break
            time.sleep(0.01)
    return len(victims)


def run(cmd: list, timeout: float, *, env=None, cwd=None, log=None) -> tuple[int | None, str]:
    """Run ``cmd`` for at most ``timeout`` seconds; ``(exit code, or None when it ran over;
    the last 3,000 characters of its output)``. Its output is appended to ``log`` (an open
    text file) when given. Nothing it started survives the call."""
    become_subreaper()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            rc = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            rc = None
        kill_below()  # the child if it ran over, and whatever it left behind either way
        with contextlib.suppress(ChildProcessError):
            proc.wait()
        out.seek(0)
        text = out.read()
    if log is not None:
        log.write(text)
        log.flush()
    return rc, text[-3000:]
