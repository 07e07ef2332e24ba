"""Start-up: from `python train.py` to the first step, per number of processes (make bench).

    python bench/startup.py                       # N = 1, 2, 4, 8; 3 interleaved repetitions
    python bench/startup.py --nprocs 2 --reps 5

Every run is a fresh process (bench/run.py --worker) on the `tiny` workload; start-up is the wall time from
launching the process to the first step of rank 0 (a forward pre-hook, identical in every system). Systems: the
raw `mp.spawn` DDP loop (1.00), the Accelerator loop and Trainer.fit as shipped (workers forked from the preloaded
fork server), and both with TRAINSTACK_PRELOAD=0 (workers spawned from scratch: the behaviour before). Medians of
the repetitions; "per extra worker" is (start-up at N - start-up at 2) / (N - 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import run_one  # noqa: E402

SYSTEMS = ("raw", "accelerator", "accelerator-spawn", "trainer", "trainer-spawn")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", help="also write the medians here")
    args = p.parse_args()
    ns, systems = [int(n) for n in args.nprocs.split(",")], args.systems.split(",")
    seen: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps):
        for n in ns:
            for system in systems:  # interleaved: load changes hit every system alike
                row = run_one(system, "tiny", n, args.steps, count=False, timeout=600)
                seen.setdefault((system, n), []).append(row["startup_s"])
                print(f"rep {rep} N={n} {system:18s} start-up {row['startup_s']:.2f}s", flush=True)
    med = {k: statistics.median(v) for k, v in seen.items()}
    print("\n| system | " + " | ".join(f"N={n} s (vs raw)" for n in ns) + " | per extra worker s |")
    print("|---|" + "---|" * (len(ns) + 1))
    for system in systems:
        cells = [f"{med[(system, n)]:.2f} ({med[(system, n)] / med[('raw', n)]:.2f}x)" for n in ns]
        big = [n for n in ns if n > 2]
        extra = (med[(system, max(big))] - med[(system, 2)]) / (max(big) - 2) if big and 2 in ns else float("nan")
        print(f"| {system} | " + " | ".join(cells) + f" | {extra:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s}/{n}": v for (s, n), v in med.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
