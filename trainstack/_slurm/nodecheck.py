"""The judge of a pre-flight node check, run by the allocation driver on the batch host (``trainstack.node_check``
wrote each node's figures into the job folder's ``node-check/``).

A node is named -- with its figure -- when it did not report within the budget, has fewer GPUs than requested or
uncorrected ECC errors, computes below ``min_ratio`` of the median of the other nodes (or below the site's
``min_gflops``), has less free memory, ``/dev/shm`` or job-folder write speed than the site asks, or sits in two
neighbour pairs whose link is ``1 / min_ratio`` times slower than the typical fast pair. A node whose report is not
numbers where numbers belong (a broken measurement) is named too: the judge never takes a malformed figure for a
healthy one, and never fails on one. ``check`` appends the check to ``node-checks.jsonl`` and records a
``node_check`` event. Torch-free.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._common.jobfiles import JobFiles
from .slurmcmd import Slurm

__all__ = ["THRESHOLDS", "judge", "read_checks", "describe", "check", "check_threshold"]

#: The site profile's ``node_check_thresholds`` keys and their defaults (None: not checked).
THRESHOLDS: dict[str, float | None] = {"min_ratio": 0.5, "min_gflops": None, "min_free_gb": None,
                                       "min_shm_gb": None, "min_write_mbps": None}


def check_threshold(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be the threshold ``key`` (None: it can): a finite number, ``min_ratio`` in (0, 1]
    (a node slower than the others by that factor is named; above 1 every node would be), the floors >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if key == "min_ratio" and not 0 < value <= 1:
        return (f"must be above 0 and at most 1 (a node computing below that fraction of the others' median is "
                f"named; 0.5 by default), got {value!r}")
    if value < 0:
        return f"must be a number >= 0, got {value!r}"
    return None


def _number(value: Any) -> float | None:
    """A finite figure, or None (missing, not a number, NaN, infinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _rate(fig: dict[str, Any]) -> float | None | str:
    """A node's compute rate (the lowest of its devices), None when it reported none, or why it is broken."""
    raw = fig.get("gflops")
    if raw is None:
        return None
    values = raw if isinstance(raw, list) else [raw]
    numbers = [_number(v) for v in values]
    if not values or any(n is None for n in numbers):
        return f"its compute figure is not a number ({raw!r}): a broken measurement"
    return min(n for n in numbers if n is not None)


def judge(figures: dict[str, dict[str, Any] | None], link: dict[str, Any] | None, gpus: int,
          limits: dict[str, float | None]) -> dict[str, str]:
    """{host: why it is named} for the nodes of one check (``figures[host]`` None: it never reported)."""
    ratio = _number(limits.get("min_ratio")) or 0.0
    bad: dict[str, str] = {}
    rates: dict[str, float] = {}
    for host, fig in figures.items():
        found = _rate(fig) if isinstance(fig, dict) else None
        if isinstance(found, str):
            bad[host] = found
        elif found is not None:
            rates[host] = found
    for host, fig in figures.items():
        if host in bad:
            continue
        if fig is None:
            bad[host] = "did not report within the node check's time budget (a hung or overloaded node)"
            continue
        if not isinstance(fig, dict):
            bad[host] = f"its report is not a record of figures ({type(fig).__name__}): a broken measurement"
            continue
        visible = _number(fig.get("gpus_visible", 0))
        if visible is None:
            bad[host] = f"its GPU count is not a number ({fig.get('gpus_visible')!r}): a broken measurement"
            continue
        if gpus and visible < gpus:
            bad[host] = f"{visible:g} GPU(s) visible, {gpus} requested"
            continue
        gpu_rows = fig.get("gpus")
        listed: list[Any] = gpu_rows if isinstance(gpu_rows, list) else []
        ecc = [g for g in listed if isinstance(g, dict)
               and (_number(g.get("ecc.errors.uncorrected.volatile.total")) or 0) > 0]
        if ecc:
            bad[host] = f"uncorrected ECC errors on GPU {', '.join(str(g.get('index', '?')) for g in ecc)}"
            continue
        others = [r for h, r in rates.items() if h != host]
        rate = rates.get(host)
        if rate is not None and others and ratio and rate < ratio * statistics.median(others):
            bad[host] = (f"compute {rate:.1f} GFLOP/s, {rate / statistics.median(others):.2f}x the median of the "
                         f"other nodes ({statistics.median(others):.1f} GFLOP/s; below {ratio:g}x)")
            continue
        for key, field, unit, what in (("min_gflops", None, "GFLOP/s", "compute"),
                                       ("min_free_gb", "mem_available_gb", "GB", "free memory"),
                                       ("min_shm_gb", "shm_free_gb", "GB", "free /dev/shm"),
                                       ("min_write_mbps", "write_mbps", "MB/s", "job folder writes")):
            floor = _number(limits.get(key))
            value = rate if field is None else _number(fig.get(field))
            if floor is not None and value is not None and value < floor:
                bad[host] = f"{what} {value:.1f} {unit}, below the site's {key} = {floor:g}"
                break
    for host, why in _slow_links(link, ratio).items():
        bad.setdefault(host, why)
    return bad


def _slow_links(link: dict[str, Any] | None, ratio: float) -> dict[str, str]:
    """Hosts in two neighbour pairs slower than the typical fast pair by ``1 / ratio`` (three nodes or more)."""
    listed = (link or {}).get("pairs") if isinstance(link, dict) else None
    pairs = [p for p in listed or [] if isinstance(p, dict) and _number(p.get("seconds")) is not None
             and isinstance(p.get("hosts"), list)]
    if len(pairs) < 3 or not ratio:
        return {}
    times = sorted(p["seconds"] for p in pairs)
    typical = statistics.median(times[:max(1, len(times) // 2)])  # the faster half: a slow node is in two pairs
    slow = [p for p in pairs if p["seconds"] * ratio > typical]
    count: dict[str, list[float]] = {}
    for p in slow:
        for host in p["hosts"]:
            count.setdefault(host, []).append(p["seconds"])
    return {h: f"slow link: its pairs took {1000 * max(s):.1f} ms vs {1000 * typical:.1f} ms typical"
            for h, s in count.items() if len(s) >= 2}


def describe(check: dict[str, Any]) -> str:
    """One line: the nodes' rates, the ring, how long it took."""
    found = {h: _rate(f) if isinstance(f, dict) else None for h, f in check["figures"].items()}
    rates = ", ".join(f"{h} {r:.1f}" for h, r in found.items() if isinstance(r, float))
    link = check.get("link")
    ring: dict[str, Any] = link if isinstance(link, dict) else {}
    gbps = _number(ring.get("ring_gbps"))
    reported = [f for f in check["figures"].values() if f]
    ring_text = f"; ring {gbps:.2f} GB/s" if gbps else \
        ("; the ring did not complete within the budget" if len(reported) > 1 else "")
    verdict = f"named: {', '.join(check['named'])}" if check["named"] else "all nodes fit"
    return (f"node check of {len(check['figures'])} node(s) in {check['seconds']:.1f} s: GFLOP/s {rates or 'none'}"
            f"{ring_text}; {verdict}")


def read_checks(folder: Path) -> list[dict[str, Any]]:
    """Every node check of a job folder, oldest first."""
    return JobFiles(folder).node_checks()


def measure(slurm: Slurm, out: Path, nodes: list[str], command: list[str], budget_s: int, port: int,
            env: Mapping[str, str]) -> None:
    """Run the check's command on every node of ``nodes`` (one task each, beside a running step, killed after
    ``budget_s``), its figures into ``out`` (emptied first), its ring on ``port`` of the first node."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    argv = [*command, "--out", str(out), "--port", str(port), "--budget", str(budget_s)]
    slurm.on_nodes(nodes, argv, timeout=budget_s, output=out / "srun.out", env=env)


def check(files: JobFiles, hosts: list[str], started: float, gpus: int, limits: dict[str, float | None],
          attempt: int = 0, step_index: int = 0) -> dict[str, Any]:
    """Judge the figures the nodes wrote, record the check (``node-checks.jsonl``, a ``node_check`` event) and
    return it: ``named`` maps each named host to why."""
    figures = {h: files.node_check_figures(h) for h in hosts}
    link = files.node_check_links()
    limits = {**THRESHOLDS, **limits}  # the site's thresholds over the defaults
    named = judge(figures, link, gpus, limits)
    now = time.time()
    record = {"attempt": attempt, "step_index": step_index, "started": started, "ended": now,
              "seconds": round(now - started, 2), "figures": figures, "link": link, "named": named,
              "limits": limits}
    files.append_node_check(record)
    files.record_event("node_check", started=started, seconds=record["seconds"], nodes=hosts, named=named)
    return record


#: The pre-flight node check's time budget (seconds; a site's ``node_check_thresholds.budget_s`` may change it).
BUDGET_S = 30


def check_settings(thresholds: Mapping[str, object]) -> str | None:
    """What is wrong with a profile's ``node_check_thresholds`` (a key the judge does not know, a threshold out of
    range, a budget that is not whole seconds from 5 to 300), or None: the judge owns its thresholds."""
    known = (*THRESHOLDS, "budget_s")
    for key, value in dict(thresholds).items():
        if key not in known:
            return f"node_check_thresholds has no {key!r}; valid: {', '.join(known)}"
        problem = check_threshold(key, value)
        if problem:
            return f"node_check_thresholds.{key} {problem}"
    budget = float(thresholds.get("budget_s", BUDGET_S))  # type: ignore[arg-type]
    if not 5 <= budget <= 300 or budget != int(budget):
        return (f"node_check_thresholds.budget_s = {thresholds.get('budget_s')!r}: the node check needs a whole number "
                f"of seconds from 5 to 300 (default {BUDGET_S}; --no-node-check skips it)")
    return None
