"""Graceful stop: a signal or a stop file asks for it, every rank agrees at the same step, nobody saves in a
signal handler.

The handler only sets a flag. The training loop asks ``GracefulStop.agree`` every ``stop_check_every`` steps
and at every epoch end; the ranks agree with one small all-reduce on the CPU (gloo: no GPU sync), then the loop
writes a complete checkpoint at a step boundary, ``GracefulStop.confirm_saved`` tells the batch script, and
training stops. The generated sbatch scripts use the stop file: ``#SBATCH --signal=B:USR2@<grace>`` reaches only
the batch shell, whose trap touches ``$TRAINSTACK_STOP_FILE``; so no signal ever reaches NCCL's own handlers or
torchrun's agent.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .._common import envvars as envvars
from .._common.jobfiles import StopRequest
from ..errors import ConfigError

__all__ = ["GracefulStop", "resolve_signals", "DEFAULT_SIGNALS", "INTERRUPT"]

log = logging.getLogger(__name__)

_last_signal: list[tuple[float, int]] = [(float("-inf"), 0)]  # (time.monotonic, signal) of the last stop signal


def signalled_within(seconds: float) -> int | None:
    """The stop signal that reached this process in the last ``seconds``, if one did (a launcher's SIGTERM that
    arrived while a failed rank was still unwinding, taken by the graceful stop's flag)."""
    when, signum = _last_signal[0]
    return signum if time.monotonic() - when <= seconds else None


#: SIGUSR1 is avoided on purpose: NCCL installs its own handler for it (submitit#1697).
DEFAULT_SIGNALS = ("SIGUSR2",)
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def resolve_signals(names: Sequence[str] | None, environ: dict[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """Signal names from the config, else ``TRAINSTACK_STOP_SIGNALS`` (comma separated), else SIGUSR2."""
    env = os.environ if environ is None else environ
    if names is None:
        raw = env.get(envvars.STOP_SIGNALS)
        names = [n.strip() for n in raw.split(",") if n.strip()] if raw else list(DEFAULT_SIGNALS)
    if isinstance(names, str):
        raise ConfigError(f"stop signals {names!r} must be a list of signal names, e.g. ({names!r},) or "
                          f"[{names!r}], not a string.")
    out = []
    for name in names:
        key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
        try:
            sig = signal.Signals[key]
        except KeyError:
            raise ConfigError(f"stop signal {name!r} is not a signal name (e.g. SIGUSR2, SIGTERM).") from None
        if sig in _UNCATCHABLE:
            raise ConfigError(f"stop signal {name!r} cannot be caught by any program, so it cannot ask for a graceful "
                              f"stop. HINT: use SIGUSR2 or SIGTERM.")
        out.append(sig)
    return tuple(out)


INTERRUPT = "Ctrl-C"


class GracefulStop:
    """Collects stop requests (signals, a stop file, a Ctrl-C); the Trainer decides when to act on them.

    ``interrupt``: the first Ctrl-C (SIGINT) asks for a stop too, a second one aborts (KeyboardInterrupt). In a
    worker spawned by trainstack the launching process announces a Ctrl-C and relays it by creating
    ``TRAINSTACK_INTERRUPT_FILE`` (the only way when the SIGINT reached the launcher alone, as in a notebook); a
    SIGINT sent to the worker itself counts the same.
    """

    def __init__(self, signals: Sequence[signal.Signals], stop_file: str | os.PathLike | None,
                 interrupt: bool = False, announce: bool = False) -> None:
        self.signals = tuple(signals)
        self.stop_file = Path(stop_file) if stop_file else None
        self.received: str | None = None
        self.interrupt, self.announce = interrupt, announce
        marker = os.environ.get(envvars.INTERRUPT_FILE)
        self.interrupt_file = Path(marker) if interrupt and marker else None
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread (e.g. not in a notebook worker thread)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        if self.interrupt and signal.SIGINT not in self._previous:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
            self.announce = self.announce and self.interrupt_file is None  # a worker's launcher has announced it

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self.received == INTERRUPT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.received = INTERRUPT
        if self.announce:
            print("\ntrainstack: Ctrl-C: stopping at the next step boundary with a checkpoint (Ctrl-C again to "
                  "abort).", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name  # only a flag: saving here is unsafe (Lightning#21406)
        _last_signal[0] = (time.monotonic(), signum)

    def requested(self) -> str | None:
        """Why a stop is wanted here (this rank), or None."""
        if self.received:
            return INTERRUPT if self.received == INTERRUPT else f"signal {self.received}"
        if self.stop_file is not None and StopRequest.requested(self.stop_file):
            return f"stop file {self.stop_file}"
        if self.interrupt_file is not None and self.interrupt_file.exists():
            return INTERRUPT
        return None

    def agree(self, world_size: int, **wishes: bool) -> tuple[dict[str, bool], str | None]:
        """Collective: ``({wish: does any rank want it}, why a graceful stop was asked for, or None)``.

        ``wishes`` are this rank's own flags (e.g. ``stop=True`` from early stopping, ``nonfinite=True``); a graceful
        stop is for preemption and means "checkpoint and exit so the job can continue later". One all-reduce carries
        them all.
        """
        local = self.requested()
        if world_size <= 1:
            return {k: bool(v) for k, v in wishes.items()}, local
        from . import collectives as _collectives

        flags = _collectives.all_reduce_dict({**{k: float(v) for k, v in wishes.items()},
                                              "__preempt": float(local is not None),
                                              "__interrupt": float(local == INTERRUPT)}, "max")
        interrupted, asked = flags.pop("__interrupt"), flags.pop("__preempt")
        preempt = local or (INTERRUPT if interrupted else "another rank was asked to stop" if asked else None)
        return {k: bool(v) for k, v in flags.items()}, preempt

    @staticmethod
    def confirm_saved(checkpoint: Path | None) -> None:
        """Tell the batch script the checkpoint is complete, so it requeues the job (main process only)."""
        marker = os.environ.get(envvars.STOP_FILE)
        if marker:
            StopRequest.confirm_saved(marker, checkpoint)

    @staticmethod
    def confirm_finished(step: int) -> None:
        """Tell the batch script the run finished with its final checkpoint (main process only): a stop signal that
        arrives after this (while the script's own code runs after ``fit()``) is a preemption, not a crash, and the
        requeued attempt has nothing left to train."""
        marker = os.environ.get(envvars.STOP_FILE)
        if marker:  # a job folder gone meanwhile: the driver then books a signal as before
            StopRequest.confirm_finished(marker, step)
