"""Fails as sys.argv[1] says, for tests/slurm/test_verdicts.py: 'deterministic' on every attempt at the same step,
'transient' only on the first attempt."""

import os
import sys

print("epoch 1 | step 5 | loss 0.5", flush=True)
if sys.argv[1] == "deterministic" or os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    raise ZeroDivisionError("a bug that fails the same way every time" if sys.argv[1] == "deterministic"
                            else "a transient failure")
print("DONE", flush=True)
