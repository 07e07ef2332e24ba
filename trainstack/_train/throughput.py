"""Throughput that is never silently wrong: FLOPs per step counted once, MFU over a known peak (or "n/a"), tokens.

* **FLOPs**: the run's second step runs under ``torch.utils.flop_counter.FlopCounterMode`` (forward and backward as
  they really run; one step, rank 0) -- times the accumulation steps, that is one optimizer step of one rank. A
  compiled model's kernels hide from that counter, so its forward and backward are counted once on fake tensors
  instead (``fake_step_flops``: the same operators, nothing computed, no state touched).
* **MFU** = FLOPs per step per rank x steps/s / the device's dense peak for the training dtype (bf16's for fp8
  runs too, as torchtitan reports them), from ``PEAK_TFLOPS`` or ``TRAINSTACK_PEAK_TFLOPS``; a device not in the
  table (a CPU) gets no MFU and the summary says why -- never a made-up number (torchtitan once reported 152 % on
  a GPU missing from its table; an fp8 run here once showed 322 % over the fp32 peak). Above 100 % it is not shown.
* **Step time split**: the share of wall time waiting for the loader (``data_wait``), inside ``optimizer.step``
  (``optimizer_share``, ``OptimizerTimer``) and the rest (forward, backward, the framework).
* **Tokens**: when a batch's first tensor holds integers in 2 dimensions (token ids), tokens/s = its elements x
  processes x accumulation x steps/s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._common import envvars as envvars
from ..errors import ConfigError

if TYPE_CHECKING:
    from .live import LiveLog

__all__ = ["PEAK_TFLOPS", "peak_flops", "FlopProbe", "OptimizerTimer", "tokens_in", "fake_step_flops", "measured"]

#: Dense peak TFLOP/s per device (vendor datasheets, no sparsity): bf16/fp16 tensor cores, TF32, plain fp32.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "V100": {"bf16": 125.0, "tf32": 15.7, "fp32": 15.7},
}


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(the device's peak FLOP/s for ``precision`` -- ``bf16``, ``fp16``, ``fp32`` --, where it came from)."""
    try:
        forced = envvars.positive_number(envvars.PEAK_TFLOPS)
    except ValueError as exc:
        raise ConfigError(f"{exc} (TFLOP/s of one device). HINT: unset it for the peak table.") from None
    if forced is not None:
        return forced * 1e12, f"{envvars.PEAK_TFLOPS}={os.environ[envvars.PEAK_TFLOPS]}"
    if device.type != "cuda":
        return None, f"no peak for {device.type} (set {envvars.PEAK_TFLOPS})"
    name = torch.cuda.get_device_name(device)
    kind = "bf16" if precision in ("bf16", "fp16", "fp8") else \
        "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    for key, row in PEAK_TFLOPS.items():
        if key in name:
            return row[kind] * 1e12, f"{key} {kind} peak {row[kind]:g} TFLOP/s"
    return None, f"{name!r} is not in the peak table (set {envvars.PEAK_TFLOPS})"


def tokens_in(batch: Any) -> int | None:
    """The token ids a batch holds: its first tensor when it has integers in 2 dimensions, else None."""
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, dict) and first:
        first = first.get("input_ids", next(iter(first.values())))
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point() \
            and first.dtype != torch.bool:
        return first.numel()
    return None


