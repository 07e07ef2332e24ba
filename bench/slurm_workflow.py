"""What the Slurm workflow costs a user, measured on the local cluster (`make slurm-up`): the code snapshot of this
repository (files, size, seconds) and the time from `trainstack submit` to the job's first log line, with and
without the snapshot, next to plain `sbatch` of the same rendered script. Run: `make bench-slurm`."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGRAM = "import time; print('first line', flush=True)\n"


def _first_line(log: Path, start: float, timeout: float = 120) -> float:
    while time.monotonic() - start < timeout:
        if log.exists() and "first line" in log.read_text(errors="replace"):
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(f"no first line in {log} after {timeout}s")


def _submit(work: Path, env: dict[str, str], snapshot: bool) -> tuple[float, float, dict]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainstack", "submit", "--cpu", "--time", "5", "--job-name",
                           "bench-submit", "--log-dir", str(work / "logs"),
                           "--snapshot" if snapshot else "--no-snapshot", "--", "bench/_first_line.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True)
    returned = time.monotonic() - start
    words = proc.stdout.split()
    job_dir, log = Path(words[words.index("folder") + 1]), Path(words[words.index("log") + 1])
    first = _first_line(log, start)
    meta = json.loads((job_dir / "metadata.json").read_text())
    return returned, first, meta


def _plain_sbatch(work: Path, env: dict[str, str]) -> float:
    script = work / "plain.sbatch"
    subprocess.run([sys.executable, "-m", "trainstack", "generate", "--cpu", "--time", "5", "--job-name",
                    "bench-plain", "--log-dir", str(work / "logs"), "-o", str(script), "--force", "--",
                    "bench/_first_line.py"], cwd=REPO, env=env, capture_output=True, check=True, timeout=60)
    start = time.monotonic()
    job = subprocess.run(["sbatch", "--parsable", str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    return _first_line(work / "logs" / f"bench-plain-{job}.out", start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ)
    env.setdefault("SLURM_CONF", "/tmp/trainstack-slurm/slurm.conf")
    (REPO / "bench" / "_first_line.py").write_text(PROGRAM)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            env["XDG_STATE_HOME"] = str(work / "state")
            rows: dict[str, list[float]] = {"sbatch (plain)": [], "submit --no-snapshot": [], "submit": []}
            returns: dict[str, list[float]] = {"submit --no-snapshot": [], "submit": []}
            snap = {}
            for _ in range(args.repeats):
                rows["sbatch (plain)"].append(_plain_sbatch(work, env))
                for snapshot in (False, True):
                    name = "submit" if snapshot else "submit --no-snapshot"
                    returned, first, meta = _submit(work, env, snapshot)
                    rows[name].append(first)
                    returns[name].append(returned)
                    snap = meta["snapshot"] or snap
    finally:
        (REPO / "bench" / "_first_line.py").unlink(missing_ok=True)
    print(f"snapshot of this repository: {snap.get('files')} files, {snap.get('bytes', 0) / 1e6:.2f} MB, "
          f"{snap.get('seconds')} s (linked, not copied: {', '.join(snap.get('linked', [])) or 'nothing'})")
    print(f"{'':<24}{'command returns (s)':>20}{'first log line (s)':>20}   (median of {args.repeats})")
    for name, values in rows.items():
        back = f"{statistics.median(returns[name]):.2f}" if name in returns else "-"
        print(f"{name:<24}{back:>20}{statistics.median(values):>20.2f}")


if __name__ == "__main__":
    main()
