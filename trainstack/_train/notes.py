"""What the loop tells the user in words, kept apart from the loop so it reads as a loop: the note on a failed
first step, why a run stopped diverged, and what a resumed run is (continued, new, or with nothing to train)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["first_step_note", "diverged_reason", "resume_notes", "graceful_stop", "unbounded_progress",
           "UNBOUNDED_LOADER", "UNBOUNDED_REPORT"]

UNBOUNDED_REPORT = 1000  # steps between "still in epoch N" lines for a loader without a length

UNBOUNDED_LOADER = ("trainstack: WARNING: the training loader has no length (an IterableDataset): each epoch runs "
                    "until it is exhausted, so a never-ending stream never finishes its first epoch. HINT: set "
                    "max_batches (batches per epoch), or mark the dataset `infinite = True` (then max_batches, or 1, "
                    "batches per epoch, as qadence).")


def describe(batch: Any, depth: int = 0) -> str:
    """A batch's structure in a few words: ``list(float32[8, 3], int64[8])``."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).replace('torch.', '')}{list(batch.shape)}"
    if isinstance(batch, dict) and depth < 2:
        return "{" + ", ".join(f"{k!r}: {describe(v, depth + 1)}" for k, v in list(batch.items())[:6]) + "}"
    if isinstance(batch, (list, tuple)) and depth < 2:
        return f"{type(batch).__name__}(" + ", ".join(describe(v, depth + 1) for v in batch[:6]) + ")"
    return type(batch).__name__


def first_step_note(batch: Any) -> str:
    return (f"trainstack: the first training step failed. loss_fn is called as loss_fn(model, batch), where model is "
            f"the module being trained and batch is one item of the DataLoader (here: {describe(batch)}), after it "
            f"was moved to the device. A loss written as loss(output, target), or a batch that does not fit the "
            f"model's input, fails like this.")


def diverged_reason(loss: Any, epoch: int, kept: Path | None) -> str:
    return (f"the training loss became {float(loss) if loss is not None else 'NaN'} in epoch {epoch} (on at least "
            f"one rank), so training stopped; "
            + (f"the last finite checkpoint, {kept}, is kept. " if kept else "no checkpoint was written. ")
            + "HINT: lower the learning rate, set grad_clip_norm, check the data for NaN/inf, or set "
              "TrainConfig(stop_on_nonfinite=False) to train on.")


def unbounded_progress(epoch: int, batches: int) -> str:
    return (f"epoch {epoch + 1}: {batches} batches so far (the training loader has no length, so an epoch ends when it "
            f"is exhausted; max_batches bounds it)")


def graceful_stop(kind: str, why: str, epoch: int, step: int, path: Path | None, took: float | None,
                  folder: Path | None) -> str:
    """The line a stop with a checkpoint prints: where, why, which file, and how to continue."""
    saved = f"Checkpoint {path.name if path else '(already saved)'}" + (
        f" written in {took:.2f}s" if took and path else "") + "."
    if kind == "interrupted":
        return (f"Interrupted at epoch {epoch}, step {step} ({why}). {saved} To continue exactly here: run again with "
                f"TrainConfig(resume='auto', log_folder={str(folder)!r}).")
    return f"Graceful stop at epoch {epoch}, step {step}: {why}. {saved}"


def resume_notes(config: TrainConfig, folder: Path | None, restored: bool, continues: bool, epoch: int,
                 last_epoch: int, step: int = 0, last_step: int = 0, stopped_by: str | None = None,
                 earlier: Path | None = None) -> list[str]:
    """What kind of run this is, when it is not a plain new one (``earlier``: another run of this experiment
    beside this new one)."""
    notes = []
    if config.resume == "auto" and not restored:
        notes.append(f"trainstack: resume='auto' found no checkpoint in {folder}; starting from scratch.")
    if earlier is not None and not continues and not restored:
        notes.append(f"trainstack: NOTE: an earlier run of this experiment is in {earlier}; this run starts a NEW "
                     f"one in {folder}, from scratch (qadence reused the folder and continued). HINT: to continue "
                     f"that run, TrainConfig(log_folder={str(earlier)!r}, resume='auto').")
    if continues and epoch and not restored:
        notes.append(f"trainstack: a second fit() continues the run in {folder} at epoch {epoch} for another "
                     f"max_iter={config.max_iter} epochs.")
    if stopped_by:
        notes.append(f"trainstack: NOTHING TO TRAIN: the run in {folder} was stopped at step {step} by {stopped_by} "
                     f"(recorded in its checkpoint). HINT: to train again, start a new run (resume=None, or another "
                     f"log_folder).")
    elif restored and step >= last_step:
        notes.append(f"trainstack: NOTHING TO TRAIN: the run in {folder} already reached step {step} of its "
                     f"max_steps={config.max_steps} (counted from the run's start). HINT: raise max_steps to train "
                     f"longer, or start a new run (resume=None, or another log_folder).")
    elif restored and epoch >= last_epoch:
        notes.append(f"trainstack: NOTHING TO TRAIN: the run in {folder} already finished epoch {epoch} of its "
                     f"max_iter={config.max_iter} (max_iter counts from the run's start, not from this resume). "
                     f"HINT: raise max_iter to train longer, or start a new run "
                     f"(resume=None, or another log_folder).")
    return notes
