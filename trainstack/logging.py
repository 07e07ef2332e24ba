"""Accelerate's ``accelerate.logging`` path: ``from trainstack.logging import get_logger`` -- a logger whose
records only the main process writes (``main_process_only=False``: every process; ``in_order=True``: one after
the other)."""

from ._accelerate.logs import MultiProcessAdapter, get_logger

__all__ = ["get_logger", "MultiProcessAdapter"]
