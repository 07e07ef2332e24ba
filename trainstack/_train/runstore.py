"""One run's checkpoint store (``checkpoint_store``): opened and checked before training, the newest committed
checkpoint pulled when the run folder has none as new, the uploads finished a bounded time at the end. The Run
calls these; the store itself is ``trainstack.checkpoint.Store``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import Checkpointer, CheckpointError, Store, Uploads, remove_checkpoint, step_of

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["open_store", "pull_newer", "finish_uploads"]


def open_store(config: TrainConfig, path: Path, is_main: bool, kept: int | None, say: Callable[[str], None]
               ) -> tuple[Store | None, Uploads | None]:
    """The run's store (its own prefix with ``create_subfolder_per_run``), checked reachable and writable on every
    rank before training; rank 0 uploads."""
    if config.checkpoint_store is None:
        return None, None
    url = config.checkpoint_store.rstrip("/") + (f"/{path.name}" if config.create_subfolder_per_run else "")
    store = Store(url)
    store.check()
    return store, Uploads(store, kept, say) if is_main else None


def pull_newer(store: Store, checkpointer: Checkpointer, is_main: bool, say: Callable[[str], None]) -> None:
    """``resume="auto"``: rank 0 downloads the store's newest committed checkpoint when the run folder has none as
    new (another machine, a lost disk); one that cannot be downloaded whole (damaged, forged, incomplete) is passed
    over for the one before it, said, as a damaged local checkpoint is."""
    if not is_main:
        return
    local = checkpointer.latest()
    for (step, _), name in reversed(store.committed()):
        if local is not None and step_of(local) >= step:
            return
        start = time.perf_counter()
        try:
            got = store.download(name, checkpointer.folder)
            if got not in checkpointer.checkpoints():  # e.g. a sharded folder without its own commit marker
                remove_checkpoint(got)
                raise CheckpointError(f"{name} is not a complete {'sharded' if got.is_dir() else 'file'} checkpoint "
                                      f"once downloaded (its objects lack the commit marker a save writes)")
        except CheckpointError as exc:
            say(f"trainstack: WARNING: passing over {name} in the store: {exc}")
            continue
        say(f"trainstack: downloaded checkpoint {name} from {store.url} in {time.perf_counter() - start:.1f} s "
            f"(the run folder had none as new).")
        return


def finish_uploads(up: Uploads, failed: bool, say: Callable[[str], None]) -> None:
    """The end of the run waits five times the store timeout for the last upload, then says what it has."""
    bound = 5 * up.store.timeout
    if not up.wait(bound):
        say(f"trainstack: WARNING: the upload of {up.in_flight} to {up.store.url} did not finish within {bound:g} s "
            f"(the store does not answer?): the run ends without it; its local copy is committed, the store's "
            f"newest is {up.uploaded or 'an earlier one'}.")
    elif up.uploaded and not failed:
        skipped = f"; {up.skipped} save(s) not uploaded: a newer one replaced them while one ran" if up.skipped \
            else ""
        say(f"Checkpoints committed to {up.store.url}: newest {up.uploaded} (its upload: {up.seconds:.1f} s)"
            f"{skipped}.")
