"""The flight recorder: which rank fell out of step, on which collective.

Every collective this library issues is noted here (``dtensor.debug.record`` and
``dtensor.debug.note_collective`` call :func:`note`) with a per-group sequence number and a
short description: the op, the mesh dim, the group size, the bytes this rank contributes,
and the scope it ran in (``dtensor.debug.collective_scope``: fsdp2 names the module whose
parameters move). The last ``entries`` notes of each group are kept in a ring, on any
backend, gloo included.

[Note: the flight recorder's side channel] The main thread only appends to the ring and
folds the description into a running CRC of the group's sequence (a few hundred
nanoseconds). One daemon thread per process does the rest, every ``poll`` seconds, over the
default group's c10d store (a separate client: a collective blocked in gloo does not block
it):

* it publishes this rank's state (per group: sequence number, running CRC, the last few
  entries) when it changed since the last poll - coalesced, never per collective;
* it compares this rank's state with the next member's in each of its groups (one read per
  group and poll, so the store's load grows linearly with the world size): equal sequence
  numbers with different CRCs mean the ranks issued different collectives (gloo may have
  paired them silently, same size, different meaning); different sequence numbers that have
  not moved for ``timeout`` seconds mean a rank is behind (it skipped a collective, sleeps,
  or is stuck) while the others wait;
* either finding becomes a verdict: the ranks' published entries are read, the rank that is
  behind or ahead and the first sequence number where descriptions differ are named, the
  verdict is written to the store, logged, and the process ends with exit code
  ``EXIT_CODE`` (75). Every other rank's thread sees the verdict at its next poll, logs it
  and its own last entries, and ends the same way. A wait inside gloo cannot be interrupted
  from Python, and a rank that paired mismatched collectives holds wrong data, so the
  process ends with ``os._exit`` (logging handlers flushed first) rather than raising.

A collective that raises (a peer died, gloo's own timeout) goes through :func:`failing`: the
error keeps its type, gains a note with the same analysis (and which peers on this host are
no longer running), and the analysis is logged.

Collectives inside a compiled graph run outside Python and are not noted; a group that has
had one traced (:func:`untracked`) is no longer compared between ranks (its counts may
differ legitimately: one rank compiled, another fell back to eager).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
import zlib
from collections import Counter, deque
from datetime import timedelta

import torch.distributed as dist

from device_mesh.switches import env_switch

logger = logging.getLogger("dtensor.flight")

EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: the job should be restarted (elastically)
ENV_TIMEOUT = "DTENSOR_COLLECTIVE_TIMEOUT"
ENV_RECORDER = "DTENSOR_FLIGHT_RECORDER"
ENV_ENTRIES = "DTENSOR_FLIGHT_ENTRIES"
DEFAULT_ENTRIES = 64
_PUBLISHED = 16  # entries per group in the published state
_PREFIX = "dtensor_flight/"
_VERDICT = "verdict"
_ACKS = "verdict_acks"


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("0", "off", "false", "no"):
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{name}={os.environ[name]!r}: expected a number of seconds (0 or 'off' turns "
            "the collective watchdog off)."
        ) from None
    if value < 0:
        raise ValueError(f"{name}={os.environ[name]!r}: the timeout cannot be negative.")
    return value


def _env_entries() -> int:
    raw = os.environ.get(ENV_ENTRIES, "").strip()
    if not raw:
        return DEFAULT_ENTRIES
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV_ENTRIES}={raw!r}: expected a whole number of entries >= 1.")
    return int(raw)


class _Config:
    enabled = env_switch(ENV_RECORDER, default=True)
    timeout: float | None = _env_float(ENV_TIMEOUT, None)  # None: the default group's
    entries = _env_entries()


class _Group:
    """One process group's record on this rank."""

    __slots__ = ("ref", "name", "ranks", "seq", "crc", "ring", "untracked")

    def __init__(self, group, name: str, ranks: tuple[int, ...], entries: int) -> None:
        self.ref = weakref.ref(group)
        self.name = name
        self.ranks = ranks
        self.seq = 0
        self.crc = 0
        self.ring: deque = deque(maxlen=entries)
        self.untracked = False


# entry: (seq, kind, label, group_size, nbytes, scope, crc after it, wall time)
_by_id: dict[int, _Group] = {}
_groups: dict[str, _Group] = {}
_world = None  # weakref to the default group the records belong to
_local = threading.local()  # .scope: per thread (async_save's thread has none of training's)
_version = 0  # bumped by every note; the publisher compares it
_lock = threading.Lock()  # group creation and resets (not the per-note path)
_watchdog: _Watchdog | None = None
_ending = threading.Event()  # a verdict was reached: the watchdog is ending the process


