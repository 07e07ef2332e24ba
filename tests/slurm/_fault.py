"""A fault program for tests/slurm/test_verdicts.py: 4 ranks (2 nodes x 2 srun tasks) train a little, then rank 1
fails as ``sys.argv[1]`` says while the others wait in a collective: ``error``, ``oom``, ``kill9``, ``silent`` (rank 1
stops answering: the others' collective times out), ``forever`` (every rank sleeps into the time limit), ``fine``,
``sleep`` (slow, to be cancelled)."""

import os
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
        if kind == "sleep":
            time.sleep(5)
    acc.barrier()
    print("DONE", acc.rank, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
