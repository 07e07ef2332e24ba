"""A fault program for tests/slurm/test_verdicts.py: 4 ranks (2 nodes x 2 srun tasks) train a little, then rank 1
fails as ``sys.argv[1]`` says while the others wait in a collective: ``error``, ``oom``, ``kill9``, ``silent`` (rank 1
stops answering: the others' collective times out), ``forever`` (every rank sleeps into the time limit), ``fine``,
``sleep`` (slow, to be cancelled); and programs whose words look like other failures: ``exit2`` (a status without a
traceback), ``taxid`` (a KeyError naming 'taxid', not a GPU Xid), ``brokenpipe`` (the program's own BrokenPipeError),
``printed`` (prints trainstack's graceful-stop and hang lines, then raises), ``segv`` (a segfault)."""

import os
import signal
import sys
import time

import torch
from torch import nn

from trainstack import Accelerator


def main(kind: str) -> None:
    acc = Accelerator()
    model = acc.prepare(nn.Linear(4, 1))
    for step in range(5):
        print(f"epoch 1 | step {step} | loss 0.5", flush=True)
        if step == 3 and kind in ("silent", "forever") and (acc.rank == 1 or kind == "forever"):
            time.sleep(600)
        model(torch.randn(8, 4)).sum().backward()
        if step == 3 and acc.rank == 1:
            if kind == "error":
                raise ZeroDivisionError("the fault program divided by zero")
            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (stand-in)")
            if kind == "kill9":
                os.kill(os.getpid(), 9)
            if kind == "exit2":
                sys.exit(2)
            if kind == "taxid":
                raise KeyError("taxid")
            if kind == "brokenpipe":
                raise BrokenPipeError(32, "Broken pipe")
            if kind == "printed":
                print("Graceful stop at epoch 2, step 80: signal SIGUSR2. Checkpoint ckpt.pt written.", flush=True)
                print("trainstack hang report: no rank made progress for 5 s (hang_timeout=5 s)", flush=True)
                raise ValueError("the program's own error")
            if kind == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "sleep":
            time.sleep(5)
    acc.barrier()
    print("DONE", acc.rank, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
