"""Hang forensics: a stuck job names the rank that is stuck and where, then exits so it can be restarted.

* ``Heartbeat``: what this rank is doing (step, phase, a tick for progress inside a phase, how many steps it
  finished). The training loop writes its attributes (no call, no collective, no host sync).
* ``Watchdog``: one daemon thread per rank. Every few seconds it publishes this rank's heartbeat to the process
  group's key-value store and reads everyone's. It is *armed* from the start in the Trainer, and otherwise at the
  first heartbeat (a custom loop that never beats is never killed); the log says when. Once armed, when no rank has
  made progress for ``hang_timeout`` seconds (three times that until every rank finished its first step, and while
  any rank checkpoints or runs callbacks), every rank dumps the Python stacks of all its threads into
  ``<dir>/hang-<id>/rank-<r>.txt``; the first rank that noticed writes and prints ``SUMMARY.txt`` (ranks grouped by
  step and phase, the laggards named with host, pid and innermost user frame; a rank stuck holding the GIL sends
  none and is named for it), and every rank exits with code 124, so ``torchrun --max-restarts`` or a requeue
  restarts the job from its last checkpoint.
* A rank whose watchdog thread fell silent (its process or its node gone, while the others still beat): rank 0
  names it after ``lost_after`` seconds (three intervals, at least 15 s), records ``ranks_lost`` in the job's
  events and exits with ``LOST_EXIT_CODE``, so the batch script tears the step down and retries without it -- long
  before a collective timeout or Slurm's SlurmdTimeout. Rank 0 also keeps ``progress`` in the job folder (the
  furthest step any rank reached, each interval): what a crashed attempt reached.
* On demand (``trainstack debug JOBID``): a ``debug-request-<id>`` file in the job folder makes every rank dump its
  stacks into ``<job folder>/debug-<id>/`` and rank 0 write the summary, without stopping anything.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from .._common import envvars as envvars
from .._common import jobevents as jobevents
from .._common.files import atomic_write
from .._common.jobfiles import JobFiles, rank_stacks
from .._common.text import number_ranges
from .stragglers import Stragglers, resolve_ratio

__all__ = ["Heartbeat", "Watchdog", "heartbeat", "HANG_EXIT_CODE", "start", "stop", "resolve_timeout",
           "DEFAULT_TIMEOUT_S", "watched", "summarise", "where", "dump_stacks", "phase", "HANG_REPORT"]

HANG_EXIT_CODE = 124
LOST_EXIT_CODE = 75  # EX_TEMPFAIL: a peer is gone; the step is retried without it
LOST_AFTER_MIN_S = 15.0
_SUMMARY = "trainstack/hb/summary"  # rank 0's summary of every rank's heartbeat
HANG_REPORT = "stopped by the hang watchdog"  # how a worker's error report starts when the watchdog ended it
DEFAULT_TIMEOUT_S = 600.0
_PHASE_ORDER = ("start", "data", "forward", "backward", "optimizer", "step", "after", "checkpoint", "eval",
                "callback")
#: Phases that may legitimately take long without a tick: the allowance is three times the timeout.
_SLOW_PHASES = ("start", "checkpoint", "callback")
_COLLECTIVES = ("all_reduce", "barrier", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather",
                "scatter", "reduce", "send", "recv", "monitored_barrier", "all_gather_object", "broadcast_object_list",
                "_engine_run_backward", "wait")


class Heartbeat:
    """This rank's progress; written by the loop as plain attribute stores, read by the watchdog thread.

    ``beats`` counts finished steps since the watchdog started (a first step may compile for minutes). Setting
    ``phase`` also adds the time spent in the phase before to ``spent`` (seconds per phase, cumulative: a clock
    read, no host sync), the straggler detector's and the goodput ledger's input; ``loop_started`` and
    ``first_beat`` are the wall times the loop began and its first step ended.
    """

    __slots__ = ("step", "tick", "_beats", "_phase", "_since", "spent", "loop_started", "first_beat")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step, self.tick, self._beats, self._phase, self._since = 0, 0, 0, "start", time.perf_counter()
        self.spent: dict[str, float] = {}
        self.loop_started: float | None = None
        self.first_beat: float | None = None

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        now, before = time.perf_counter(), self._phase
        self.spent[before] = self.spent.get(before, 0.0) + now - self._since
        if before == "start" and name != "start" and self.loop_started is None:
            self.loop_started = time.time()
        self._phase, self._since = name, now

    @property
    def beats(self) -> int:
        return self._beats

    @beats.setter
    def beats(self, value: int) -> None:
        if self._beats == 0 and value > 0:
            self.first_beat = time.time()
        self._beats = value

    def times(self) -> dict[str, float]:
        """Seconds spent in each phase so far, the current one included."""
        out = dict(self.spent)
        out[self._phase] = out.get(self._phase, 0.0) + time.perf_counter() - self._since
        return out


_HEARTBEAT = Heartbeat()


def heartbeat() -> Heartbeat:
    """This process's heartbeat (one per process)."""
    return _HEARTBEAT


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a block (a checkpoint, callbacks, reports) for the watchdog, then restore the previous phase."""
    hb = _HEARTBEAT
    before, hb.phase = hb.phase, name
    try:
        yield
    finally:
        hb.phase = before
        hb.tick += 1


def resolve_timeout(value: float | None) -> float:
    """``hang_timeout`` from the config, else ``TRAINSTACK_HANG_TIMEOUT``, else 600 s; 0 turns the watchdog off."""
    if value is not None:
        return float(value)
    try:
        return envvars.positive_number(envvars.HANG_TIMEOUT, DEFAULT_TIMEOUT_S, allow_zero=True)
    except ValueError as exc:
        from ..errors import ConfigError

        raise ConfigError(f"{exc} (seconds; 0 turns the hang watchdog off).") from None


# ---------------------------------------------------------------------------------------------------- stacks
def _library_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
             str(Path(__file__).resolve().parent)}
    try:
        import torch

        roots.add(str(Path(torch.__file__).resolve().parent))
    except ImportError:  # pragma: no cover
        pass
    return tuple(sorted(roots))


def _frames(frame: FrameType | None) -> list[FrameType]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out  # innermost first


def where(frame: FrameType | None, roots: tuple[str, ...]) -> dict[str, str | None]:
    """The innermost frame of the user's code, and the collective this thread waits in (if any)."""
    user, waiting = None, None
    for f in _frames(frame):
        name, path = f.f_code.co_name, str(Path(f.f_code.co_filename).resolve())
        if waiting is None and name in _COLLECTIVES and "torch" in path:
            waiting = "backward (gradient all-reduce)" if name == "_engine_run_backward" else name
        if user is None and not path.startswith(roots) and "site-packages" not in path:
            user = f"{Path(path).name}:{f.f_lineno} ({name})"
    return {"user_frame": user, "waiting_in": waiting}


