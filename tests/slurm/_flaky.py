"""Fails as sys.argv[1] says, for tests/slurm/test_verdicts.py: 'deterministic' raises the same error at the same
step on every attempt; 'transient' is killed by signal 9 on the first attempt only (as by a host's OOM killer)."""

import os
import sys

print("epoch 1 | step 5 | loss 0.5", flush=True)
first = os.environ.get("TRAINSTACK_ATTEMPT", "0") == "0"
if sys.argv[1] == "deterministic":
    raise ZeroDivisionError("a bug that fails the same way every time")
if first:
    os.kill(os.getpid(), 9)
print("DONE", flush=True)
