"""Time to result of a short run, as a user meets it (make bench-startup): two standalone scripts -- raw
`mp.spawn` + DDP with a final `torch.save`, and the same model and data through `Trainer.fit` with its defaults --
each started as `python script.py N OUT` with its output read through pipes (as a CI job or a notebook reads it),
timed from the launch to the end of the first optimizer step and to the end of the output (the process and every
process holding its output gone). Interleaved repetitions, medians; independent of bench/run.py's workers.

    python bench/time_to_result.py                 # N = 1, 2; 3 repetitions; 30 steps per rank
    python bench/time_to_result.py --nprocs 2 --reps 5 --steps 10
    python bench/time_to_result.py --workload tiny     # a model too small to hide fixed costs
    python bench/time_to_result.py --workload lm       # a small transformer LM (per-op costs: e.g. a FLOP count)

The Trainer script runs as a user's would: with its defaults (the banner, live lines, metrics.jsonl, the final
checkpoint and summary); its output is read through a pipe, as a Slurm log or CI does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "user_scripts"
SYSTEMS = {"raw": "raw_ddp.py", "trainer": "trainstack_trainer.py"}
TARGET = 1.10


def run(system: str, n: int, steps: int, workload: str = "mlp") -> tuple[float, float]:
    """(seconds to the end of the first optimizer step, seconds to the end of the output) of one fresh run."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "STEPS": str(steps),
           "WORKLOAD": workload}
    with tempfile.TemporaryDirectory(prefix="ts-ttr-") as out:
        start = time.time()
        proc = subprocess.run([sys.executable, str(SCRIPTS / SYSTEMS[system]), str(n), out], env=env,
                              capture_output=True, text=True, timeout=600)
        done = time.time() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{system} N={n} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        first = json.loads((Path(out) / "times.json").read_text())["first_opt"] - start
    return first, done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", default="1,2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workload", default="mlp", choices=("mlp", "tiny", "lm"))
    args = p.parse_args()
    ns = [int(n) for n in args.nprocs.split(",")]
    seen: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rep in range(args.reps):
        for n in ns:
            for system in SYSTEMS:
                first, done = run(system, n, args.steps, args.workload)
                seen.setdefault((system, n), []).append((first, done))
                print(f"rep {rep} N={n} {system:8s} first optimizer step {first:.2f}s, done {done:.2f}s", flush=True)
    print("\n| N | system | first optimizer step s (vs raw) | whole run s (vs raw) |\n|---|---|---|---|")
    verdicts = []
    for n in ns:
        med = {s: (statistics.median(x[0] for x in seen[(s, n)]), statistics.median(x[1] for x in seen[(s, n)]))
               for s in SYSTEMS}
        for system, (first, done) in med.items():
            print(f"| {n} | {system} | {first:.2f} ({first / med['raw'][0]:.2f}x) | {done:.2f} "
                  f"({done / med['raw'][1]:.2f}x) |")
        start, whole = med["trainer"][0] / med["raw"][0], med["trainer"][1] / med["raw"][1]
        verdicts.append(f"N={n} trainer: start-up {start:.2f}x, whole run {whole:.2f}x raw (both write a final "
                        f"checkpoint) -> {'ok' if start <= TARGET and whole <= TARGET else 'ABOVE TARGET'}")
    print("\n" + "\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
