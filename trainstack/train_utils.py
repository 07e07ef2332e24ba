"""qadence's ``ml_tools.train_utils`` path: ``from trainstack.train_utils import Accelerator`` works unchanged."""

from .accelerator import Accelerator

__all__ = ["Accelerator"]
