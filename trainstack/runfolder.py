"""Choose the run folder (logs, metrics, checkpoints) once, on rank 0, and share it with every rank."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["choose_run_folder"]


def _has_checkpoint(folder: Path) -> bool:
    ckpts = folder / "checkpoints"
    return ckpts.is_dir() and any(p.name.startswith("ckpt-") and p.suffix == ".pt" for p in ckpts.iterdir())


def choose_run_folder(root: Path, log_folder: Path, new_per_run: bool, resume: object,
                      environ: dict[str, str] | None = None) -> Path:
    """Where this run writes.

    * an explicit ``log_folder`` (not ``./``) is used as given;
    * inside a Slurm job the folder is ``root/slurm-<job id>``, so a requeued job finds its checkpoints;
    * ``resume="auto"`` reuses the newest run folder under ``root`` that holds a checkpoint;
    * otherwise a new ``root/<YYYYmmdd-HHMMSS>-<pid>`` folder.
    """
    env = os.environ if environ is None else environ
    if log_folder != Path("./") and not new_per_run:
        return log_folder
    job = env.get("SLURM_JOB_ID")
    if job and not new_per_run:
        array = env.get("SLURM_ARRAY_TASK_ID")
        return root / (f"slurm-{env.get('SLURM_ARRAY_JOB_ID', job)}_{array}" if array else f"slurm-{job}")
    if resume == "auto" and root.is_dir():
        candidates = [p for p in root.iterdir() if p.is_dir() and _has_checkpoint(p)]
        if candidates:
            return max(candidates, key=lambda p: p.stat().st_mtime)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = root / f"{stamp}-{os.getpid():x}"
    n = 1
    while folder.exists():
        n += 1
        folder = root / f"{stamp}-{os.getpid():x}-{n}"
    return folder