def set_scope(scope: str | None) -> str | None:
    """Set the scope this thread's later notes carry; returns the previous one."""
    prev = getattr(_local, "scope", None)
    _local.scope = scope
    return prev


def current_scope() -> str | None:
    """The scope this thread's notes carry now."""
    return getattr(_local, "scope", None)


def _resolve(group) -> _Group | None:
    if group is None:
        group = dist.group.WORLD
        if group is None:
            return None
    g = _by_id.get(id(group))
    if g is not None and g.ref() is group:
        return g
    return _new_group(group)


def _new_group(group) -> _Group | None:
    global _world
    with _lock:
        world = dist.group.WORLD
        if world is None:
            return None
        if _world is None or _world() is not world:  # a new default group: a new record
            _by_id.clear()
            _groups.clear()
            _world = weakref.ref(world)
        try:
            name = str(group.group_name)
            ranks = tuple(dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError, AttributeError):
            return None
        g = _groups.get(name)
        if g is None or g.ref() is not group:
            g = _Group(group, name, ranks, _Config.entries)
            _groups[name] = g
        _by_id[id(group)] = g
    _ensure_watchdog()
    return g


def note(kind: str, label, group_size: int, nbytes: int, group) -> None:
    """Record one collective on ``group`` (None: the default group)."""
    global _version
    if not _Config.enabled:
        return
    g = _resolve(group)
    if g is None:
        return
    seq = g.seq + 1
    scope = getattr(_local, "scope", None)
    crc = zlib.crc32(f"{kind}|{label}|{group_size}|{scope}".encode(), g.crc)
    g.seq, g.crc = seq, crc
    g.ring.append((seq, kind, label, group_size, nbytes, scope, crc, time.time()))
    _version += 1


def untracked(group) -> None:
    """Mark ``group`` as having collectives the recorder cannot see (a compiled graph's)."""
    global _version
    if not _Config.enabled:
        return
    g = _resolve(group)
    if g is not None and not g.untracked:
        g.untracked = True
        _version += 1


def entries(group=None) -> list[tuple]:
    """This rank's recorded entries of ``group`` (None: the default group), oldest first."""
    g = _resolve(group)
    return list(g.ring) if g is not None else []


# --------------------------------------------------------------------------- descriptions
def _bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def describe(entry: tuple) -> str:
    """``#42 all_gather(dp, 2 ranks, 1.2 MB, fsdp layers.3)``."""
    seq, kind, label, size, nbytes, scope, _crc, _t = entry
    where = f", {scope}" if scope else ""
    dim = f"dim {label}" if isinstance(label, int) else str(label)
    return f"#{seq} {kind}({dim}, {size} ranks, {_bytes(nbytes)}{where})"


def _group_label(name: str, ranks) -> str:
    shown = ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")
    return f"group {name} (ranks {shown})"


def _snapshot() -> dict:
    """This rank's state as published: per group, (ranks, seq, crc, untracked, entries)."""
    groups = {}
    for name, g in list(_groups.items()):
        ring = list(g.ring)  # one C call: consistent under the GIL
        seq, crc = (ring[-1][0], ring[-1][6]) if ring else (0, 0)
        groups[name] = (g.ranks, seq, crc, g.untracked, ring[-_PUBLISHED:])
    return {"pid": os.getpid(), "host": socket.gethostname(), "groups": groups, "t": time.time()}


def encode_state(state: dict) -> bytes:
    """A published state as JSON bytes: data a peer reads, never code (no pickle).

    Example:
        >>> decode_state(encode_state(_snapshot())) == _snapshot()   # at rest
    """
    return json.dumps(state, separators=(",", ":")).encode()


def decode_state(raw: bytes) -> dict:
    """``encode_state``'s bytes back as the state, its tuples tuples again.

    Raises:
        ValueError: bytes that are not a published state.
    """
    try:
        state = json.loads(raw)
        state["groups"] = {
            name: (tuple(ranks), seq, crc, untracked, [tuple(e) for e in entries])
            for name, (ranks, seq, crc, untracked, entries) in state["groups"].items()
        }
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"a peer's published flight-recorder state is not readable: {e}") from None
    return state


def _crc_at(state_groups: dict, name: str, seq: int):
    """The running CRC after entry ``seq`` of group ``name`` in a published state, or None."""
    item = state_groups.get(name)
    if item is None:
        return None
    if seq == 0:
        return 0
    for e in item[4]:
        if e[0] == seq:
            return e[6]
    return None


