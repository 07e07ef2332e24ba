"""Accelerate's ``accelerate.state`` path: ``from trainstack.state import PartialState, AcceleratorState,
GradientState`` -- who this process is (joined to its group as soon as the state exists), the training settings,
and where the current loop stands. Same objects as ``Accelerator().state`` / ``.gradient_state``."""

from ._accelerate.state import AcceleratorState, DistributedType, GradientState, PartialState

__all__ = ["PartialState", "AcceleratorState", "GradientState", "DistributedType"]
