"""``python -m trainstack._slurm.attempt TASK_DIR STATUS``: the batch script's retry decision after a crash.

Records the attempt's verdict in ``TASK_DIR/verdicts.jsonl`` (one row per attempt: restart count, verdict, root
cause, the blamed host, the last step the log shows) and decides: the same root cause as the previous attempt
**without progress** (no later step) is not retried (exit 3, with the reason); anything else may be (exit 0;
``--max-requeues`` still bounds the count). When the verdict blames the machine (a CUDA fault, a node failure), a
second line ``exclude: HOSTS`` names the hosts the requeued attempt should leave out -- every host blamed so far, as
long as enough nodes remain. Torch-free, cheap: it reads the job folder (and ``sinfo`` for the node count).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .verdict import HOST_FAULTS, verdict

_STEP = re.compile(r"\| step (\d+)")


def last_step(folder: Path) -> int | None:
    """The highest optimizer step rank 0's log shows (live lines, epoch lines), or None."""
    try:
        text = (folder / "rank-0.out").read_text(errors="replace")[-500_000:]
    except OSError:
        return None
    steps = [int(m.group(1)) for m in _STEP.finditer(text)]
    return max(steps) if steps else None


def decide(folder: Path, status: int) -> tuple[bool, str]:
    """(retry?, the line that says why) for the attempt that just ended with ``status``."""
    found = verdict("FAILED", folder, None)
    cause = f"{found.kind}: {found.summary.split(';')[0]}"
    host = found.host or _host_of_rank(found.rank, folder)
    record = {"attempt": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "kind": found.kind,
              "summary": found.summary, "cause": cause, "rank": found.rank, "host": host,
              "blamed": host if found.kind in HOST_FAULTS else None, "step": last_step(folder), "status": status,
              "time": time.time()}
    history = folder / "verdicts.jsonl"
    previous = None
    if history.exists():
        rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
        previous = rows[-1] if rows else None
    with open(history, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    if previous is not None and previous.get("cause") == cause:
        before, now = previous.get("step"), record["step"]
        if now is None or (before is not None and now <= before):
            return False, (f"not retried: {cause}, same as attempt {previous['attempt']}, no progress (last step "
                           f"{now if now is not None else 'unknown'})")
    return True, f"attempt {record['attempt']} ended with {cause}; retrying"


def excluded(folder: Path) -> list[str]:
    """Every host a verdict of this job blamed, when leaving them all out still leaves the job enough nodes."""
    try:
        rows = [json.loads(line) for line in (folder / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return []
    hosts = sorted({r["blamed"] for r in rows if r.get("blamed")})
    need = int(os.environ.get("SLURM_NNODES", "1"))
    return hosts if hosts and _node_count() - len(hosts) >= need else []


def _host_of_rank(rank: int | None, folder: Path) -> str | None:
    """The host rank ``rank`` ran on: ranks fill the nodes in order (srun's block layout, torchrun's node ranks)."""
    nodes = _hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    if rank is None or not nodes:
        return os.environ.get("SLURMD_NODENAME")
    ranks = len(list(folder.glob("rank-*.out"))) or len(nodes)
    per_node = max(1, -(-ranks // len(nodes)))
    return nodes[min(rank // per_node, len(nodes) - 1)]


def _hostnames(nodelist: str) -> list[str]:
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split()


def _node_count() -> int:
    partition = os.environ.get("SLURM_JOB_PARTITION")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N", *(["-p", partition] if partition else [])],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return len(set(out.stdout.split()))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m trainstack._slurm.attempt TASK_DIR STATUS", file=sys.stderr)
        return 2
    folder = Path(argv[1])
    retry, line = decide(folder, int(argv[2]))
    print(line)
    hosts = excluded(folder) if retry else []
    if hosts:
        print(f"exclude: {','.join(hosts)}")
    return 0 if retry else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))
