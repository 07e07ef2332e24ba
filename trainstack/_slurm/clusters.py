"""One run across several clusters: where to run next, and the follower that keeps the run going wherever there are
nodes (``trainstack submit --cluster a.toml --cluster b.toml --store URL``).

Each cluster is a site profile (its login node as ``host``, or ``slurm_conf`` for a second Slurm on this machine;
its partition, nodes, container, scratch). The run's single source of truth is its checkpoint store: every attempt
takes the run's lease there and resumes from its newest committed checkpoint (``trainstack._common.lease``), so the
jobs on the clusters are caches of one run. The follower runs where the user is (``submit`` without returning, or
``--hedge``): it asks each cluster when a job would start (``sbatch --test-only``, and whether the partition is up),
submits where the run starts first once the cost of a move is counted, and watches the job; when the job ends
without finishing (preempted, its node lost, a time limit) or waits in a queue while another cluster would start it
sooner by more than the move costs plus a margin, the run moves: the job is cancelled (never two writers: the lease
would stop the older anyway) and submitted on the other cluster, which resumes at the exact sample.
Every decision is a pure function below, unit-tested; only ``Follower`` talks to clusters (through trainstack's own
CLI, here or over ssh). Torch-free.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._common import envvars as envvars

__all__ = ["Cluster", "choose", "Follower", "MOVABLE", "DEFAULT_MOVE_COST_S", "DEFAULT_MARGIN_S",
           "measured_move_cost"]

#: Verdicts after which the run continues elsewhere (or here again): the job did not fail by itself.
MOVABLE = ("preempted", "node failure", "time limit", "terminated", "superseded", "unknown")
#: A move's cost when the run has not measured one: upload + download of a checkpoint, start-up, a cold compile.
DEFAULT_MOVE_COST_S = 120.0
#: Hysteresis: a move must win by this much more than its cost (no flapping between two similar queues).
DEFAULT_MARGIN_S = 60.0
#: While the run's job waits, every cluster is asked again this often (each ask renders and test-submits there).
LOOK_EVERY_S = 20.0
#: Answers of ``sbatch --test-only`` that no wait changes: the run cannot start there as asked.
PERMANENT = ("Invalid partition", "Unable to process configuration", "Invalid account", "Invalid qos",
             "Requested node configuration is not available", "Invalid generic resource", "Invalid feature")
#: Polls in a row in which neither Slurm nor the job folder knows the run's job: it is gone, the run continues.
LOST_POLLS = 12


@dataclass(frozen=True)
class Cluster:
    """One cluster of the run: a name, its site profile, and how to reach its Slurm (``host`` over ssh, or
    ``slurm_conf`` on this machine)."""

    name: str
    profile: str
    host: str | None = None
    slurm_conf: str | None = None
    scratch: str | None = None  # where the run's newest checkpoint is pre-staged while its job waits there

    @classmethod
    def from_profile(cls, path: str, profile: dict[str, Any]) -> Cluster:
        name = str(profile.get("cluster") or Path(path).stem)
        return cls(name, path, profile.get("host"), profile.get("slurm_conf"), profile.get("scratch"))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop(envvars.HOST, None)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    def trainstack(self, args: Sequence[str], timeout: float = 600) -> subprocess.CompletedProcess:
        """``trainstack ARGS`` for this cluster (``--host`` added where it has one), as a child process."""
        host = ["--host", self.host] if self.host and args and args[0] in ("status", "cancel", "why") else []
        if self.host and args[:2] == ["checkpoint", "stage"]:
            return subprocess.run([sys.executable, "-m", "trainstack", "checkpoint", "stage", "--host", self.host,
                                   *args[2:]], env=self.env(), capture_output=True, text=True, timeout=timeout)
        return subprocess.run([sys.executable, "-m", "trainstack", *args[:1], *host, *args[1:]], env=self.env(),
                              capture_output=True, text=True, timeout=timeout)


def choose(starts: dict[str, float | None], current: str | None, move_cost_s: float, margin_s: float) -> str | None:
    """Where the run should be: the cluster whose job would start first, a move counted at its cost plus a margin
    against the cluster the run is on (``current``); None when no cluster can start it. ``starts`` maps each
    cluster to the seconds until a job there would start (None: not now -- a partition down, no such nodes)."""
    def cost(name: str) -> float:
        wait = starts.get(name)
        if wait is None:
            return math.inf
        return wait if name == current or current is None else wait + move_cost_s

    ranked = sorted(starts, key=lambda n: (cost(n), n != current, n))
    best = ranked[0] if ranked else None
    if best is None or math.isinf(cost(best)):
        return None
    if current is not None and best != current and cost(current) - cost(best) <= margin_s \
            and not math.isinf(cost(current)):
        return current  # not worth moving: within the margin
    return best


def measured_move_cost(previous: dict[str, Any] | None) -> float | None:
    """What the run's earlier moves cost (``run-ledger.json`` of an earlier follower of the run): the mean of start-up,
    transfer and cold compile of the jobs on a cluster the run came to; None when it has none."""
    try:  # the store's file is data: anything malformed counts as no measurement
        moved = [m for m in (previous or {}).get("moves", []) if m.get("moved_in") and m.get("ledger")]
        costs = [sum(float(m["ledger"]["parts"].get(k, 0.0)) for k in ("startup", "compile")) for m in moved]
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return sum(costs) / len(costs) if costs else None


def parse_test_only(text: str, now: float | None = None) -> float | None:
    """Seconds until ``sbatch --test-only`` says the job would start ("sbatch: Job 3 to start at
    2026-11-28T14:51:01 using ..."); None when it says it cannot."""
    import re

    m = re.search(r"to start at (\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})", text)
    if not m:
        return None
    at = time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
    return max(0.0, at - (time.time() if now is None else now))


@dataclass
class Move:
    """One placement of the run: where, which job, when it was decided and why; ``left`` once the run moved away
    from it, ``ledger`` its own goodput ledger once it ended."""

    cluster: str
    job: str
    decided: float
    reason: str
    left: bool = False
    ledger: dict[str, Any] | None = None


@dataclass
class Follower:
    """Keeps one run going across ``clusters`` until it completes or fails by itself. ``submit_args``: the submit
    command line for one cluster (without ``--profile``), the run's store given to the job by its environment.
    ``hedge``: submit to every cluster that can start the run and keep the first job that starts (the others are
    cancelled; the lease keeps one writer even if two start together)."""

    clusters: list[Cluster]
    submit_args: list[str]
    store: str
    say: Callable[[str], None]
    move_cost_s: float = DEFAULT_MOVE_COST_S
    margin_s: float = DEFAULT_MARGIN_S
    poll_s: float = 5.0
    max_moves: int = 20
    hedge: bool = False
    moves: list[Move] = field(default_factory=list)
    worlds: dict[str, int] = field(default_factory=dict)  # each cluster's number of processes, as its submit says
    planned_world: int | None = None  # the first placement's: a move elsewhere keeps its global batch
    reasons: dict[str, str] = field(default_factory=dict)  # each cluster's last answer, said when none can start
    _staged: set[str] = field(default_factory=set)  # the jobs whose cluster got the newest checkpoint pre-staged

    def _named(self, name: str) -> Cluster:
        return next(c for c in self.clusters if c.name == name)

    def expected_starts(self) -> dict[str, float | None]:
        """When each cluster would start the run's job (None: not now), each one's reason kept (``reasons``)."""
        starts: dict[str, float | None] = {}
        for cluster in self.clusters:
            out = cluster.trainstack(["submit", "--profile", cluster.profile, "--test-only",
                                      *self.cluster_args(cluster)], timeout=300)
            try:
                answer = json.loads(out.stdout.strip().splitlines()[-1])
                starts[cluster.name] = answer.get("start_in_s")
                self.reasons[cluster.name] = str(answer.get("reason") or "")
                if isinstance(answer.get("world_size"), int):
                    self.worlds[cluster.name] = answer["world_size"]
            except (ValueError, IndexError, AttributeError):
                starts[cluster.name] = None
                said = (out.stderr or out.stdout).strip().splitlines()
                self.reasons[cluster.name] = said[-1] if said else "no answer"
                self.say(f"trainstack: {cluster.name}: cannot tell when a job would start there "
                         f"({self.reasons[cluster.name]})")
        return starts

    def refused(self, name: str) -> bool:
        """Does cluster ``name``'s last answer refuse the run for good (not just not now)?"""
        return any(word in self.reasons.get(name, "") for word in PERMANENT)

    def cluster_args(self, cluster: Cluster) -> list[str]:
        """The submit command line for ``cluster``: the run's own, with a log folder of the cluster's own (two
        clusters may hand out the same job id: their job folders must not be one)."""
        args, base = list(self.submit_args), None
        for i, word in enumerate(args):
            if word == "--log-dir" and i + 1 < len(args):
                base = args.pop(i + 1)
                args.pop(i)
                break
            if word.startswith("--log-dir="):
                base = args.pop(i).split("=", 1)[1]
                break
        if base is None:
            from .options import load_profile
            from .spec import LaunchSpec

            base = str(load_profile(cluster.profile).get("log_dir") or LaunchSpec.log_dir)
        at = args.index("--") if "--" in args else len(args)
        return [*args[:at], "--log-dir", f"{base.rstrip('/')}/{cluster.name}", *args[at:]]

    def _job_env(self, cluster: Cluster) -> list[str]:
        """The job's part of the run: its store, the lease required, its cluster's name, and -- on a cluster with
        another number of processes than the first placement -- the planned world, so the trainer keeps the global
        batch by gradient accumulation (and says when it cannot)."""
        env = [f"{envvars.CHECKPOINT_STORE}={self.store}", f"{envvars.LEASE}=required",
               f"{envvars.CLUSTER}={cluster.name}"]
        if cluster.scratch:
            env.append(f"{envvars.STAGED}={self.staged_dir(cluster)}")
        world = self.worlds.get(cluster.name)
        if self.planned_world is None:
            self.planned_world = world
        elif world is not None and world != self.planned_world:
            env.append(f"{envvars.PLANNED_WORLD}={self.planned_world}")
        return [word for item in env for word in ("--env", item)]

    def staged_dir(self, cluster: Cluster) -> str:
        """The run's pre-staging folder in the cluster's scratch (one per run: its store's last path part)."""
        return f"{str(cluster.scratch).rstrip('/')}/{self.store.rstrip('/').rsplit('/', 1)[-1]}"

    def prestage(self, move: Move) -> None:
        """While the run's job waits on a cluster with a scratch folder, its newest checkpoint goes there."""
        cluster = self._named(move.cluster)
        if not cluster.scratch or not self.moves[:-1]:  # the first placement has nothing to take yet
            return
        out = cluster.trainstack(["checkpoint", "stage", self.store, self.staged_dir(cluster)], timeout=1800)
        said = (out.stdout or out.stderr).strip().splitlines()
        self.say(f"trainstack: {move.cluster}: {said[-1] if said else 'staging said nothing'}")

    def submit(self, cluster: Cluster, reason: str) -> Move:
        args = ["submit", "--profile", cluster.profile, *self._job_env(cluster), *self.cluster_args(cluster)]
        out = cluster.trainstack(args, timeout=600)
        job = next((line.split()[1] for line in out.stdout.splitlines() if line.startswith("job ")), None)
        if out.returncode != 0 or job is None:
            raise RuntimeError(f"submitting on {cluster.name} failed: {(out.stderr or out.stdout).strip()[-800:]}")
        move = Move(cluster.name, job, time.time(), reason)
        self.moves.append(move)
        self.say(f"trainstack: run on {cluster.name}: job {job} ({reason})")
        return move

    def state(self, move: Move) -> tuple[str, str | None]:
        """(Slurm state, the verdict's kind once it ended) of the run's job; its ledger kept once it ended."""
        out = self._named(move.cluster).trainstack(["status", "--json", move.job], timeout=120)
        try:
            rows = json.loads(out.stdout[out.stdout.index("["):])
        except ValueError:
            return "UNKNOWN", None
        row = rows[0] if rows else {}
        state = str(row.get("state") or "UNKNOWN")
        if not row.get("ended"):
            return state, None
        why = self._named(move.cluster).trainstack(["why", "--json", move.job], timeout=120)
        try:
            found = json.loads(why.stdout[why.stdout.index("{"):])
        except ValueError:
            return state, "unknown"
        move.ledger = found.get("goodput")
        return state, str(found.get("kind") or "unknown")

    def leave(self, move: Move, why: str) -> None:
        """Cancel the run's job there (the run goes elsewhere); its ledger is read once it ended."""
        self._named(move.cluster).trainstack(["cancel", move.job], timeout=120)
        move.left = True
        self.say(f"trainstack: cancelled job {move.job} on {move.cluster}: {why}")

    def place(self) -> Move | None:
        """Submit where the run starts first (a move counted at its cost); hedged: everywhere it can start, keeping
        the first job that runs. None once the run has moved ``max_moves`` times."""
        if len(self.moves) >= self.max_moves:
            self.say(f"trainstack: the run moved {len(self.moves)} times; stopping (max {self.max_moves})")
            return None
        previous = next((m.cluster for m in reversed(self.moves) if not m.left), None) if self.moves else None
        failed: set[str] = set()  # clusters whose submit failed in this placement: the others are asked first
        while True:
            starts = self.expected_starts()
            where = choose({k: v for k, v in starts.items() if k not in failed}, previous, self.move_cost_s,
                           self.margin_s)
            if where is None:
                failed.clear()  # every cluster failed or none can start now: all are asked again after a wait
            why = "; ".join(f"{name}: {self.reasons.get(name) or 'no answer'}" for name in starts)
            if where is None and all(self.refused(name) for name in starts):
                self.say(f"trainstack: no cluster can ever start the run as asked ({why}): stopping")
                return None
            if where is None:
                self.say(f"trainstack: no cluster can start the run now ({why}); asking again in "
                         f"{self.poll_s * 6:g} s")
                time.sleep(self.poll_s * 6)
                continue
            if self.hedge:
                break
            try:
                reason = "first placement" if not self.moves else f"continued after {self.moves[-1].cluster}"
                return self.submit(self._named(where), f"{reason}; expected start in {starts[where]:.0f} s")
            except RuntimeError as exc:  # said; the next best cluster is asked (the run is never left jobless)
                self.say(f"trainstack: {exc}; asking the other clusters")
                self.reasons[where] = str(exc)
                failed.add(where)
                time.sleep(self.poll_s)
        reason = "first placement" if not self.moves else f"continued after {self.moves[-1].cluster}"
        hedged = [self.submit(self._named(name), f"{reason}; hedged, expected start in {wait:.0f} s")
                  for name, wait in sorted(starts.items(), key=lambda kv: (kv[1] is None, kv[1] or 0.0))
                  if wait is not None]
        while True:
            time.sleep(self.poll_s)
            states = {m.job: self.state(m) for m in hedged}
            kept = next((m for m in hedged if states[m.job][0] == "RUNNING" or states[m.job][1] is not None), None)
            if kept is not None:
                for other in hedged:
                    if other is not kept:
                        self.leave(other, f"the hedge's job {kept.job} on {kept.cluster} started first")
                return kept

    def run(self) -> int:
        """Place, submit, watch and move until the run completes (0) or fails by itself (1); then the run's ledger
        across clusters (said, and written to the store as ``run-ledger.json``)."""
        started = time.time()
        code = self._follow()
        self.report(time.time() - started)
        return code

    def _follow(self) -> int:
        move: Move | None = None
        unknown, looked = 0, 0.0
        while True:
            if move is None:
                move = self.place()
                if move is None:
                    return 1
            time.sleep(self.poll_s)
            state, kind = self.state(move)
            unknown = unknown + 1 if state == "UNKNOWN" else 0
            if unknown >= LOST_POLLS:  # neither Slurm nor the job folder knows the job any more
                kind = "unknown"
            if kind == "completed" or state == "COMPLETED":
                self.say(f"trainstack: the run completed on {move.cluster} (job {move.job}) after "
                         f"{len(self.moves)} placement(s)")
                return 0
            if kind is not None:
                if kind not in MOVABLE:
                    self.say(f"trainstack: job {move.job} on {move.cluster} failed by itself ({kind}): the run "
                             f"stops (trainstack why {move.job} on {move.cluster})")
                    return 1
                self.say(f"trainstack: job {move.job} on {move.cluster} ended: {kind}; the run continues")
                move = None
                continue
            waiting = state.split()[0] in ("PENDING", "REQUEUED", "REQUEUE_HOLD")  # a preempted job waits here again
            if waiting and move.job not in self._staged:
                self._staged.add(move.job)
                self.prestage(move)
            if waiting and time.monotonic() - looked >= LOOK_EVERY_S:  # asking every cluster ships code to each
                looked = time.monotonic()
                starts = self.expected_starts()
                here = starts.get(move.cluster)
                best = choose(starts, move.cluster, self.move_cost_s, self.margin_s)
                if best is not None and best != move.cluster:
                    self.say(f"trainstack: job {move.job} waits on {move.cluster} (expected start: "
                             f"{'never now' if here is None else f'{here:.0f} s'}); {best} starts it in "
                             f"{starts[best]:.0f} s, a move costing ~{self.move_cost_s:.0f} s: moving")
                    self.leave(move, f"the run moves to {best}")
                    move = None

    def report(self, wall_s: float) -> None:
        """The run's goodput across its clusters: each job's ledger, the queues it left, the checkpoint downloads
        of its moves, the cold compiles after them."""
        from .._common.goodput import format_ledger, run_ledger

        for move in self.moves:
            if move.ledger is None:
                self.state(move)
        downloads: dict[tuple[str, str], float] = {}
        try:
            import fsspec

            from .._common.lease import attempts

            fs, root = fsspec.core.url_to_fs(self.store)
            downloads = {(str(a.get("cluster")), str(a.get("job"))): float(a.get("download_s") or 0.0)
                         for a in attempts(fs, root)}
        except Exception as exc:  # noqa: BLE001 -- the store may not be reachable from where the follower runs
            self.say(f"trainstack: the run's attempts in {self.store} cannot be read here ({type(exc).__name__}): "
                     f"its ledger leaves transfers out")
        seen: set[str] = set()
        jobs = []
        for move in self.moves:
            jobs.append({"cluster": move.cluster, "job": move.job, "ledger": move.ledger, "left": move.left,
                         "moved_in": bool(seen) and move.cluster not in seen,
                         "download_s": downloads.get((move.cluster, move.job), 0.0)})
            seen.add(move.cluster)
        found = run_ledger(jobs, wall_s)
        self.say(f"trainstack: the run across {len(seen)} cluster(s), {len(self.moves)} job(s): "
                 f"{format_ledger(found)}")
        try:
            import fsspec

            fs, root = fsspec.core.url_to_fs(self.store)
            fs.pipe_file(f"{root.rstrip('/')}/run-ledger.json", json.dumps(
                {**found, "moves": [{**vars(m), **j} for m, j in zip(self.moves, jobs, strict=True)]}, indent=1,
                default=str).encode())
        except Exception as exc:  # noqa: BLE001 -- the store may not be reachable from where the follower runs
            self.say(f"trainstack: the run's ledger is not written to {self.store} ({type(exc).__name__}: {exc})")
