"""Functions sent to Slurm by tests/slurm/test_submit_function.py (must be importable by the job)."""

import os


def square_on_the_cluster(x):
    return {"value": x * x, "node": os.environ.get("SLURMD_NODENAME"), "job": os.environ.get("SLURM_JOB_ID")}


def fails():
    raise ValueError("failure inside the job")
