"""A job step as tests/test_allocation.py's fake Slurm runs it in place of srun: the scenario (JSON in FAKE_STEP)
says which ranks fail, when, with what status, on which host (each failing task's exit record written as the task
wrapper writes it), how far rank 0's log gets, whether the step hangs until killed (a lost node), and whether the
trainer answers a stop request with a checkpoint."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

scenario = json.loads(os.environ["FAKE_STEP"])
job = Path(os.environ["TRAINSTACK_JOB_DIR"])
with open(job / "rank-0.out", "a") as log:
    log.write(f"epoch 1 | step {scenario.get('log_step', 5)} | loss 0.5\n")
start = time.monotonic()
failures = sorted(scenario.get("fail", []), key=lambda f: f.get("delay", 0.0))
for f in failures:
    time.sleep(max(0.0, start + f.get("delay", 0.0) - time.monotonic()))
    (job / "exits").mkdir(exist_ok=True)
    step = f.get("step", os.environ.get("TRAINSTACK_STEP", "0"))  # a late record of the step before names that one
    (job / "exits" / f"rank-{f['rank']}").write_text(f"{time.time()} {f['code']} rank-{f['rank']} {f['host']} {step}\n")
while scenario.get("hang"):  # a lost node: srun never returns until it is killed
    time.sleep(0.05)
stop = os.environ.get("TRAINSTACK_STOP_FILE")
while time.monotonic() < start + scenario.get("duration", 0.1):
    if scenario.get("save_on_stop") and stop and Path(stop).exists():
        Path(stop + ".saved").write_text("ckpt")
        sys.exit(0)
    time.sleep(0.02)
sys.exit(scenario.get("status", failures[0]["code"] if failures else 0))
