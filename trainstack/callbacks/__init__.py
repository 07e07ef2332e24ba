"""Callbacks: everything beyond the core loop hangs off these events."""

from .base import EVENTS, Callback, OptimizeResult
from .builtin import (
    EarlyStopping,
    GradientMonitoring,
    LoadCheckpoint,
    LogHyperparameters,
    LogModelTracker,
    LRScheduler,
    LRSchedulerCosineAnnealing,
    LRSchedulerCyclic,
    LRSchedulerStepDecay,
    PlotMetrics,
    PrintMetrics,
    SaveCheckpoint,
    WriteMetrics,
)
from .checkpointing import ModelCheckpoint, SaveBestCheckpoint
from .manager import CallbackManager

__all__ = ["EVENTS", "Callback", "OptimizeResult", "CallbackManager", "EarlyStopping",
           "GradientMonitoring", "LoadCheckpoint", "LogHyperparameters", "LogModelTracker", "LRScheduler",
           "LRSchedulerCosineAnnealing", "LRSchedulerCyclic", "LRSchedulerStepDecay", "ModelCheckpoint", "PlotMetrics",
           "PrintMetrics", "SaveBestCheckpoint", "SaveCheckpoint", "WriteMetrics"]
