"""A step-line plot as SVG, with the standard library only (the GPU machine may have
no matplotlib, and the dry run must not need it)."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
]


def _ticks(lo: float, hi: float, count: int = 6) -> List[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def step_plot(
    path: Path,
    title: str,
    series: Dict[str, Sequence[Tuple[float, float]]],
    x_label: str,
    y_label: str,
    log2_y: bool = False,
    x_end: Optional[Dict[str, float]] = None,
) -> None:
    """One step line per series (the value holds until the next point, and until
    `x_end[name]` after the last one). Empty series are left out; with none at all
    the plot says so."""
    width, height, left, right, top, bottom = 900, 480, 70, 220, 40, 50
    plot_w, plot_h = width - left - right, height - top - bottom
    x_end = x_end or {}
    points = [(x, y) for s in series.values() for x, y in s] + [(x, None) for x in x_end.values()]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    ys = [y for _, y in points if y is not None and (y > 0 or not log2_y)]
    if not ys:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text></svg>')
        path.write_text("\n".join(parts) + "\n")
        return
    fy = (lambda v: math.log2(v)) if log2_y else (lambda v: v)
    x_lo, x_hi = 0.0, max(x for x, _ in points) or 1.0
    y_lo, y_hi = min(fy(y) for y in ys), max(fy(y) for y in ys)
    if y_hi - y_lo < 1e-9:
        y_lo, y_hi = y_lo - 1, y_hi + 1
    pad = 0.05 * (y_hi - y_lo)
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def sx(x: float) -> float:
        return left + plot_w * (x - x_lo) / (x_hi - x_lo)

    def sy(v: float) -> float:
        return top + plot_h * (1 - (fy(v) - y_lo) / (y_hi - y_lo))

    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>')
    for x in _ticks(x_lo, x_hi):
        parts.append(f'<line x1="{sx(x):.1f}" y1="{top + plot_h}" x2="{sx(x):.1f}" y2="{top + plot_h + 5}" stroke="#333"/>'
                     f'<text x="{sx(x):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{x:g}</text>')
    if log2_y:
        y_ticks = [2.0 ** e for e in range(math.ceil(y_lo), math.floor(y_hi) + 1)]
    else:
        y_ticks = _ticks(y_lo, y_hi)
    for y in y_ticks:
        parts.append(f'<line x1="{left - 5}" y1="{sy(y):.1f}" x2="{left + plot_w}" y2="{sy(y):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 8}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 10}" text-anchor="middle">{escape(x_label)}</text>')
    parts.append(f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {top + plot_h / 2})">{escape(y_label)}</text>')
    shown = [(name, pts) for name, pts in series.items() if pts]
    for n, (name, pts) in enumerate(shown):
        colour = PALETTE[n % len(PALETTE)]
        ordered = sorted(pts)
        d = [f"M{sx(ordered[0][0]):.1f} {sy(ordered[0][1]):.1f}"]
        for x, y in ordered[1:]:
            d.append(f"H{sx(x):.1f} V{sy(y):.1f}")
        d.append(f"H{sx(x_end.get(name, ordered[-1][0])):.1f}")
        parts.append(f'<path d="{" ".join(d)}" fill="none" stroke="{colour}" stroke-width="2"/>')
        ly = top + 14 + 16 * n
        parts.append(f'<line x1="{left + plot_w + 12}" y1="{ly - 4}" x2="{left + plot_w + 32}" y2="{ly - 4}" '
                     f'stroke="{colour}" stroke-width="2"/><text x="{left + plot_w + 38}" y="{ly}">{escape(name)}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