def analyse(name: str, states: dict[int, dict | None], *, now: float | None = None) -> str:
    """What the members' published states of group ``name`` say: who is behind or ahead,
    and where their descriptions first differ. ``states`` maps each member's global rank
    to its published state (None: it never published)."""
    now = time.time() if now is None else now
    ranks = sorted(states)
    label = _group_label(name, ranks)
    silent = [r for r in ranks if states[r] is None or name not in states[r]["groups"]]
    known = {r: states[r]["groups"][name] for r in ranks if r not in silent}
    lines = []
    if silent:
        lines.append(
            f"rank(s) {silent} published no record of {label}: they never issued a "
            "collective on it, or died before publishing"
        )
    if not known:
        return f"{label}: " + "; ".join(lines)
    seqs = {r: item[1] for r, item in known.items()}

    def last(r: int) -> str:
        ring = known[r][4]
        if not ring:
            return "no collective yet"
        e = ring[-1]
        return f"{describe(e)} {max(0.0, now - e[7]):.1f} s ago"

    counts = Counter(seqs.values())
    if len(counts) > 1:
        # the most common sequence number is the step the group is at; ties: the highest,
        # since those ranks wait for the others
        top = max(counts.values())
        consensus = max(s for s, c in counts.items() if c == top)
        behind = sorted(r for r, s in seqs.items() if s < consensus)
        ahead = sorted(r for r, s in seqs.items() if s > consensus)
        at = sorted(r for r, s in seqs.items() if s == consensus)
        at_desc = last(at[0])
        for r in behind:
            lines.append(
                f"rank {r} is behind: its last collective on {label} was {last(r)}; "
                f"rank(s) {at} issued {at_desc}"
            )
        for r in ahead:
            lines.append(f"rank {r} is ahead: it issued {last(r)}; rank(s) {at} are at {at_desc}")
    diverge = _first_divergence(name, known)
    if diverge is not None:
        lines.append(diverge)
    if not lines:
        lines.append(f"every member of {label} is at {last(ranks[0])}; no difference found")
    return "; ".join(lines)


def _first_divergence(name: str, known: dict) -> str | None:
    """The first sequence number (within the published entries) where members' running
    CRCs differ, with each member's description there."""
    common = min(item[1] for item in known.values())
    ranks = sorted(known)
    label = _group_label(name, ranks)
    first = None
    low = max((item[4][0][0] if item[4] else 1) for item in known.values())
    for seq in range(max(low, 1), common + 1):
        crcs = {r: _crc_at({name: known[r]}, name, seq) for r in ranks}
        if None in crcs.values():
            continue
        if len(set(crcs.values())) > 1:
            first = seq
            break
    if first is None:
        crcs = {r: _crc_at({name: known[r]}, name, common) for r in ranks}
        if None not in crcs.values() and len(set(crcs.values())) > 1:
            return f"ranks diverge on {label} before #{common} (older than the entries kept)"
        return None
    parts = []
    for r in ranks:
        e = next(e for e in known[r][4] if e[0] == first)
        parts.append(f"rank {r} {describe(e)}")
    return f"ranks diverge at #{first} on {label}: " + ", ".join(parts)


