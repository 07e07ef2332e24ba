"""``python -m trainstack._remote CALL.pkl``: the command queued jobs of ``submit_function`` run (a stable name for
scripts already in the queue); the runner lives in ``trainstack._slurm.call``."""

import sys

from ._slurm.call import run

if __name__ == "__main__":
    run(sys.argv)
