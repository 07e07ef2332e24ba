"""Checkpoints: one self-contained file per save, written atomically, rotated, loadable everywhere.

A file appears under its final name only once complete (temp file + fsync + rename), so a crash or a
SIGKILL mid-write never leaves a half-written checkpoint where `latest()` would pick it up.
Files hold only tensors and plain Python values: ``torch.load(path, weights_only=True)`` works.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .errors import TrainstackError

__all__ = ["CheckpointError", "Checkpointer", "atomic_save", "capture_rng", "restore_rng", "checkpoint_name",
           "load_checkpoint", "write_checkpoint"]

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
_PATTERN = re.compile(r"^ckpt-e(\d+)-s(\d+)\.pt$")
BEST = "best.pt"


class CheckpointError(TrainstackError, OSError):
    """Saving or loading a checkpoint failed; the previous checkpoint is untouched."""


def checkpoint_name(epoch: int, global_step: int) -> str:
    return f"ckpt-e{epoch:05d}-s{global_step:09d}.pt"


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - some file systems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> float:
    """``torch.save`` to a temp file next to ``path``, fsync, then rename. Returns the seconds it took."""
    start = time.perf_counter()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _test_delay()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        reason = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
                  errno.EROFS: "the file system is read-only", errno.EDQUOT: "the disk quota is exceeded"}
        why = reason.get(exc.errno, exc.strerror or str(exc))
        raise CheckpointError(f"could not write checkpoint {path}: {why}. The previous checkpoint is kept. "
                              f"HINT: free space or choose another root_folder/log_folder.") from exc
    return time.perf_counter() - start


def _test_delay() -> None:
    """Test hook: TRAINSTACK_TEST_SAVE_DELAY_S pauses between writing and committing (kill-during-write tests)."""
    delay = os.environ.get("TRAINSTACK_TEST_SAVE_DELAY_S")
    if delay:
        marker = os.environ.get("TRAINSTACK_TEST_SAVE_MARKER")
        if marker:
            Path(marker).touch()
        time.sleep(float(delay))


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as weights_only-loadable values."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`capture_rng`, wherever the checkpoint was loaded to.

    RNG states are byte tensors that torch only accepts on the CPU, so they are moved back first; CUDA states
    are restored for the devices both the saving and this process have.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_byte_state(state["torch"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))
    if state.get("cuda") and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_byte_state(cuda_state), index)


def _byte_state(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.uint8)


def gather_rng() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective when distributed)."""
    mine = capture_rng()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


class Checkpointer:
    """Save/find/rotate checkpoints of one run folder (``<run>/checkpoints``)."""

    def __init__(self, run_folder: Path, keep_last: int | None = None) -> None:
        self.folder = Path(run_folder) / "checkpoints"
        self.keep_last = keep_last
        self.last_save_seconds: float | None = None

    def save(self, state: dict[str, Any], name: str, is_main: bool) -> Path | None:
        """Write ``state`` on the main process (the caller built it on every rank). Rotates afterwards."""
        if not is_main:
            return None
        path = self.folder / name
        self.last_save_seconds = atomic_save(state, path)
        if name != BEST:
            self._rotate()
        return path

    def checkpoints(self) -> list[Path]:
        """Complete periodic checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _PATTERN.match(p.name)
            if m:
                found.append(((int(m.group(2)), int(m.group(1))), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def _rotate(self) -> None:
        if not self.keep_last:
            return
        for old in self.checkpoints()[: -self.keep_last]:
            old.unlink(missing_ok=True)


def load_file(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint file with ``weights_only=True``; a clear error for missing or foreign files."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist. HINT: resume='auto' picks the latest one "
                              f"in the run folder; a path must point at a ckpt-*.pt file.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a trainstack checkpoint (format {FORMAT_VERSION}).")
    return state


def write_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     iteration: int) -> Path:
    """Stand-alone helper (qadence name): save model/optimizer state for a hand-written loop."""
    from .accelerator import Accelerator

    state = {"format_version": FORMAT_VERSION, "epoch": int(iteration), "global_step": int(iteration),
             "model": Accelerator.unwrap_model(model).state_dict(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None}
    path = Path(folder) / "checkpoints" / checkpoint_name(int(iteration), int(iteration))
    atomic_save(state, path)
    return path


def load_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Any, int]:
    """Stand-alone helper (qadence name): load the latest checkpoint of ``folder`` (iteration 0 if none)."""
    from .accelerator import Accelerator

    latest = Checkpointer(Path(folder)).latest()
    if latest is None:
        return model, optimizer, 0
    state = load_file(latest, device)
    Accelerator.unwrap_model(model).load_state_dict(state["model"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    return model, optimizer, int(state["epoch"])