def _dead_peers(states: dict[int, dict | None], wait: float = 0.0) -> list[str]:
    """Members on this host whose process is no longer running. ``wait``: look again for
    that long (a peer whose connection just closed may still be exiting)."""
    here = socket.gethostname()
    peers = {
        r: st["pid"]
        for r, st in states.items()
        if st is not None and st.get("host") == here and st["pid"] != os.getpid()
    }
    deadline = time.monotonic() + wait
    while True:
        gone = sorted(r for r, pid in peers.items() if not _running(pid))
        if gone or time.monotonic() >= deadline:
            return [f"rank {r} (pid {peers[r]}) is no longer running" for r in gone]
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, dead but not yet reaped by its
    parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _own_entries(names) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = []
    for name in names:
        g = _groups.get(name)
        if g is None:
            continue
        ring = list(g.ring)
        shown = "\n    ".join(describe(e) for e in ring) or "(none)"
        lines.append(f"rank {rank}'s last {len(ring)} collectives on group {name}:\n    {shown}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the watchdog
def _ensure_watchdog() -> None:
    global _watchdog
    if _Config.timeout == 0 or not dist.is_initialized():
        return
    w = _watchdog
    if w is not None and w.world() is dist.group.WORLD and w.is_alive():
        return
    if w is not None:
        w.stop()
    try:
        _watchdog = _Watchdog()
    except Exception as e:  # no store to talk over (a fake or single-process group)
        logger.debug("flight recorder: no watchdog (%s)", e)
        _watchdog = None
        return
    _watchdog.start()


def _default_store():
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    try:
        store = store.clone()  # its own connection: never queued behind the main thread's
    except (AttributeError, RuntimeError, NotImplementedError):
        pass
    return store


class _Watchdog(threading.Thread):
    """Publishes this rank's state, compares it with the next members', ends the job on a
    verdict ([Note: the flight recorder's side channel])."""

    def __init__(self) -> None:
        super().__init__(name="dtensor-flight-recorder", daemon=True)
        world = dist.group.WORLD
        self.world = weakref.ref(world)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        store = _default_store()
        timeout = _Config.timeout
        if timeout is None:  # the default group's timeout (its store was given the same)
            timeout = store.timeout.total_seconds()
        self.store = dist.PrefixStore(_PREFIX, store)
        self.store.set_timeout(timedelta(seconds=max(2.0, min(timeout, 10.0))))
        self.timeout = timeout
        self.poll = min(1.0, max(0.05, timeout / 8))
        self.published = -1
        self.last_read: dict[int, dict] = {}  # peers' states as last read (the store may die)
        self._decoded: dict[int, tuple] = {}  # rank -> (bytes, state): one store, one pair
        self.since: dict[tuple, float] = {}  # (group, my seq, peer, its seq) -> first seen
        self._halt = threading.Event()
        self.publish()  # at once: peers can name this process (pid, host) even if it dies soon

    def stop(self) -> None:
        self._halt.set()
        self.name = "dtensor-flight-recorder (stopping)"  # ends within a poll

    def run(self) -> None:
        failures = 0
        while not self._halt.wait(self.poll):
            if self.world() is not dist.group.WORLD:
                return  # the default group was destroyed: this record is over
            try:
                self.step()
                failures = 0
            except Exception as e:  # the store went away (its host ended or died)
                if not dist.is_initialized():
                    return
                failures += 1
                if failures == 3:  # nothing left to compare with: a rank's collectives fail
                    logger.info("flight recorder: the c10d store is gone (%s); watchdog stops", e)
                    return

    def publish(self) -> None:
        v = _version
        if v != self.published:
            self.store.set(f"state/{self.rank}", encode_state(_snapshot()))
            self.published = v

    def step(self) -> None:
        self.publish()
        if self.store.check([_VERDICT]):
            self.end(self.store.get(_VERDICT).decode(), source="peer")
        mine = _snapshot()["groups"]
        peers: dict[int, dict | None] = {}
        now = time.monotonic()
        seen = set()
        for name, (ranks, seq, _crc, untracked_, _ring) in mine.items():
            if len(ranks) < 2 or self.rank not in ranks:
                continue
            nxt = ranks[(ranks.index(self.rank) + 1) % len(ranks)]
            if nxt not in peers:
                peers[nxt] = self.read(nxt)
            st = peers[nxt]
            if st is None or name not in st["groups"]:
                continue
            _r, pseq, pcrc, puntracked, pring = st["groups"][name]
            if untracked_ or puntracked:
                continue
            low = min(seq, pseq)
            a = _crc_at(mine, name, low)
            b = _crc_at(st["groups"], name, low)
            if a is not None and b is not None and a != b:
                self.verdict(name, ranks, "collectives differ between ranks")
            if seq != pseq:
                key = (name, seq, nxt, pseq)
                seen.add(key)
                first = self.since.setdefault(key, now)
                if now - first >= self.timeout:
                    self.verdict(name, ranks, f"no progress on the group for {now - first:.1f} s")
        self.since = {k: t for k, t in self.since.items() if k in seen}

    def read(self, rank: int) -> dict | None:
        key = f"state/{rank}"
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        known = self._decoded.get(rank)
        if known is not None and known[0] == raw:  # unchanged (a rank at rest): the same
            state = known[1]  # objects, not a new copy every poll
        else:
            try:
                state = decode_state(raw)
            except ValueError as e:  # read as not published; said once per value
                if self._decoded.get(rank, (None,))[0] != raw:
                    logger.warning("flight recorder: rank %d: %s", rank, e)
                self._decoded[rank] = (raw, None)
                return None
            self._decoded[rank] = (raw, state)  # the watchdog and a failure report both read
        self.last_read[rank] = state
        return state

    def verdict(self, name: str, ranks, why: str) -> None:
        self.publish()
        states = {r: self.read(r) for r in ranks}
        report = (
            f"collective watchdog (timeout {self.timeout:g} s): {why} on "
            f"{_group_label(name, list(ranks))}: {analyse(name, states)}"
        )
        dead = _dead_peers(states)
        if dead:
            report += "; " + "; ".join(dead)
        try:
            self.store.compare_set(_VERDICT, "", report)
            report = self.store.get(_VERDICT).decode()  # the first verdict wins everywhere
        except Exception:
            pass
        self.end(report, source="self", names=[name])

    def wait_for_peers(self) -> None:
        """Give the other ranks a few polls to read the verdict before this process (which
        may host the store) ends: each adds one to a counter when it has."""
        deadline = time.monotonic() + 3 * self.poll + 1.0
        while time.monotonic() < deadline:
            if self.store.add(_ACKS, 0) >= self.world_size:
                return
            time.sleep(self.poll / 4)

    def end(self, report: str, *, source: str, names=None) -> None:
        _ending.set()
        names = list(_groups) if names is None else names
        logger.error(
            "rank %d: %s\n%s\nending this process with exit code %d (a collective blocked "
            "in the backend cannot be cancelled).",
            self.rank,
            report,
            _own_entries(names),
            EXIT_CODE,
        )
        _flush_logs()
        try:
            self.store.add(_ACKS, 1)
            self.wait_for_peers()
        except Exception:  # the store is gone: nobody left to wait for
            pass
        os._exit(EXIT_CODE)


def _flush_logs() -> None:
    for h in [*logging.getLogger().handlers, *logger.handlers]:
        try:
            h.flush()
        except Exception:
            pass
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except Exception:
            pass


# --------------------------------------------------------------------------- on failure
def failure_report(names=None) -> str:
    """The analysis of this rank's groups from the peers' published states (for a
    collective that raised). Never raises: a store that is gone is said so, and the states
    last read from it are used."""
    names = [n for n in (_groups if names is None else names) if n in _groups]
    w = _watchdog
    if w is None:
        return "no peer states (the watchdog is off)"
    members = sorted({r for n in names for r in _groups[n].ranks if len(_groups[n].ranks) > 1})
    states_all: dict[int, dict | None] = {}
    source = f"as last published (every {w.poll:g} s)"
    try:
        w.publish()
        for r in members:
            states_all[r] = w.read(r)
    except Exception as e:
        states_all = {r: w.last_read.get(r) for r in members}
        states_all[w.rank] = _snapshot()
        source = (
            f"the c10d store is unreachable ({type(e).__name__}; the process hosting it, "
            "rank 0 or the launcher, may have died), so as last read"
        )
    parts = _dead_peers(states_all, wait=0.5)
    for name in names:
        ranks = _groups[name].ranks
        if len(ranks) > 1:
            states = {r: states_all.get(r) for r in ranks}
            parts.append(f"{_group_label(name, list(ranks))}, {source}: {analyse(name, states)}")
    return "; ".join(parts)


class failing:
    """``with failing():`` around a wait on a collective: an error from it gains a note
    with the flight recorder's analysis (and the analysis is logged)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not _Config.enabled or not isinstance(exc, RuntimeError):
            return False
        if getattr(exc, "_flight_noted", False):
            return False
        if _ending.is_set():  # the watchdog ends the process with the verdict, exit code 75
            time.sleep(60.0)
        report = failure_report()
        try:
            exc.add_note(f"flight recorder: {report} (this rank's last collectives: its log)")
            exc._flight_noted = True
        except (AttributeError, TypeError):
            pass
        logger.error(
            "a collective failed (%s): %s\n%s",
            exc_type.__name__,
            report,
            _own_entries(list(_groups)),
        )
        return False


FAILING = failing()


def configure(*, timeout=..., enabled=None, entries=None) -> None:
    """Change the recorder's settings (``dtensor.debug.set_*``); the watchdog restarts."""
    global _watchdog
    if enabled is not None:
        _Config.enabled = enabled
    if entries is not None and entries != _Config.entries:
        _Config.entries = entries
        for g in _groups.values():
            g.ring = deque(g.ring, maxlen=entries)
    if timeout is not ...:
        _Config.timeout = timeout
    w, _watchdog = _watchdog, None
    if w is not None:
        w.stop()
    if _Config.enabled and _groups:
        _ensure_watchdog()
