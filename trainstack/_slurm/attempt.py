"""``python -m trainstack._slurm.attempt TASK_DIR STATUS``: the batch script's retry decision after a crash.

Records the attempt's verdict in ``TASK_DIR/verdicts.jsonl`` (one row per attempt: restart count, verdict, root
cause, the last step the log shows) and decides: the same root cause as the previous attempt **without progress**
(no later step) is not retried (exit 3, with the reason); anything else may be (exit 0; ``--max-requeues`` still
bounds the count). Torch-free, cheap: it reads the job folder only.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from .verdict import verdict

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
    record = {"attempt": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "kind": found.kind,
              "summary": found.summary, "cause": cause, "rank": found.rank, "host": found.host,
              "step": last_step(folder), "status": status, "time": time.time()}
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


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m trainstack._slurm.attempt TASK_DIR STATUS", file=sys.stderr)
        return 2
    retry, line = decide(Path(argv[1]), int(argv[2]))
    print(line)
    return 0 if retry else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))
