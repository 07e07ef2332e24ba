"""Time to result of a short run: process start to the first step, to the end of the first optimizer step, and to
process exit, per number of processes (make bench-startup).

    python bench/startup.py                        # N = 1, 2; the mlp workload; 3 interleaved repetitions
    python bench/startup.py --nprocs 1,2,4,8 --workload tiny --reps 5

Every run is a fresh process (bench/run.py --worker). Three clocks, identical in every system: a forward pre-hook
(the first step starts), an optimizer step post-hook (the first optimizer step ended) and the parent's stopwatch
around the whole process (exit). Systems: the raw `mp.spawn` + DDP loop (1.00), the Accelerator loop and Trainer.fit
as shipped (workers forked from the preloaded fork server; the Trainer with its defaults: metrics.jsonl, run.json,
a final checkpoint, the loss curve, the model handed back to the caller), optionally both with TRAINSTACK_PRELOAD=0.
The whole-run target is "raw + the final checkpoint's write time" (the Trainer writes one; raw does not): the
table shows the Trainer's wall time less that write time against raw. Medians of the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import run_one  # noqa: E402

SYSTEMS = ("raw", "accelerator", "trainer")
CLOCKS = ("startup_s", "first_opt_s", "wall_s")
TARGET = 1.10  # start-up and whole run (less the final checkpoint) against raw


def medians(seen: dict[tuple[str, int], list[dict]]) -> dict[tuple[str, int], dict[str, float]]:
    out = {}
    for key, rows in seen.items():
        out[key] = {k: statistics.median([r[k] for r in rows]) for k in CLOCKS}
        out[key]["checkpoint_s"] = statistics.median([r.get("checkpoint_s") or 0.0 for r in rows])
    return out


def table(med: dict[tuple[str, int], dict[str, float]], systems: list[str], ns: list[int]) -> str:
    lines = ["| N | system | first step s | first optimizer step s (vs raw) | exit s (vs raw) | final checkpoint s | "
             "exit less checkpoint (vs raw) |", "|---|---|---|---|---|---|---|"]
    for n in ns:
        raw = med[("raw", n)]
        for system in systems:
            m = med[(system, n)]
            less = m["wall_s"] - m["checkpoint_s"]
            lines.append(f"| {n} | {system} | {m['startup_s']:.2f} | {m['first_opt_s']:.2f} "
                         f"({m['first_opt_s'] / raw['first_opt_s']:.2f}x) | {m['wall_s']:.2f} "
                         f"({m['wall_s'] / raw['wall_s']:.2f}x) | {m['checkpoint_s']:.3f} | {less:.2f} "
                         f"({less / raw['wall_s']:.2f}x) |")
    return "\n".join(lines)


def verdicts(med: dict[tuple[str, int], dict[str, float]], systems: list[str], ns: list[int]) -> list[str]:
    """The targets, one line each: first optimizer step and exit (less the final checkpoint) within 1.1x raw."""
    out = []
    for n in ns:
        raw = med[("raw", n)]
        for system in (s for s in systems if s != "raw"):
            m = med[(system, n)]
            start = m["first_opt_s"] / raw["first_opt_s"]
            whole = (m["wall_s"] - m["checkpoint_s"]) / raw["wall_s"]
            ok = "ok" if start <= TARGET and whole <= TARGET else "ABOVE TARGET"
            out.append(f"N={n} {system}: start-up {start:.2f}x, whole run {whole:.2f}x raw (+ checkpoint) -> {ok}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", default="1,2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workload", default="mlp", choices=("tiny", "mlp", "classify"))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="also: accelerator-spawn, trainer-spawn, "
                   "trainer-nofreeze, accelerator-nofreeze")
    p.add_argument("--json", help="also write the medians here")
    args = p.parse_args()
    ns, systems = [int(n) for n in args.nprocs.split(",")], args.systems.split(",")
    if "raw" not in systems:
        systems.insert(0, "raw")
    print(f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r} (set: every process compiles "
          f"the Python it imports, raw included)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "", flush=True)
    seen: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.reps):
        for n in ns:
            for system in systems:  # interleaved: load changes hit every system alike
                row = run_one(system, args.workload, n, args.steps, count=False, timeout=600)
                seen.setdefault((system, n), []).append(row)
                print(f"rep {rep} N={n} {system:18s} first step {row['startup_s']:.2f}s, first optimizer step "
                      f"{row['first_opt_s']:.2f}s, exit {row['wall_s']:.2f}s", flush=True)
    med = medians(seen)
    print("\n" + table(med, systems, ns) + "\n")
    print("\n".join(verdicts(med, systems, ns)))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s}/{n}": v for (s, n), v in med.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
