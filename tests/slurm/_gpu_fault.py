"""A host fault on the first attempt only, for tests/slurm/test_verdicts.py: the requeued attempt must run on
another node; it writes where each attempt ran."""

import os
import sys
from pathlib import Path

attempt = os.environ.get("TRAINSTACK_ATTEMPT", "0")
with open(Path(sys.argv[1]) / "hosts", "a") as fh:
    fh.write(f"{attempt} {os.environ.get('SLURMD_NODENAME')}\n")
if attempt == "0":
    raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in for a faulty GPU)")
print("DONE", flush=True)
