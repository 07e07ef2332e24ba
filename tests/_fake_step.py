"""A job step as tests/test_allocation.py's fake Slurm runs it in place of srun: the scenario (JSON in FAKE_STEP)
says which ranks fail, when, with what status, on which host (each failing task's exit record written as the task
wrapper writes it), which ranks say they lost a peer and when (as fastexit does), how far rank 0's log gets,
whether the step hangs until killed (a lost node), whether its waiting ranks train on in the next step once the
driver offers it (continue_in_place: seconds; joins: false, they never join its group; fail_in_place: the status
rank 0 then fails with in that step), and whether the trainer
answers a stop request with a checkpoint; ``after_ready``/``after_broken``: its failures' clock starts once that
many warm standbys said they are ready / ended before that (tests/_fake_standby.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from _leaves import without_doors

without_doors()
from trainstack._common.jobfiles import JobFiles  # noqa: E402

scenario = json.loads(os.environ["FAKE_STEP"])
job = Path(os.environ["TRAINSTACK_JOB_DIR"])
with open(job / "rank-0.out", "a") as log:
    log.write(f"epoch 1 | step {scenario.get('log_step', 5)} | loss 0.5\n")
deadline = time.monotonic() + 30  # after_ready: the step's failures wait for this many warm standbys to be ready
while (len(list((job / "standby").glob("*.ready"))) < scenario.get("after_ready", 0) or
       len(list(job.glob("broken-*"))) < scenario.get("after_broken", 0)) and time.monotonic() < deadline:
    time.sleep(0.02)
start = time.monotonic()
failures = sorted(scenario.get("fail", []) + scenario.get("peer_lost", []), key=lambda f: f.get("delay", 0.0))
for f in failures:
    time.sleep(max(0.0, start + f.get("delay", 0.0) - time.monotonic()))
    if "code" not in f:  # alive, asleep (or waiting in place): its collective failed because a peer is gone
        JobFiles(job).step.peer_lost(f["rank"], f["host"], int(os.environ.get("TRAINSTACK_STEP", "0")),
                                waiting=f.get("waiting", False))
        continue
    (job / "exits").mkdir(exist_ok=True)
    step = f.get("step", os.environ.get("TRAINSTACK_STEP", "0"))  # a late record of the step before names that one
    unit = f.get("unit", f"rank-{f.get('rank')}")  # node-<n>: one task per node (torchrun, spawn)
    (job / "exits" / unit).write_text(f"{time.time()} {f['code']} {unit} {f['host']} {step}\n")
while scenario.get("hang"):  # a lost node: srun never returns until it is killed
    time.sleep(0.05)
if scenario.get("continue_in_place"):  # ranks waiting in place: they train on in the next step, then end
    while (offer := JobFiles(job).step.offer_after(int(os.environ.get("TRAINSTACK_STEP", "0")))) is None:
        time.sleep(0.02)
    while not scenario.get("joins", True):  # took the offer and never joined (a rendezvous nobody serves)
        time.sleep(0.05)
    for rank in offer.ranks:
        JobFiles(job).step.joined(rank, offer.step)
    time.sleep(scenario["continue_in_place"])
    if scenario.get("fail_in_place"):  # a rank continued in place then fails in the new step: its task's record
        (job / "exits").mkdir(exist_ok=True)
        host = scenario.get("host", "node1")
        (job / "exits" / "rank-0").write_text(f"{time.time()} {scenario['fail_in_place']} rank-0 {host} "
                                              f"{offer.step}\n")
        sys.exit(scenario["fail_in_place"])
    sys.exit(0)
stop = os.environ.get("TRAINSTACK_STOP_FILE")
while time.monotonic() < start + scenario.get("duration", 0.1):
    if scenario.get("save_on_stop") and stop and Path(stop).exists():
        Path(stop + ".saved").write_text("ckpt")
        sys.exit(0)
    time.sleep(0.02)
codes = [f["code"] for f in failures if "code" in f]
sys.exit(scenario.get("status", codes[0] if codes else 0))
