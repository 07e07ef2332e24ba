"""One node's memory checkpoint files (``/dev/shm/trainstack-<uid>/job-*``): each copy a manifest
(``r<owner>-s<step>.json``: owner, step, world, size, checksum) beside its bytes, written atomically, listed, pruned
and read back with its checksum checked -- what ``MemoryCheckpoints`` stages, exchanges and restores from."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .memformat import laid_out

__all__ = ["Copy", "Found", "Node", "read_copy", "NAME"]

#: A copy's manifest: ``r<owner>-s<step>.json``.
NAME = re.compile(r"^r(\d{5})-s(\d{9})\.json$")

@dataclass(frozen=True)
class Copy:
    """A memory checkpoint file on this node, as its manifest describes it."""

    owner: int
    step: int
    world: int
    size: int
    sha256: str
    path: Path
    run: str = ""


@dataclass
class Found:
    """What a restart restored: this rank's state, the step, and where each rank's copy came from (in words)."""

    state: dict[str, Any]
    step: int
    path: Path
    sources: list[str]  # per rank: "own memory" or "a copy on <node>"
    passed_over: list[str]  # copies tried and refused (corrupt, missing), in words

    def source(self) -> str:
        """``memory at step 40 (ranks 2, 3 from a copy on node1)``."""
        moved = [r for r, s in enumerate(self.sources) if s != "own memory"]
        others = sorted({s for s in self.sources if s != "own memory"})
        how = "every rank from its own memory" if not moved else \
            f"rank{'s' if len(moved) > 1 else ''} {', '.join(map(str, moved))} from {' and '.join(others)}"
        return f"memory at step {self.step} ({how})"

    def laid_out(self, parts: Mapping[str, Any]) -> dict[str, Any]:
        """The state with every local shard a DTensor again, laid out as this run's model and optimizer."""
        return laid_out(self.state, parts)


class Node:
    """The memory folder of one node: write a copy (payload, then manifest), list, read, prune."""

    def __init__(self, folder: Path, rank: int, run: str = "") -> None:
        self.folder, self.rank, self.run = folder, rank, run

    def write(self, owner: int, step: int, world: int, chunks: list[memoryview], sha256: str | None = None
              ) -> tuple[Path, str]:
        """Write a copy from its ``chunks`` (hashed on the way), then its manifest: only then does it count. With
        ``sha256`` (a copy received from its owner), bytes that do not hash to it are refused (``OSError``)."""
        stem = self.folder / f"r{owner:05d}-s{step:09d}"
        path, digest = stem.with_suffix(".pt"), hashlib.sha256()
        tmp = path.with_name(f".{path.name}.tmp-w{self.rank}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        size = 0
        try:
            for chunk in chunks:
                digest.update(chunk)
                size += chunk.nbytes
                while chunk.nbytes:  # os.write releases the GIL; a large chunk may be written in parts
                    chunk = chunk[os.write(fd, chunk):]
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        if sha256 is not None and digest.hexdigest() != sha256:
            tmp.unlink(missing_ok=True)
            raise OSError(f"the copy of rank {owner} arrived damaged (checksum)")
        os.replace(tmp, path)
        manifest = {"owner": owner, "step": step, "world": world, "size": size, "sha256": digest.hexdigest(),
                    "run": self.run, "written_at": time.time()}
        self._atomic(stem.with_suffix(".json"), json.dumps(manifest).encode())  # last: the copy now counts
        return path, digest.hexdigest()

    def _atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp-w{self.rank}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)

    def copies(self, world: int) -> list[Copy]:
        """The complete copies here (a manifest, written last) of this run, at ``world`` processes."""
        return [c for c in self.all_copies() if c.world == world and c.run == self.run]

    def stale(self) -> list[Copy]:
        """The complete copies here of another run (another run id, or none: a run folder deleted and reused)."""
        return [c for c in self.all_copies() if c.run != self.run]

    def all_copies(self) -> list[Copy]:
        out = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        for name in names:
            if not NAME.match(name):
                continue
            try:
                m = json.loads((self.folder / name).read_text())
                copy = Copy(int(m["owner"]), int(m["step"]), int(m["world"]), int(m["size"]), str(m["sha256"]),
                            self.folder / name.replace(".json", ".pt"), str(m.get("run") or ""))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a torn or foreign manifest: not a copy
            out.append(copy)
        return out

    def remove(self, copies: list[Copy]) -> None:
        for copy in copies:
            copy.path.with_suffix(".json").unlink(missing_ok=True)  # first: the copy stops counting
            copy.path.unlink(missing_ok=True)

    def prune(self, owners: list[int], keep_step: int) -> None:
        """Remove this rank's written copies (of ``owners``) older than ``keep_step``."""
        for copy in self.copies_of(owners):
            if copy.step < keep_step:
                copy.path.with_suffix(".json").unlink(missing_ok=True)  # first: the copy stops counting
                copy.path.unlink(missing_ok=True)

    def copies_of(self, owners: list[int]) -> list[Copy]:
        found = []
        for name in os.listdir(self.folder) if self.folder.is_dir() else []:
            m = NAME.match(name)
            if m and int(m.group(1)) in owners:
                path = self.folder / name.replace(".json", ".pt")
                found.append(Copy(int(m.group(1)), int(m.group(2)), 0, 0, "", path))
        return found

    def remove_temp(self) -> None:
        """What a killed writer of this rank left (``.*.tmp-w<rank>``)."""
        for name in os.listdir(self.folder) if self.folder.is_dir() else []:
            if name.startswith(".") and name.endswith(f".tmp-w{self.rank}"):
                (self.folder / name).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        total = 0
        for name in os.listdir(self.folder) if self.folder.is_dir() else []:
            try:
                total += (self.folder / name).stat().st_size
            except OSError:
                pass
        return total


def read_copy(copy: Copy) -> tuple[bytearray, str]:
    """The copy's bytes (padded or cut to its manifest's size) and '' -- or why it cannot be used."""
    try:
        data = bytearray(copy.path.read_bytes())  # writable: tensors are made from it
    except OSError as exc:
        return bytearray(copy.size), f"unreadable ({exc.strerror or exc})"
    why = ""
    if len(data) != copy.size:
        why = f"truncated ({len(data)} of {copy.size} bytes)"
    elif hashlib.sha256(data).hexdigest() != copy.sha256:
        why = "its checksum does not match"
    return (data + bytearray(copy.size))[: copy.size], why


# ---------------------------------------------------------------------------------------------------- the writer
