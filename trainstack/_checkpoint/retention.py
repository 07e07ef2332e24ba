"""Retention, written once: which periodic checkpoints a storage keeps -- the newest ``keep_last``, and any the caller
still needs (one being uploaded) -- for the run folder (``Checkpointer``) and the object store (``Store``) alike,
behind the two methods retention needs of a storage (torchtitan keeps its manager's storage to a small protocol
the same way)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

__all__ = ["CheckpointStorage", "rotate"]


class CheckpointStorage(Protocol):
    """What retention needs of a place that holds checkpoints."""

    def periodic_names(self) -> list[str]:
        """The complete periodic checkpoints, oldest first."""
        ...

    def remove(self, name: str) -> None:
        """Delete one (its commit marker first, so a removal cut short never looks whole)."""
        ...


def rotate(storage: CheckpointStorage, keep_last: int | None, keep: Collection[str] = ()) -> list[str]:
    """Remove all but the newest ``keep_last`` periodic checkpoints of ``storage`` (none without a limit), never
    one named in ``keep``; the names removed."""
    if not keep_last:
        return []
    gone = [name for name in storage.periodic_names()[:-keep_last] if name not in keep]
    for name in gone:
        storage.remove(name)
    return gone