def fake_step_flops(model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any], batch: Any) -> int | None:
    """The FLOPs of one forward and backward of ``loss_fn(model, batch)``, counted on fake tensors with compiled code
    run eagerly: nothing is computed and no parameter, gradient, buffer or random state of the run is touched. None
    where it cannot be counted (sharded or tensor-parallel parameters, a torch without compile stances, a loss that
    needs real values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils._pytree import tree_map_only
    from torch.utils.flop_counter import FlopCounterMode

    stance = getattr(torch.compiler, "set_stance", None)
    module = getattr(model, "module", model)  # under DDP the wrapped module: DDP's hooks would all-reduce fakes
    named = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    if stance is None or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in named.values()):
        return None  # DTensors (FSDP2, tensor parallel) and other subclasses: not counted here
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes: dict[str, torch.Tensor] = {name: mode.from_tensor(t) for name, t in named.items()}
    fake_batch = tree_map_only(torch.Tensor, mode.from_tensor, batch)
    counter = FlopCounterMode(display=False)
    try:
        with stance("force_eager"), _reparametrize_module(module, fakes), mode, counter:
            out = loss_fn(module, fake_batch)
            loss = out[0] if type(out) is tuple else out
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
    except Exception:  # a loss or model that needs real values (.item(), data-dependent shapes): no MFU shown
        return None
    return counter.get_total_flops() or None


class FlopProbe:
    """The training step, watched for its first calls: after the first (the warm-up: a compile, the loader's start)
    the tokens per step are read and ``live``'s clock restarts, so no rate counts the warm-up; when MFU can be shown
    (a peak is known, the kernels are not compiled) the second call runs under torch's FLOP counter -- ~1 s for a
    small transformer, so never on the first step, never where no MFU is shown. Then it hands the plain step to
    ``done`` (the loop picks it up at the next epoch), costing nothing afterwards. ``clock``: the optimizer steps
    so far; ``first``: called once the first call returned (a resumed run records its first step)."""

    def __init__(self, step: Any, live: LiveLog, accumulation: int, world_size: int, count_flops: bool,
                 clock: Callable[[], int], done: Callable[[Any], None],
                 first: Callable[[], None] | None = None,
                 fake_count: Callable[[Any, Any], int | None] | None = None) -> None:
        self._step, self._live, self._accumulation, self._world = step, live, accumulation, world_size
        self._calls, self._count_flops, self._clock, self._done = 0, count_flops, clock, done
        self._first, self._fake_count = first, fake_count  # fake_count: (model, batch) -> FLOPs, for compiled models

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def __call__(self, model: Any, batch: Any) -> Any:
        if self._calls >= (2 if self._count_flops else 1):  # done (the loop holds this object until its epoch ends)
            return self._step(model, batch)
        self._calls += 1
        live = self._live
        if self._calls == 2 and self._count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            if self._fake_count is not None:  # compiled: the kernels hide their FLOPs; counted on fake tensors
                flops = self._fake_count(model, batch)
                out = self._step(model, batch)
            else:
                counter = FlopCounterMode(display=False)
                with counter:
                    out = self._step(model, batch)
                flops = counter.get_total_flops()
            live.flops_per_step = (flops or 0) * self._accumulation or None
        else:
            out = self._step(model, batch)
        if self._calls == 1:
            tokens = tokens_in(batch)
            if tokens:
                live.tokens_per_step = tokens * self._accumulation * self._world
            if self._first is not None:
                self._first()
        if self._calls >= (2 if self._count_flops else 1):
            self._done(self._step)
        live.restart(self._clock() + 1 / self._accumulation)  # this micro-batch of the step done
        return out


class OptimizerTimer:
    """Seconds spent in ``optimizer.step`` (rank 0), for the optimizer's share of step time: the host clock on a
    CPU; on a GPU a pair of CUDA events per step, read when the next live line has synced anyway -- never a sync
    per step. Two hooks on the optimizer, removed by ``close``."""

    def __init__(self, optimizer: Any, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._seconds = 0.0
        self._start: Any = None
        self._depth = 0  # a subclass's step calling super().step() runs the hooks twice, nested
        self._events: list[tuple[Any, Any]] = []
        self._handles = [optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after)] \
            if hasattr(optimizer, "register_step_pre_hook") else []
        self.measurable = bool(self._handles)  # no hooks (a gradient-free optimizer): no share, never a made-up 0

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        self._depth += 1
        if self._depth > 1:
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
        if callable(closure):  # a closure step (LBFGS, a custom optimizer): forward and backward run inside step()
            if self._cuda:  # device time of the closure cannot be told apart without a sync: no share then
                self.measurable = False
                return None
            args, kwargs = ((args[0], self._timed(closure), *args[2:]), kwargs) if len(args) > 1 else \
                (args, {**kwargs, "closure": self._timed(closure)})
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return args, kwargs

    def _timed(self, closure: Any) -> Any:
        """The closure, its time taken off the optimizer's (it is forward and backward)."""
        def timed() -> Any:
            start = time.perf_counter()
            try:
                return closure()
            finally:
                self._seconds -= time.perf_counter() - start
        return timed

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth or self._start is None:
            return
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
            if len(self._events) > 512:  # no line for a long while: fold the finished ones (query() never syncs)
                self.seconds()
        else:
            self._seconds += time.perf_counter() - self._start
        self._start = None

    def seconds(self) -> float | None:
        """The total so far (CUDA events that have completed; a line's ``.item()`` has synced the ones before it);
        None when it cannot be measured without a sync."""
        if not self.measurable:
            return None
        done = 0
        for start, end in self._events:
            if not end.query():
                break
            self._seconds += start.elapsed_time(end) / 1e3
            done += 1
        del self._events[:done]
        return self._seconds

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def measured(step: Any, live: Any, optimizer: Any, loss_fn: Any, custom_step: bool, device: torch.device,
             precision: str, compiled: bool, accumulation: int, world: int, main: bool, clock: Callable[[], int],
             done: Callable[[Any], None], first: Callable[[], None] | None) -> tuple[Any, str]:
    """``step`` as the live lines measure it: the device's peak (MFU's denominator) on ``live``, and on rank 0
    the optimizer's time and the FLOPs of each step -- only where MFU shows (a peak); a compiled model's counted on
    fake tensors (its kernels hide them), a custom optimize_step's not (what it runs is its own). (The step, the
    peak's source.)"""
    live.peak, source = peak_flops(device, precision)
    if not main:
        return step, source
    live.optimizer_timer = OptimizerTimer(optimizer, device)
    fake = None
    if compiled and not custom_step:
        fake = lambda model, batch: fake_step_flops(model, loss_fn, batch)  # noqa: E731
    return FlopProbe(step, live, accumulation, world, bool(live.peak) and (not compiled or fake is not None),
                     clock=clock, done=done, first=first, fake_count=fake), source
