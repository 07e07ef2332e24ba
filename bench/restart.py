"""Restart latency: from a failure (torchrun restart) or a requeue (a new launch) to the first resumed step, with
the phases broken down (make bench).

    python bench/restart.py [--reps 3]

Two CPU processes under torchrun (gloo), a 200,000-sample TensorDataset, batch 32:
* requeue: a graceful stop mid-epoch (SIGUSR2 at step 600: agreed, checkpointed, exit 0), then a new torchrun as a
  requeued job would start it; the resume jumps to the saved global sample position;
* restart: rank 1 is SIGKILLed at step 600 and torchrun (--max-restarts 1) restarts the group, which resumes from
  the epoch checkpoint at step 400.
Phases (rank 0, medians): failure detected and the group restarted (torchrun), or torchrun start to the worker
process; interpreter start; imports (torch, trainstack); set-up and rendezvous; checkpoint load; the loader's jump
to the saved position and the first step. The Slurm scheduler's own part (requeue -> job start) is measured by
bench/slurm_workflow.py and tests/slurm/test_requeue.py, not here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_restart_worker.py")


def _torchrun(out: Path, mode: str, restarts: int) -> float:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    start = time.time()
    subprocess.run([exe, "--standalone", "--nproc_per_node", "2", "--max-restarts", str(restarts),
                    "--monitor-interval", "0.5", WORKER, str(out), mode], check=True, capture_output=True, timeout=600)
    return start


def _phases(p: dict, origin: float) -> dict[str, float]:
    end_setup = p.get("rendezvous", p["imported"])
    load = p.get("checkpoint_load", 0) - p.get("checkpoint_load_start", 0)
    return {"to worker process": p["process_start"] - origin,
            "interpreter": p["import_start"] - p["process_start"],
            "imports": p["imported"] - p["import_start"],
            "set-up + rendezvous": end_setup - p["imported"],
            "checkpoint load": load,
            "rest of set-up, loader jump, first step": p["first_step"] - end_setup - load,
            "total": p["first_step"] - origin}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"requeue": [], "restart": []}
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="ts-restart-") as tmp:
            out = Path(tmp) / "requeue"
            out.mkdir()
            _torchrun(out, "stop", 0)
            launched = _torchrun(out, "resume", 0)
            p = json.loads((out / "phases-resume-0.json").read_text())
            rows["requeue"].append({**_phases(p, launched), "resumed at step": p["first_step_no"]})
            out = Path(tmp) / "restart"
            out.mkdir()
            _torchrun(out, "kill", 1)
            p = json.loads((out / "phases-kill-1.json").read_text())
            rows["restart"].append({**_phases(p, float((out / "failed_at").read_text())),
                                    "resumed at step": p["first_step_no"]})
    keys = list(rows["requeue"][0])
    print("| phase | requeue (new torchrun) s | restart (torchrun --max-restarts) s |\n|---|---|---|")
    for k in keys:
        cells = [f"{statistics.median(r[k] for r in rows[kind]):.2f}" for kind in ("requeue", "restart")]
        print(f"| {k} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
