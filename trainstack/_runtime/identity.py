"""Who this process is: the process layout in the environment that started it, this process's place in it and its
``torch.device`` -- each worked out once, forgotten when a restart in place takes the next job step's counters, never
pickled (a spawned worker works out its own). The Accelerator's collaborator (``accelerator.identity``)."""

from __future__ import annotations

from typing import Any

import torch

from ..environment import detect_environment
from ..errors import LaunchError
from . import layout as _layout
from .layout import ProcessPlan, WorkerContext, plan_processes

__all__ = ["ProcessIdentity"]


class ProcessIdentity:
    """The layout of ``nprocs`` processes here, and this process in it, on CUDA (``use_cuda``) or the CPU."""

    def __init__(self, nprocs: int, use_cuda: bool, compute_setup: str) -> None:
        self.nprocs, self.use_cuda, self.compute_setup = nprocs, use_cuda, compute_setup
        self.device_type = "cuda" if use_cuda else "cpu"
        self.forget()

    def forget(self) -> None:
        """Work everything out again at the next question (a rejoin: the next job step's rendezvous and counters)."""
        self._plan: ProcessPlan | None = None
        self._home: WorkerContext | None = None
        self._device: tuple[WorkerContext, torch.device] | None = None

    @property
    def plan(self) -> ProcessPlan:
        """The process layout in the current environment (computed once; its devices checked)."""
        if self._plan is None:
            self._plan = plan_processes(detect_environment(), self.nprocs)
            self._check_devices(self._plan)
        return self._plan

    def context(self) -> WorkerContext:
        """The running worker's identity, else the first process of the plan (this one)."""
        ctx = _layout.current()
        if ctx is not None:
            return ctx
        if self._home is None:
            gpus = torch.cuda.device_count() if self.use_cuda else 0
            self._home = self.plan.context(0, self.device_type, gpus)
        return self._home

    def device(self) -> torch.device:
        """This process's device (its ``torch.device`` is built once per identity: it sits on the per-step path)."""
        ctx = self.context()
        cached = self._device
        if cached is None or cached[0] is not ctx:
            cached = self._device = (ctx, torch.device(ctx.device))
        return cached[1]

    def _check_devices(self, plan: ProcessPlan) -> None:
        """One GPU per process: NCCL refuses two ranks on one device (with a raw 'Duplicate GPU detected')."""
        if not self.use_cuda:
            return
        count = torch.cuda.device_count()
        if plan.local_world_size > count:
            raise LaunchError(
                f"compute_setup={self.compute_setup!r} runs on the GPU here, with {plan.local_world_size} processes "
                f"on this node but only {count} visible CUDA device(s); NCCL needs one GPU per process. HINT: lower "
                f"nprocs (or --nproc-per-node) to {count}, request more GPUs (--gpus-per-node), or use "
                f"compute_setup='cpu' to train on CPU processes.")

    def __getstate__(self) -> dict[str, Any]:
        """The launching process's plan and identity stay there: a worker works out its own."""
        return {**self.__dict__, "_plan": None, "_home": None, "_device": None}