def dump_stacks(path: Path) -> dict[str, str | None]:
    """Write every thread's Python stack to ``path``; return where the main thread is."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    lines = [f"pid {os.getpid()} on {host}, rank {os.environ.get('RANK', '?')}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"]
    for ident, frame in frames.items():
        lines.append(f"\n--- thread {names.get(ident, '?')} ({ident}) ---\n")
        lines.extend(traceback.format_stack(frame))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    main = threading.main_thread().ident
    return where(frames.get(main) if main is not None else None, _library_roots())


def summarise(infos: dict[int, dict[str, Any]], world: int, reason: str) -> str:
    """The plain-words report: ranks grouped by step and phase, the ones behind first (the laggards)."""
    def key(info: dict[str, Any]) -> tuple[int, int]:
        phase = info.get("phase", "start")
        return int(info.get("step", 0)), _PHASE_ORDER.index(phase) if phase in _PHASE_ORDER else 0

    lines = [reason, ""]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank, info in infos.items():
        desc = info.get("waiting_in") and f"waiting in {info['waiting_in']}" or f"in {info.get('user_frame')}"
        groups.setdefault((key(info), info.get("phase"), desc), []).append(rank)
    lowest = min((key(i) for i in infos.values()), default=(0, 0))
    for (k, phase, desc), ranks in sorted(groups.items(), key=lambda item: item[0][0]):
        behind = k == lowest and len(groups) > 1
        if len(ranks) == 1:
            info = infos[ranks[0]]
            who = f"rank {ranks[0]} ({info.get('host')}, pid {info.get('pid')})"
            verb = "is"
        else:
            who, verb = f"ranks {number_ranges(ranks)}", "are"
        lines.append(f"{who} {verb} at step {k[0]} ({phase}) {desc}{'   <- behind the others' if behind else ''}")
    missing = sorted(set(range(world)) - set(infos))
    if missing:
        lines.append(f"ranks {number_ranges(missing)} sent no report (their process may be gone, or stuck with the GIL "
                     f"held: see their stack files if any, or run py-spy dump on them)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- the thread
class Watchdog(threading.Thread):
    """See the module docstring. ``store`` is the process group's store (None: this rank alone)."""

    def __init__(self, rank: int, world: int, timeout: float, dump_dir: Path, store: Any = None,
                 job_dir: Path | None = None, report_file: str | None = None, armed: bool = False) -> None:
        super().__init__(name="trainstack-watchdog", daemon=True)
        self.rank, self.world, self.timeout = rank, world, timeout
        self.dump_dir, self.store, self.job_dir, self.report_file = Path(dump_dir), store, job_dir, report_file
        self.interval = max(min(5.0, timeout / 6 if timeout else 5.0), 0.2)
        self.armed = bool(armed and timeout)  # the Trainer's banner says so
        self.first_window = 0.0  # the least the first step may take (it compiles): first_step_window()
        self._halt = threading.Event()
        self._seen: dict[int, tuple[Any, ...]] = {}
        self._changes = 0  # rank 0: changes of any rank's heartbeat seen so far
        self._seq = -1  # the change count at the last progress this rank knows of
        self._published = 0  # rank 0: summaries published
        self._last_published: Any = None  # another rank: the last summary it read
        self._last_change = time.monotonic()
        self._started_steps: set[int] = set()
        self._answered: set[str] = set()
        self._alive = 0  # this thread's own tick: a rank whose count stops moving is gone (or holds the GIL)
        self._host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._alive_seen: dict[int, tuple[int, float, int]] = {}  # rank 0: each rank's count, when it last moved
        # (and rank 0's own count then)
        self.lost_after = max(3 * self.interval, LOST_AFTER_MIN_S)
        self.stragglers = Stragglers(resolve_ratio()) if rank == 0 and world > 1 else None

    def stop(self) -> None:
        self._halt.set()

    # -- the loop
    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self._tick()
            except Exception as exc:  # the watchdog must never take training down
                print(f"trainstack watchdog (rank {self.rank}): {type(exc).__name__}: {exc}", file=sys.stderr)
        if self.rank == 0:
            self.write_ledger()
        if self.store is not None and self.world > 1:  # a rank that ended its run is not a lost one
            with contextlib.suppress(Exception):
                self.store.set(f"trainstack/hb/{self.rank}", json.dumps({"ended": True}))

    def _tick(self) -> None:
        hb = _HEARTBEAT
        self._alive += 1
        mine = {"step": hb.step, "phase": hb.phase, "tick": hb.tick, "beats": hb.beats, "alive": self._alive,
                "host": self._host, "spent": {k: round(v, 4) for k, v in hb.times().items()}}
        view = self._exchange(mine)
        now = time.monotonic()
        if view["seq"] != self._seq:  # some rank moved on (rank 0 counts the changes it sees)
            self._seq, self._last_change = view["seq"], now
        self._answer_debug_requests()
        if not self.armed and self.timeout and view["beating"]:
            self._arm("at the first heartbeat")
        if self.armed and now - self._last_change > view["allowance"]:
            self._on_hang(now - self._last_change)

    def _arm(self, when: str) -> None:
        self.armed = True
        self._last_change = time.monotonic()
        if self.rank == 0:
            print(f"trainstack: hang watchdog armed {when} ({self.timeout:g} s without progress: stacks to "
                  f"{self.dump_dir}/hang-<time>/, exit 124; TRAINSTACK_HANG_TIMEOUT=0 turns it off)", file=sys.stderr,
                  flush=True)

    def _allowance(self, everyone: dict[int, dict[str, Any]]) -> float:
        """Three times the timeout until every rank finished its first step (at least the compile window when the
        first step compiles), and while any rank is in a slow phase (checkpointing, callbacks)."""
        first = any(int(b.get("beats") or 0) < 1 for b in everyone.values()) or len(everyone) < self.world
        slow = any(b.get("phase") in _SLOW_PHASES for b in everyone.values())
        allowance = self.timeout * (3 if first or slow else 1)
        return max(allowance, self.first_window) if first else allowance

    def _exchange(self, mine: dict[str, Any]) -> dict[str, Any]:
        """This rank's heartbeat out, the run's state in: ``seq`` (a count of the changes seen so far), whether any
        rank beats yet, and the allowance. O(N) store operations per interval over all ranks: every rank writes its
        heartbeat, rank 0 alone reads them all and publishes one summary, every other rank reads that summary --
        not every rank reading every rank (N², a store meltdown at 1,000 ranks). A summary rank 0 stopped updating
        (its process stuck) counts as no progress."""
        if self.store is None or self.world == 1:
            return self._summarise({self.rank: mine})
        self.store.set(f"trainstack/hb/{self.rank}", json.dumps(mine))
        if self.rank == 0:
            keys = [f"trainstack/hb/{r}" for r in range(self.world)]
            everyone = {r: json.loads(v) for r, v in enumerate(self._read_all(keys)) if v}
            view = self._summarise(everyone)
            self.store.set(_SUMMARY, json.dumps({**view, "published": self._published}))
            self._published += 1
            return view
        raw = self.store.get(_SUMMARY) if self.store.check([_SUMMARY]) else None
        view = json.loads(raw) if raw else {"seq": self._seq, "beating": False, "allowance": self._allowance({})}
        if view.get("published") == self._last_published:  # rank 0 published nothing new since the last look
            view["seq"] = self._seq
        self._last_published = view.get("published")
        return view

    def _read_all(self, keys: list[str]) -> list[bytes | None]:
        """Every heartbeat in one request where the store can (``multi_get``), else one check and get each."""
        present = self.store.check(keys)
        if present and hasattr(self.store, "multi_get"):
            return list(self.store.multi_get(keys))
        return [self.store.get(k) if self.store.check([k]) else None for k in keys]

    def _summarise(self, everyone: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Rank 0's view of every rank: the change count, whether any beats, the allowance now; a rank gone silent
        ends the step (``_on_lost``)."""
        if self.rank == 0:
            self._watch_alive(everyone)
            self._watch_pace(everyone)
        for rank, beat in everyone.items():
            state = (beat.get("step"), beat.get("phase"), beat.get("tick"), beat.get("beats"))
            if self._seen.get(rank) != state:
                self._seen[rank] = state
                self._changes += 1
        return {"seq": self._changes, "beating": any(b.get("beats") or b.get("step") for b in everyone.values()),
                "allowance": self._allowance(everyone)}

    def _watch_alive(self, everyone: dict[int, dict[str, Any]]) -> None:
        """Rank 0: each rank's watchdog count; ranks whose count stood still for ``lost_after`` seconds (and three
        of rank 0's own ticks: not a pause of the whole machine) are lost. Also the furthest step reached, into the
        job folder's ``progress``."""
        now, lost = time.monotonic(), []
        for rank, beat in everyone.items() if len(everyone) > 1 else ():
            if beat.get("ended") or "alive" not in beat:
                self._alive_seen.pop(rank, None)
                continue
            count = int(beat["alive"])
            before = self._alive_seen.get(rank)
            if before is None or before[0] != count:
                self._alive_seen[rank] = (count, now, self._alive)
            elif now - before[1] > self.lost_after and self._alive - before[2] >= 3:  # rank 0 itself kept ticking
                lost.append(rank)
        if lost:  # a frozen node's other ranks went quiet within one interval of each other: name them together
            hosts = {everyone[r].get("host") for r in lost}
            lost = sorted(set(lost) | {r for r, (_, since, _) in self._alive_seen.items()
                                       if everyone.get(r, {}).get("host") in hosts
                                       and now - since > self.interval})
        steps = [int(b["step"]) for b in everyone.values() if isinstance(b.get("step"), int)]
        if self.job_dir is not None and steps:
            with contextlib.suppress(OSError):
                JobFiles.mine(self.job_dir).write_progress(max(steps))
        if lost:
            self._on_lost(lost, everyone)
        self.write_ledger()

    def _watch_pace(self, everyone: dict[int, dict[str, Any]]) -> None:
        """Rank 0: a rank persistently slower than the others in a phase of its own is named (the log, the job's
        events, the live line); named again as recovered once it keeps pace."""
        if self.stragglers is None:
            return
        new, cleared = self.stragglers.observe(everyone)
        for found in new:
            print(f"trainstack: straggler: {found.describe()} (step {found.step})", file=sys.stderr, flush=True)
            jobevents.record("straggler", **found.fields())
        for found in cleared:
            print(f"trainstack: rank {found.rank} ({found.host}) keeps pace again (step {found.step})",
                  file=sys.stderr, flush=True)
            jobevents.record("straggler_cleared", rank=found.rank, host=found.host, step=found.step)

    def write_ledger(self) -> None:
        """Rank 0: this job step's time so far, by phase, into ``<job folder>/ledger/<attempt>.json`` (the goodput
        ledger's input; rewritten each interval, so a crash loses at most one interval of it)."""
        if self.job_dir is None:
            return
        hb = _HEARTBEAT
        record = {"attempt": int(os.environ.get(envvars.ATTEMPT) or 0),
                  "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                  "step_index": int(os.environ.get(envvars.STEP) or 0), "spent": hb.times(), "beats": hb.beats,
                  "step": hb.step, "loop_started": hb.loop_started, "first_beat": hb.first_beat,
                  "time": time.time()}
        with contextlib.suppress(OSError):
            ledger = JobFiles.mine(self.job_dir).own_ledger_dir()
            atomic_write(ledger / f"{record['attempt']}.json", json.dumps(record))

    def _on_lost(self, lost: list[int], everyone: dict[int, dict[str, Any]]) -> None:
        hosts = sorted({str(everyone[r].get("host")) for r in lost})
        step = max((int(b["step"]) for b in everyone.values() if isinstance(b.get("step"), int)), default=0)
        line = (f"trainstack: rank{'s' if len(lost) > 1 else ''} {number_ranges(lost)} ({', '.join(hosts)}) stopped "
                f"answering at step {step}: no heartbeat for {self.lost_after:.0f} s (the process or its node is gone, "
                f"or it holds the GIL); ending this step (exit {LOST_EXIT_CODE}) so it is retried without it")
        print(line, file=sys.stderr, flush=True)
        jobevents.record("ranks_lost", ranks=lost, hosts=hosts, step=step)
        from . import ranklog as _ranklog

        _ranklog.close(timeout=2.0)
        os._exit(LOST_EXIT_CODE)

    # -- reports
    def _report(self, folder: Path, reason: str, reporter: int = 0, wait_s: float = 20.0) -> str | None:
        """Every rank dumps its stacks and shares where it is; ``reporter`` gathers, writes and returns the
        summary (a rank that sends nothing, e.g. stuck holding the GIL, is named as such)."""
        info = {"host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "pid": os.getpid(),
                "step": _HEARTBEAT.step, "phase": _HEARTBEAT.phase, **dump_stacks(folder / rank_stacks(self.rank))}
        key = f"trainstack/report/{folder.name}"
        if self.store is not None and self.world > 1:
            self.store.set(f"{key}/{self.rank}", json.dumps(info))
        if self.rank != reporter:
            return None
        infos = {self.rank: info}
        deadline = time.monotonic() + wait_s
        while self.store is not None and len(infos) < self.world and time.monotonic() < deadline:
            for rank in range(self.world):
                if rank not in infos and self.store.check([f"{key}/{rank}"]):
                    infos[rank] = json.loads(self.store.get(f"{key}/{rank}"))
            time.sleep(0.2)
        text = summarise(infos, self.world, reason)
        (folder / "SUMMARY.txt").write_text(text)
        return text

    def _on_hang(self, stalled: float) -> None:
        stamp, reporter = time.strftime("%Y%m%d-%H%M%S"), self.rank
        if self.store is not None and self.world > 1:  # one folder for every rank; the first to notice reports
            won = self.store.compare_set("trainstack/hang/id", "", f"{stamp}/{self.rank}").decode()
            stamp, _, first = won.partition("/")
            reporter = int(first) if first.isdigit() else self.rank
        folder = self.dump_dir / f"hang-{stamp}"
        reason = (f"trainstack hang report: no rank made progress for {stalled:.0f} s (hang_timeout="
                  f"{self.timeout:g} s); {self.world} rank(s), stacks in {folder}/rank-<r>.txt")
        text = self._report(folder, reason, reporter)
        if text is not None:
            print(f"\n{text}", file=sys.stderr, flush=True)
            behind = [line for line in text.splitlines() if "behind" in line or "sent no report" in line]
            jobevents.record("hang", reason=reason, behind=behind[:3], folder=str(folder))
            if self.store is not None and self.world > 1:
                self.store.set("trainstack/hang/done", "1")
        elif self.store is not None:
            try:  # the reporter writes the summary before anyone exits
                self.store.wait(["trainstack/hang/done"], datetime.timedelta(seconds=30))
            except Exception:  # the wait timed out, or rank 0 is gone
                pass
        self._leave(folder, text)

    def _leave(self, folder: Path, text: str | None) -> None:
        if self.report_file:  # the launching process shows this as the worker's error
            summary = folder / "SUMMARY.txt"
            body = text or (summary.read_text() if summary.exists() else f"see {folder}")
            Path(self.report_file).write_text(f"{HANG_REPORT}\n{body}")
        sys.stderr.flush()
        sys.stdout.flush()
        from . import ranklog as _ranklog

        _ranklog.close(timeout=2.0)
        os._exit(HANG_EXIT_CODE)

    def _answer_debug_requests(self) -> None:
        """``trainstack debug`` drops ``debug-request-<id>`` into the job folder: dump, summarise, carry on."""
        if self.job_dir is None or not self.job_dir.is_dir():
            return
        for request in self.job_dir.glob("debug-request-*"):
            ident = request.name[len("debug-request-"):]
            if ident in self._answered:
                continue
            self._answered.add(ident)
            folder = self.job_dir / f"debug-{ident}"
            self._report(folder, f"trainstack debug report {ident}: {self.world} rank(s), stacks in "
                                 f"{folder}/rank-<r>.txt", wait_s=3 * self.interval + 5)


_current: Watchdog | None = None


def start(rank: int, world: int, timeout: float, dump_dir: Path, store: Any = None,
          armed: bool = False) -> Watchdog | None:
    """Start this process's watchdog (replacing a running one); None when there is nothing to watch for.

    ``armed``: hang timeouts apply from the start (the Trainer's loop beats); otherwise from the first heartbeat.
    """
    global _current
    stop()
    job_dir = Path(os.environ[envvars.JOB_DIR]) if os.environ.get(envvars.JOB_DIR) else None
    if not timeout and job_dir is None:
        return None
    _HEARTBEAT.reset()
    _current = Watchdog(rank, world, timeout, dump_dir, store, job_dir, os.environ.get(envvars.ERROR_REPORT),
                        armed)
    _current.start()
    return _current


def first_step_window(seconds: float) -> None:
    """Allow the first step at least ``seconds`` on every rank (it compiles: ``torch.compile``)."""
    if _current is not None:
        _current.first_window = seconds


def write_ledger() -> None:
    """Rank 0: this job step's time by phase into the job folder now (the end summary's goodput reads it)."""
    if _current is not None and _current.rank == 0:
        _current.write_ledger()


def stragglers_now() -> str:
    """The ranks rank 0's watchdog names as stragglers now, for the live line ("" when none)."""
    named = _current.stragglers.named if _current is not None and _current.stragglers is not None else {}
    return "; ".join(f"straggler rank {s.rank} ({s.host}) {s.phase} {s.ratio:.1f}x" for s in named.values())


def stop() -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current.join(timeout=2 * _current.interval + 1)
        _current = None


def default_store() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


@contextlib.contextmanager
def watched(rank: int, world: int, timeout: float, dump_dir: Path) -> Iterator[None]:
    """Run the block with this process's watchdog (after the process group is up, stopped before it goes)."""
    dog = start(rank, world, timeout, dump_dir, default_store())
    try:
        yield
    finally:
        if dog is not None:
            stop()
