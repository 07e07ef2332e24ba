"""Small text helpers the rooms share (a torch-free leaf)."""

from __future__ import annotations

import math
import time

__all__ = ["number_ranges", "duration", "size", "number"]


def duration(seconds: float) -> str:
    """``00:05:10`` (``2.5 d`` from a day on): an ETA as the live line prints it and ``status`` reads it back."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 86400:.1f} d"


def number_ranges(numbers: list[int], sep: str = ", ") -> str:
    """[0, 1, 2, 5] -> "0-2, 5" (``sep=","``: Slurm's --array syntax)."""
    numbers, out, i = sorted(numbers), [], 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        out.append(str(numbers[i]) if i == j else f"{numbers[i]}-{numbers[j]}")
        i = j + 1
    return sep.join(out)


def size(n_bytes: float) -> str:
    """``36 B``, ``4.9 kB``, ``1.2 GB`` (decimal units, as ``du --si`` and model cards count)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n_bytes) < 1000:
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    return f"{n_bytes:.1f} TB"


def number(value: float) -> str:
    """A metric as the console shows it: 4 significant digits, scientific notation outside 1e-3..1e5."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    return f"{value:.4g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"
