"""Small text helpers the rooms share (a torch-free leaf)."""

from __future__ import annotations

__all__ = ["number_ranges"]


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
