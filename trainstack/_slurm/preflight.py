"""The node check before a job step, as the allocation driver runs it: every usable host not yet checked is measured
at once (the spares with the step's nodes: one task per node, in parallel), judged here, and a named node is left
out -- a checked spare takes its place; without one the job shrinks (``--min-nodes``) or is requeued leaving it out
where the partition has other nodes, else it trains on them. Torch-free, stdlib only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from . import attempt as policy
from .nodecheck import check as judge_nodes
from .nodecheck import describe as describe_check
from .nodecheck import measure as measure_nodes
from .rungs import Requeue, shrink_to

if TYPE_CHECKING:
    from .allocation import Allocation

__all__ = ["Preflight"]


class Preflight:
    """The node checks of one allocation (``checked``: the hosts that passed in it, never measured again)."""

    def __init__(self, alloc: Allocation) -> None:
        self.alloc = alloc
        self.checked: set[str] = set()

    def measure(self, nodes: list[str]) -> dict[str, str]:
        """Measure every node of ``nodes`` (one task each, within the budget), judge them here: {host: why named}."""
        alloc, check = self.alloc, self.alloc.plan.node_check
        assert check is not None
        started = time.time()  # the ring meets at the step's first node (MASTER_ADDR), on the port after its own
        port = alloc.command.port(alloc.step) + 1
        measure_nodes(alloc.slurm, alloc.files.node_check_dir, nodes, check.command, check.budget_s, port,
                      alloc.command.env(nodes, alloc.step))
        record = judge_nodes(alloc.files, nodes, started, alloc.plan.gpus_per_node, dict(check.thresholds),
                             alloc.job.restart, alloc.step)
        alloc.job.say(describe_check(record))
        for host, why in record["named"].items():
            alloc.job.say(f"node check: {host}: {why}")
        return dict(record["named"])

    def confirmed(self, named: list[str], hosts: list[str]) -> list[str]:
        """The named hosts measured again beside one that passed (one noisy window is not evidence enough to leave
        a node out): those named twice; the others were noise (said)."""
        if not named:
            return named
        passed = [h for h in hosts if h not in named][:1]
        again = set(self.measure([*named, *passed]))
        cleared = [h for h in named if h not in again]
        if cleared:
            self.alloc.job.say(f"node check: {','.join(cleared)} passed when measured again: kept (one noisy "
                               f"measurement)")
        return [h for h in named if h in again]

    def before(self, nodes: list[str]) -> list[str] | Requeue:
        """The nodes the step runs on after the check (a job without --requeue names a node and trains on it)."""
        alloc, plan, pool = self.alloc, self.alloc.plan, self.alloc.pool
        if not plan.recovery.requeue:
            found = self.measure(nodes)
            if found:
                bad = ",".join(found)
                alloc.job.warn(f"training on {bad} anyway: a job without --requeue cannot leave a node out (--requeue "
                               f"--spare-nodes 1 replaces it; or resubmit with sbatch's --exclude={bad})")
            return nodes
        if set(nodes) <= self.checked:
            return nodes
        hosts = [h for h in pool.usable() if h not in self.checked]
        named = self.confirmed(list(self.measure(hosts)), hosts)
        self.checked.update(h for h in hosts if h not in named)
        pool.leave_out(named)
        if not set(named) & set(nodes):  # none, or a named spare: the step's nodes stand
            if named:
                left = len(pool.usable()) - plan.nodes
                alloc.job.warn(f"node check: leaving out spare {','.join(named)}: {left} spare(s) left for a lost "
                               f"node" + ("" if left else " -- a node lost now is recovered by a shrink or a requeue"))
            return nodes
        chosen = pool.choose(plan.nodes)
        if chosen is not None:
            alloc.job.say(f"node check: leaving out {','.join(named)}; the step runs on {','.join(chosen)}")
            return chosen
        shrunk = shrink_to(alloc.climb("crash"), pool.usable()[: plan.nodes],
                           f"{','.join(named)} named by the node check") if plan.recovery.min_nodes else None
        if shrunk is not None:  # checked just now, with the node named
            return shrunk.nodes
        outcome = policy.node_check_failed(alloc.files.folder, named, plan.recovery.max_retries, alloc.context(nodes))
        alloc.job.warn(outcome.line)
        if outcome.go:
            return Requeue("nodecheck", outcome.exclude)
        pool.readmit(named)
        self.checked.update(named)  # trained on as they are: not measured again in this allocation
        return pool.choose(plan.nodes) or nodes
