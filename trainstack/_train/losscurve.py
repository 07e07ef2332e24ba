"""The run folder's ``loss_curve.svg``: every loss series against the optimizer step, drawn in a few milliseconds.

A run's end used to import matplotlib for a PNG (1.7 s of a short run's wall time, measured); an SVG is a few
lines of text that any browser, editor or notebook shows, and needs nothing installed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from .._common.files import atomic_write

__all__ = ["save_loss_curve", "loss_series"]

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 30, 45  # the plot area's margins
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
MAX_POINTS = 2000  # per series; a longer history is thinned evenly (the file stays small)


def loss_series(history: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``{name: [(step, value), ...]}`` for ``loss`` and every ``*_loss`` of the rows, finite values only."""
    keys = sorted({k for row in history for k in row if k == "loss" or k.endswith("_loss")})
    series: dict[str, list[tuple[float, float]]] = {}
    for key in keys:
        points = [(float(row["step"]), float(row[key])) for row in history
                  if key in row and "step" in row and _finite(row[key])]
        if points:
            stride = math.ceil(len(points) / MAX_POINTS)
            series[key] = points[::stride] if stride > 1 else points
    return series


def save_loss_curve(history: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Draw the losses of ``history`` (metrics.jsonl rows) to ``path`` (an SVG, written atomically); None when the
    history has no loss."""
    series = loss_series(history)
    if not series:
        return None
    return atomic_write(path, render_svg(series))


def render_svg(series: dict[str, list[tuple[float, float]]]) -> str:
    """The SVG text: a log y axis when every value is positive, ticks on both axes, a legend."""
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    log_y = min(ys) > 0
    ty = math.log10 if log_y else (lambda v: v)
    x0, x1 = _span(min(xs), max(xs))
    y0, y1 = _span(ty(min(ys)), ty(max(ys)))
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return TOP + (1 - (ty(y) - y0) / (y1 - y0)) * h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" stroke="#333"/>']
    for x in _ticks(x0, x1, whole=True):
        out.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + h}" stroke="#ddd"/>'
                   f'<text x="{px(x):.1f}" y="{TOP + h + 15}" text-anchor="middle">{_label(x)}</text>')
    for t in _ticks(y0, y1):
        y = 10 ** t if log_y else t
        out.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + w}" y2="{py(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 5}" y="{py(y) + 4:.1f}" text-anchor="end">{_label(y)}</text>')
    out.append(f'<text x="{LEFT + w / 2}" y="{HEIGHT - 8}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{TOP + h / 2}" text-anchor="middle" transform="rotate(-90 14 {TOP + h / 2})">'
               f'loss{" (log)" if log_y else ""}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if len(pts) < 50:
            out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>' for x, y in pts)
        ly = TOP + 14 + 15 * i
        out.append(f'<line x1="{LEFT + w - 110}" y1="{ly - 4}" x2="{LEFT + w - 90}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"/><text x="{LEFT + w - 85}" y="{ly}">{escape(name)}</text>')
    out.append("</svg>\n")
    return "\n".join(out)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _span(lo: float, hi: float) -> tuple[float, float]:
    """A non-empty axis range around [lo, hi] (a single point gets a margin)."""
    if hi - lo > 1e-12 * max(abs(lo), abs(hi), 1.0):
        return lo, hi
    pad = abs(lo) * 0.1 or 1.0
    return lo - pad, hi + pad


def _ticks(lo: float, hi: float, target: int = 5, whole: bool = False) -> list[float]:
    """Round tick positions (1, 2 or 5 times a power of ten apart; whole numbers for steps) inside [lo, hi]."""
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    step = max(step, 1) if whole else step
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    return f"{v:.3g}"
