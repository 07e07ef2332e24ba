"""A sweep (``--sweep KEY=V1,V2 ...``) as a Slurm job array: its keys and values checked, and its tasks -- every
combination, in array order, each with its extra arguments and a stable signature (the folder its results go to,
and what tells a finished task from a new one). Torch-free."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from typing import Any

__all__ = ["check_sweep", "sweep_tasks", "MAX_TASKS"]

#: Slurm's default MaxArraySize is 1001.
MAX_TASKS = 1000


def check_sweep(sweep: dict[str, list[str]], max_parallel: int | None) -> tuple[str, str] | None:
    """What is wrong with a sweep and its ``--max-parallel``, as (option, why), or None."""
    for key, values in sweep.items():
        if not re.fullmatch(r"-{0,2}[A-Za-z_][A-Za-z0-9_.-]*", key):
            return "--sweep", f"{key!r} is not an option name (letters, digits, _ . -), e.g. lr=1e-3,1e-4"
        if not values or any(v == "" for v in values):
            return "--sweep", f"{key}={','.join(values)!r} has an empty value; give KEY=V1,V2,..."
        if any("\n" in v or "\r" in v for v in values):
            return "--sweep", f"{key}: values must be single lines"
        if len(set(values)) != len(values):
            return "--sweep", f"{key} repeats a value ({','.join(values)}): each task would run twice"
    if max_parallel is not None and not sweep:
        return "--max-parallel", "only applies with --sweep (it limits how many array tasks run at once)"
    if max_parallel is not None and max_parallel < 1:
        return "--max-parallel", f"{max_parallel} is less than 1"
    count = math.prod(len(v) for v in sweep.values()) if sweep else 0  # before building any task
    if count > MAX_TASKS:
        return "--sweep", f"{count} tasks: more than Slurm's default MaxArraySize (1001) allows; split the sweep"
    return None


def sweep_tasks(sweep: dict[str, list[str]], basis: list[Any]) -> list[dict[str, Any]]:
    """The tasks of ``sweep``, in array order: their arguments, values and a signature over ``basis`` (what the
    result depends on besides the task's own arguments) and the arguments."""
    if not sweep:
        return []
    keys, out = list(sweep), []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        args: list[str] = []
        for key, value in zip(keys, combo, strict=True):
            args += [key if key.startswith("-") else f"--{key}", value]
        digest = hashlib.sha1(json.dumps([basis, args]).encode()).hexdigest()[:12]
        out.append({"args": args, "signature": digest, "values": dict(zip(keys, combo, strict=True))})
    return out
