"""Accelerate's ``accelerate.local_sgd`` path: ``from trainstack.local_sgd import LocalSGD`` -- average the
processes' parameters every few steps instead of all-reducing gradients every step."""

from ._accelerate.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
