"""Torch-free program for the status/logs/cancel tests: two metric lines, a ready marker, then a long sleep."""

import os
import sys
import time
from pathlib import Path

print("Iteration      1 | train_loss: 0.5000000", flush=True)
print("Iteration      2 | train_loss: 0.2500000", flush=True)
(Path(os.environ["PROBE_OUT"]) / "ready").write_text(str(os.getpid()))
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 120)
print("slept", flush=True)
