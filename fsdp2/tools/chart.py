"""A self-contained SVG chart of memory over a step, by category (no dependency).

``memory_chart_svg(samples)`` stacks the bytes of each category (``CATEGORIES``, with
``other`` at the bottom) over the samples of a ``MemoryTracker(timeline=...)`` in operator order, shades the phases (forward,
backward, optimizer) beneath, and marks the peak; ``write_memory_chart(tracker, path)``
writes the last complete optimizer step's chart to a file a browser opens.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from fsdp2.tools.memory import CATEGORIES, MemoryTracker, Sample

__all__ = ["memory_chart_svg", "write_memory_chart"]

COLORS = {
    "sharded_params": "#4c72b0",
    "unsharded_params": "#8fb0e0",
    "sharded_grads": "#dd8452",
    "unsharded_grads": "#f2b98d",
    "optimizer_state": "#55a868",
    "activations": "#c44e52",
    "temporaries": "#e8a0a2",
    "comm_buffers": "#8172b3",
    "other": "#a0a0a0",
}
PHASE_SHADES = {"forward": "#f4f8ff", "backward": "#fff6ef", "optimizer": "#f2fbf2"}
MAX_POINTS = 800
_MIB = 1 << 20


def _thin(samples: list[Sample], limit: int) -> list[Sample]:
    """At most ``limit`` samples: of each run of consecutive ones, the highest (so the
    chart never hides a peak)."""
    if len(samples) <= limit:
        return samples
    per = -(-len(samples) // limit)
    return [
        max(samples[i : i + per], key=lambda s: sum(s.bytes)) for i in range(0, len(samples), per)
    ]


@dataclass(frozen=True)
class _Frame:
    """Where the plot lies in the SVG, and how sample indices and bytes map onto it."""

    n: int  # samples plotted
    top_bytes: float  # bytes at the top of the y axis
    width: int = 960
    height: int = 420
    left: int = 70
    right: int = 190
    top: int = 36
    bottom: int = 40

    @property
    def plot_w(self) -> int:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> int:
        return self.height - self.top - self.bottom

    def x(self, i: float) -> float:
        return self.left + self.plot_w * (i / max(self.n - 1, 1))

    def y(self, b: float) -> float:
        return self.top + self.plot_h * (1 - b / self.top_bytes)


def _phase_bands(pts: list[Sample], f: _Frame) -> list[str]:
    """A shaded band, labelled below the plot, for each run of samples in one phase."""
    out = []
    start = 0
    for i in range(1, f.n + 1):
        if i == f.n or pts[i].phase != pts[start].phase:
            shade = PHASE_SHADES.get(pts[start].phase, "#ffffff")
            x0, x1 = f.x(start - 0.5 if start else 0), f.x(i - 0.5 if i < f.n else f.n - 1)
            out.append(
                f'<rect x="{x0:.1f}" y="{f.top}" width="{max(x1 - x0, 0.5):.1f}" '
                f'height="{f.plot_h}" fill="{shade}"/>'
            )
            out.append(
                f'<text x="{x0 + 3:.1f}" y="{f.top + f.plot_h + 28}" fill="#666">'
                f"{pts[start].phase}</text>"
            )
            start = i
    return out


def _stacked_areas(pts: list[Sample], f: _Frame) -> list[str]:
    """One polygon per non-empty category, stacked on the ones before it."""
    out = []
    below = [0] * f.n
    # "other" (module buffers, a data set) is mostly flat: at the bottom, under what moves
    order = [CATEGORIES.index("other")] + [i for i, c in enumerate(CATEGORIES) if c != "other"]
    for c in order:
        cat = CATEGORIES[c]
        above = [below[i] + pts[i].bytes[c] for i in range(f.n)]
        if not any(pts[i].bytes[c] for i in range(f.n)):
            continue
        upper = " ".join(f"{f.x(i):.1f},{f.y(above[i]):.1f}" for i in range(f.n))
        lower = " ".join(f"{f.x(i):.1f},{f.y(below[i]):.1f}" for i in reversed(range(f.n)))
        out.append(
            f'<polygon points="{upper} {lower}" fill="{COLORS[cat]}" stroke="none">'
            f"<title>{cat}</title></polygon>"
        )
        below = above
    return out


def _y_axis(f: _Frame) -> list[str]:
    """Five gridlines with their MiB labels, and the axis title."""
    out = []
    for k in range(5):
        b = f.top_bytes * k / 4
        out.append(
            f'<line x1="{f.left}" x2="{f.left + f.plot_w}" y1="{f.y(b):.1f}" y2="{f.y(b):.1f}" '
            'stroke="#ccc" stroke-width="0.5"/>'
        )
        out.append(
            f'<text x="{f.left - 6}" y="{f.y(b) + 4:.1f}" text-anchor="end">{b / _MIB:.1f}</text>'
        )
    out.append(f'<text x="12" y="{f.top + f.plot_h / 2:.0f}" fill="#444">MiB</text>')
    return out


def _peak_marker(pts: list[Sample], f: _Frame) -> list[str]:
    """A dashed line at the highest sample, labelled with its bytes and phase."""
    peak_i = max(range(f.n), key=lambda i: sum(pts[i].bytes))
    return [
        f'<line x1="{f.x(peak_i):.1f}" x2="{f.x(peak_i):.1f}" y1="{f.top}" '
        f'y2="{f.top + f.plot_h}" stroke="black" stroke-dasharray="4 3"/>',
        f'<text x="{f.x(peak_i) + 4:.1f}" y="{f.top + 12}">peak {f.top_bytes / _MIB:.2f} MiB '
        f"({pts[peak_i].phase})</text>",
    ]


def _legend(f: _Frame) -> list[str]:
    """A colour swatch and name per category, right of the plot."""
    out = []
    for c, cat in enumerate(CATEGORIES):
        ly = f.top + 18 * c
        x0 = f.width - f.right
        out.append(f'<rect x="{x0 + 16}" y="{ly}" width="12" height="12" fill="{COLORS[cat]}"/>')
        out.append(f'<text x="{x0 + 34}" y="{ly + 10}">{cat}</text>')
    return out


def memory_chart_svg(samples: list[Sample], title: str = "memory over one step") -> str:
    """An SVG document: the bytes of every category, stacked, over ``samples``.

    Example:
        >>> svg = memory_chart_svg(tracker.timeline, "step 3")
        >>> svg.startswith("<svg")
        True
    """
    if not samples:
        raise ValueError("memory_chart_svg: no samples (run the tracker with timeline=True).")
    pts = _thin(list(samples), MAX_POINTS)
    f = _Frame(n=len(pts), top_bytes=max(sum(s.bytes) for s in pts) or 1)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{f.width}" height="{f.height}" '
        f'viewBox="0 0 {f.width} {f.height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{f.width}" height="{f.height}" fill="white"/>',
        f'<text x="{f.left}" y="20" font-size="15">{html.escape(title)}</text>',
    ]
    out += _phase_bands(pts, f)
    out += _stacked_areas(pts, f)
    out += _y_axis(f)
    out += _peak_marker(pts, f)
    out += _legend(f)
    out.append(
        f'<text x="{f.left}" y="{f.height - 6}" fill="#666">operators in order '
        f"({len(samples)} samples)</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_memory_chart(tracker: MemoryTracker, path, step: int | None = None) -> Path:
    """Write the chart of optimizer step ``step`` (default: the last complete one, else all
    samples) to ``path`` (``.svg``; an ``.html`` path gets the SVG inside a page).

    Example:
        >>> with MemoryTracker(model, opt, timeline=1) as tracker:
        ...     train(steps=3)
        >>> write_memory_chart(tracker, "memory.svg")
        PosixPath('memory.svg')
    """
    samples = tracker.timeline
    done = {s.step for s in samples} - {tracker.steps}
    if step is None and done:
        step = max(done)
    if step is not None:
        samples = [s for s in samples if s.step == step]
    title = f"memory over step {step}" if step is not None else "memory over the run"
    svg = memory_chart_svg(samples, title)
    path = Path(path)
    if path.suffix.lower() in (".html", ".htm"):
        svg = f"<!doctype html><html><body>\n{svg}</body></html>\n"
    path.write_text(svg)
    return path
