"""What the flight recorder's published states say: pure functions over them, no I/O.

A published state (``_flight._snapshot``) is ``{"pid", "host", "t", "groups"}`` where
``groups`` maps a group's name to ``(ranks, seq, crc, untracked, entries)`` and an entry is
``(seq, kind, label, group_size, nbytes, scope, crc after it, wall time[, step])``.

[Note: say only what is known] A state is what its rank published at time ``t``; a rank may
have moved on since (or died: gloo aborts a rank whose collective meets one of another
size within a second, before it publishes again). So a report names what each rank was last
*seen* doing and when; it calls a rank "behind" or "ahead" only when the states are current:
the rank is still running and the group has made no progress for the watchdog's timeout
(every live rank would have published a change by then).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def describe(entry: tuple) -> str:
    """One recorded collective in words.

    Example:
        >>> describe((42, "all_gather", "dp", 2, 1 << 20, "fsdp layers.3", 0, 0.0, 7))
        '#42 all_gather(dp, 2 ranks, 1.0 MB, fsdp layers.3, step 7)'
    """
    seq, kind, label, size, nbytes, scope = entry[:6]
    step = entry[8] if len(entry) > 8 else None
    where = f", {scope}" if scope else ""
    when = f", step {step}" if step is not None else ""
    dim = f"dim {label}" if isinstance(label, int) else str(label)
    return f"#{seq} {kind}({dim}, {size} ranks, {_bytes(nbytes)}{where}{when})"


def group_label(name: str, ranks) -> str:
    """``group 7 (ranks 0,1,2)``: a group as reports name it (eight ranks at most)."""
    shown = ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")
    return f"group {name} (ranks {shown})"


def crc_at(state_groups: dict, name: str, seq: int):
    """The running CRC after entry ``seq`` of group ``name`` in a published state, or None
    when that entry is not among the published ones."""
    item = state_groups.get(name)
    if item is None:
        return None
    if seq == 0:
        return 0
    for e in item[4]:
        if e[0] == seq:
            return e[6]
    return None


@dataclass(frozen=True)
class Finding:
    """What the analysis found on one group: the report in words and, where it can tell,
    the rank out of step with its collective (``entry``) at that point."""

    text: str
    rank: int | None = None
    entry: tuple | None = None


def analyse(
    name: str,
    states: dict[int, dict | None],
    *,
    now: float,
    gone: frozenset = frozenset(),
    stalled: bool = False,
) -> Finding:
    """What the members' published states of group ``name`` say ([Note: say only what is
    known]). ``states`` maps each member's global rank to its published state (None: none
    read); ``gone``: members whose process is known to have ended; ``stalled``: no member
    progressed for the watchdog's timeout (the states are current).

    Example:
        >>> analyse("7", {0: s0, 1: s1}, now=time.time(), stalled=True).text
        'rank 1 is behind: its last collective on group 7 (ranks 0,1) was #2 ...'
    """
    ranks = sorted(states)
    label = group_label(name, ranks)
    silent = [r for r in ranks if states[r] is None or name not in states[r]["groups"]]
    known = {r: states[r]["groups"][name] for r in ranks if r not in silent}
    lines = []
    if silent:
        lines.append(
            f"rank(s) {silent} published no record of {label}: they never issued a "
            "collective on it, or died before publishing"
        )
    if not known:
        return Finding(f"{label}: " + "; ".join(lines))
    seen = _Seen(name, states, known, now)
    culprit = _sequence_findings(seen, label, lines, gone, stalled)
    diverge = _first_divergence(name, known)
    if diverge is not None:
        lines.append(diverge.text)
        culprit = culprit if diverge.rank is None else (diverge.rank, diverge.entry)
    if not lines:
        lines.append(f"every member of {label} is at {seen.last(ranks[0])}; no difference found")
    rank, entry = culprit if culprit else (None, None)
    return Finding("; ".join(lines), rank, entry)


class _Seen:
    """Each member's last published collective on one group, in words, with its age."""

    def __init__(self, name: str, states: dict, known: dict, now: float) -> None:
        self.name, self.states, self.known, self.now = name, states, known, now

    def entry(self, r: int):
        ring = self.known[r][4]
        return ring[-1] if ring else None

    def last(self, r: int) -> str:
        e = self.entry(r)
        if e is None:
            return f"no collective on group {self.name} ({self._published(r)})"
        return f"{describe(e)} {max(0.0, self.now - e[7]):.1f} s ago"

    def _published(self, r: int) -> str:
        t = self.states[r].get("t")
        if t is None:
            return "state of unknown age"
        return f"state published {max(0.0, self.now - t):.1f} s ago"

    def seen_at(self, r: int) -> str:
        e = self.entry(r)
        what = (
            f"at {describe(e)}"
            if e is not None
            else f"before its first collective on group {self.name}"
        )
        return f"{what} ({self._published(r)})"


def _sequence_findings(seen: _Seen, label: str, lines: list, gone, stalled: bool):
    """Lines for members whose sequence numbers differ; (rank, entry) out of step or None."""
    seqs = {r: item[1] for r, item in seen.known.items()}
    counts = Counter(seqs.values())
    if len(counts) < 2:
        return None
    # the most common sequence number is where the group is; ties: the highest, since those
    # ranks wait for the others
    top = max(counts.values())
    consensus = max(s for s, c in counts.items() if c == top)
    at = sorted(r for r, s in seqs.items() if s == consensus)
    off = sorted(r for r, s in seqs.items() if s != consensus)
    at_desc = seen.last(at[0])
    for r in off:
        if r in gone or not stalled:  # its state may be old: what was seen, and when
            ended = "is no longer running; it " if r in gone else ""
            lines.append(
                f"rank {r} {ended}was last seen {seen.seen_at(r)}; rank(s) {at} at {at_desc}"
            )
        elif seqs[r] < consensus:
            lines.append(
                f"rank {r} is behind: its last collective on {label} was {seen.last(r)}; "
                f"rank(s) {at} issued {at_desc}"
            )
        else:
            lines.append(
                f"rank {r} is ahead: it issued {seen.last(r)}; rank(s) {at} are at {at_desc}"
            )
    first = off[0]
    return first, seen.entry(first)


def _first_divergence(name: str, known: dict) -> Finding | None:
    """The first sequence number (within the published entries) where members' running
    CRCs differ, with each member's description there; the rank out of step is the one
    whose CRC no other member shares, where exactly one is alone."""
    common = min(item[1] for item in known.values())
    ranks = sorted(known)
    label = group_label(name, ranks)
    low = max((item[4][0][0] if item[4] else 1) for item in known.values())
    first = None
    for seq in range(max(low, 1), common + 1):
        crcs = {r: crc_at({name: known[r]}, name, seq) for r in ranks}
        if None not in crcs.values() and len(set(crcs.values())) > 1:
            first = seq
            break
    if first is None:
        crcs = {r: crc_at({name: known[r]}, name, common) for r in ranks}
        if None not in crcs.values() and len(set(crcs.values())) > 1:
            return Finding(
                f"ranks diverge on {label} before #{common} (older than the entries kept)"
            )
        return None
    at = {r: next(e for e in known[r][4] if e[0] == first) for r in ranks}
    parts = [f"rank {r} {describe(at[r])}" for r in ranks]
    by_crc = Counter(e[6] for e in at.values())
    alone = [r for r in ranks if by_crc[at[r][6]] == 1]
    rank = alone[0] if len(alone) == 1 and len(ranks) > 2 else None
    text = f"ranks diverge at #{first} on {label}: " + ", ".join(parts)
    return Finding(text, rank, at[rank] if rank is not None else at[ranks[0]])
