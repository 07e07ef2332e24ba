"""``python -m trainstack._slurm.nodecheck TASK_DIR --nodes HOSTS --started T [thresholds]``: the batch script's
judge of a pre-flight node check (``trainstack.node_check`` wrote each node's figures).

A node is named -- with its figure -- when it did not report within the budget, has fewer GPUs than requested or
uncorrected ECC errors, computes below ``min_ratio`` of the median of the other nodes (or below the site's
``min_gflops``), has less free memory, ``/dev/shm`` or job-folder write speed than the site asks, or sits in two
neighbour pairs whose link is ``1 / min_ratio`` times slower than the typical fast pair. Prints one summary line, a
line per named node, and ``exclude: HOSTS`` for the batch script; appends the check to ``node-checks.jsonl`` and
records a ``node_check`` event. Torch-free.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .. import _envvars as envvars
from .. import _jobevents as events
from .._files import read_jsonl

__all__ = ["THRESHOLDS", "judge", "read_checks", "describe", "main"]

#: The site profile's ``node_check_thresholds`` keys and their defaults (None: not checked).
THRESHOLDS: dict[str, float | None] = {"min_ratio": 0.5, "min_gflops": None, "min_free_gb": None,
                                       "min_shm_gb": None, "min_write_mbps": None}
CHECKS = "node-checks.jsonl"


def judge(figures: dict[str, dict[str, Any] | None], link: dict[str, Any] | None, gpus: int,
          limits: dict[str, float | None]) -> dict[str, str]:
    """{host: why it is named} for the nodes of one check (``figures[host]`` None: it never reported)."""
    ratio = limits.get("min_ratio") or 0.0
    bad: dict[str, str] = {}
    rates = {h: min(f["gflops"]) for h, f in figures.items() if f and f.get("gflops")}
    for host, fig in figures.items():
        if fig is None:
            bad[host] = "did not report within the node check's time budget (a hung or overloaded node)"
            continue
        if gpus and fig.get("gpus_visible", 0) < gpus:
            bad[host] = f"{fig.get('gpus_visible', 0)} GPU(s) visible, {gpus} requested"
            continue
        ecc = [g for g in fig.get("gpus", []) if isinstance(g.get("ecc.errors.uncorrected.volatile.total"), float)
               and g["ecc.errors.uncorrected.volatile.total"] > 0]
        if ecc:
            bad[host] = f"uncorrected ECC errors on GPU {', '.join(str(int(g['index'])) for g in ecc)}"
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
            floor = limits.get(key)
            value = rate if field is None else fig.get(field)
            if floor is not None and isinstance(value, (int, float)) and value < floor:
                bad[host] = f"{what} {value:.1f} {unit}, below the site's {key} = {floor:g}"
                break
    for host, why in _slow_links(link, ratio).items():
        bad.setdefault(host, why)
    return bad


def _slow_links(link: dict[str, Any] | None, ratio: float) -> dict[str, str]:
    """Hosts in two neighbour pairs slower than the typical fast pair by ``1 / ratio`` (three nodes or more)."""
    pairs = (link or {}).get("pairs") or []
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


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(check: dict[str, Any]) -> str:
    """One line: the nodes' rates, the ring, how long it took."""
    rates = ", ".join(f"{h} {min(f['gflops']):.1f}" for h, f in check["figures"].items() if f and f.get("gflops"))
    ring = check.get("link") or {}
    reported = [f for f in check["figures"].values() if f]
    ring_text = f"; ring {ring['ring_gbps']:.2f} GB/s" if ring.get("ring_gbps") else \
        ("; the ring did not complete within the budget" if len(reported) > 1 else "")
    verdict = f"named: {', '.join(check['named'])}" if check["named"] else "all nodes fit"
    return (f"node check of {len(check['figures'])} node(s) in {check['seconds']:.1f} s: GFLOP/s {rates or 'none'}"
            f"{ring_text}; {verdict}")


def read_checks(folder: Path) -> list[dict[str, Any]]:
    """Every node check of a job folder, oldest first."""
    return read_jsonl(folder / CHECKS)


def main(argv: list[str]) -> int:
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m trainstack._slurm.nodecheck")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--nodes", required=True, help="the hosts checked, comma-separated")
    parser.add_argument("--started", type=float, required=True)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs requested per node")
    for key in THRESHOLDS:
        parser.add_argument(f"--{key.replace('_', '-')}", type=float, default=THRESHOLDS[key])
    args = parser.parse_args(argv[1:])
    hosts = [h for h in args.nodes.split(",") if h]
    out = args.folder / "node-check"
    figures = {h: _read(out / f"{h}.json") for h in hosts}
    link = _read(out / "links.json")
    limits = {k: getattr(args, k) for k in THRESHOLDS}
    named = judge(figures, link, args.gpus, limits)
    now = time.time()
    check = {"attempt": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
             "step_index": int(os.environ.get(envvars.STEP) or 0), "started": args.started, "ended": now,
             "seconds": round(now - args.started, 2), "figures": figures, "link": link, "named": named,
             "limits": limits}
    with open(args.folder / CHECKS, "a") as fh:
        fh.write(json.dumps(check) + "\n")
    events.record("node_check", started=args.started, seconds=check["seconds"], nodes=hosts, named=named)
    print(describe(check))
    for host, why in named.items():
        print(f"node check: {host}: {why}")
    if named:
        print(f"exclude: {','.join(named)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
