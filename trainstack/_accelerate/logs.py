"""What each process shows, in Accelerate's spelling: a logger whose records are written by the main process only
(``main_process_only=False`` for every process, ``in_order=True`` one process after the other), and a tqdm bar
drawn by the main process only."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from .state import PartialState

__all__ = ["get_logger", "MultiProcessAdapter", "tqdm"]


class MultiProcessAdapter(logging.LoggerAdapter[logging.Logger]):
    """A logger adapter that keeps records to the main process unless ``main_process_only=False``."""

    def log(self, level: int, msg: object, *args: Any, **options: Any) -> None:
        kwargs: MutableMapping[str, Any] = options
        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        if not in_order:
            if state.is_main_process or not main_only:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        for index in range(state.num_processes):  # one process after the other
            if index == state.process_index:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs  # records as they are (Accelerate adds nothing either)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """``logging.getLogger(name)`` whose records only the main process writes (see the module docstring);
    ``log_level`` defaults to ``ACCELERATE_LOG_LEVEL`` when set."""
    logger = logging.getLogger(name)
    level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but the main one (``main_process_only``)."""
    try:
        from tqdm.auto import tqdm as bar  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError("trainstack.utils.tqdm needs the tqdm package. HINT: pip install tqdm.") from None
    if main_process_only and not PartialState().is_local_main_process:
        kwargs["disable"] = True
    return bar(*args, **kwargs)
