"""A self-contained SVG chart of memory over a step, by category (no dependency).

``memory_chart_svg(samples)`` stacks the bytes of each category (``CATEGORIES``, with
``other`` at the bottom) over the samples of a ``MemoryTracker(timeline=...)`` in operator order, shades the phases (forward,
backward, optimizer) beneath, and marks the peak; ``write_memory_chart(tracker, path)``
writes the last complete optimizer step's chart to a file a browser opens.
"""

from __future__ import annotations

import html
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


def _thin(samples: list[Sample], limit: int) -> list[Sample]:
    """At most ``limit`` samples: of each run of consecutive ones, the highest (so the
    chart never hides a peak)."""
    if len(samples) <= limit:
        return samples
    per = -(-len(samples) // limit)
    return [
        max(samples[i : i + per], key=lambda s: sum(s.bytes)) for i in range(0, len(samples), per)
    ]


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
    width, height, left, right, top, bottom = 960, 420, 70, 190, 36, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    top_bytes = max(sum(s.bytes) for s in pts) or 1
    mib = 1 << 20
    n = len(pts)

    def x(i: float) -> float:
        return left + plot_w * (i / max(n - 1, 1))

    def y(b: float) -> float:
        return top + plot_h * (1 - b / top_bytes)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="15">{html.escape(title)}</text>',
    ]
    start = 0  # phase bands
    for i in range(1, n + 1):
        if i == n or pts[i].phase != pts[start].phase:
            shade = PHASE_SHADES.get(pts[start].phase, "#ffffff")
            x0, x1 = x(start - 0.5 if start else 0), x(i - 0.5 if i < n else n - 1)
            out.append(
                f'<rect x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 0.5):.1f}" '
                f'height="{plot_h}" fill="{shade}"/>'
            )
            out.append(
                f'<text x="{x0 + 3:.1f}" y="{top + plot_h + 28}" fill="#666">'
                f"{pts[start].phase}</text>"
            )
            start = i
    below = [0] * n
    # "other" (module buffers, a data set) is mostly flat: at the bottom, under what moves
    order = [CATEGORIES.index("other")] + [i for i, c in enumerate(CATEGORIES) if c != "other"]
    for c in order:
        cat = CATEGORIES[c]
        above = [below[i] + pts[i].bytes[c] for i in range(n)]
        if not any(pts[i].bytes[c] for i in range(n)):
            continue
        upper = " ".join(f"{x(i):.1f},{y(above[i]):.1f}" for i in range(n))
        lower = " ".join(f"{x(i):.1f},{y(below[i]):.1f}" for i in reversed(range(n)))
        out.append(
            f'<polygon points="{upper} {lower}" fill="{COLORS[cat]}" stroke="none">'
            f"<title>{cat}</title></polygon>"
        )
        below = above
    for k in range(5):  # axis
        b = top_bytes * k / 4
        out.append(
            f'<line x1="{left}" x2="{left + plot_w}" y1="{y(b):.1f}" y2="{y(b):.1f}" '
            'stroke="#ccc" stroke-width="0.5"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{b / mib:.1f}</text>'
        )
    out.append(f'<text x="12" y="{top + plot_h / 2:.0f}" fill="#444">MiB</text>')
    peak_i = max(range(n), key=lambda i: sum(pts[i].bytes))
    out.append(
        f'<line x1="{x(peak_i):.1f}" x2="{x(peak_i):.1f}" y1="{top}" y2="{top + plot_h}" '
        'stroke="black" stroke-dasharray="4 3"/>'
    )
    out.append(
        f'<text x="{x(peak_i) + 4:.1f}" y="{top + 12}">peak {top_bytes / mib:.2f} MiB '
        f"({pts[peak_i].phase})</text>"
    )
    for c, cat in enumerate(CATEGORIES):  # legend
        ly = top + 18 * c
        out.append(
            f'<rect x="{width - right + 16}" y="{ly}" width="12" height="12" fill="{COLORS[cat]}"/>'
        )
        out.append(f'<text x="{width - right + 34}" y="{ly + 10}">{cat}</text>')
    out.append(
        f'<text x="{left}" y="{height - 6}" fill="#666">operators in order '
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
