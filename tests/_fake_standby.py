"""A warm standby as tests/test_allocation.py's fake Slurm runs it in place of srun (``NAME HOST``): it says it is
ready (as trainstack._runtime.standby does, without importing torch), waits for the driver's order, records what it
was told (``taken-<name>.json`` in the job folder), then runs as that rank for a while. FAKE_STANDBY: ``broken``
(it ends before it is ready), ``silent`` (it never takes its order), ``duration``, ``status``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from _leaves import without_doors

without_doors()
from trainstack._common.jobfiles import JobFiles  # noqa: E402

scenario = json.loads(os.environ.get("FAKE_STANDBY") or "{}")
name, host = sys.argv[1], sys.argv[2]
folder = Path(os.environ["TRAINSTACK_JOB_DIR"])
files = JobFiles(folder)
if scenario.get("broken"):
    (folder / f"broken-{name}").write_text("")
    sys.exit(3)
files.standby.ready(name, host, os.getpid())
while (order := files.standby.order_for(name)) is None:
    if files.driver.has_ended():
        sys.exit(0)
    time.sleep(0.02)
while scenario.get("silent"):  # ordered, but stuck: it never takes the order
    time.sleep(0.05)
files.standby.took(name)
(folder / f"taken-{name}.json").write_text(json.dumps({"pid": os.getpid(), "host": host, "rank": order.ranks[0],
                                                        "step": order.step, "env": order.env}))
time.sleep(scenario.get("duration", 0.2))
sys.exit(scenario.get("status", 0))
