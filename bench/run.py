"""trainstack benchmark: the same workloads on raw PyTorch DDP, trainstack and (if installed) the peers.

    python bench/run.py                      # full run (make bench)
    python bench/run.py --smoke              # a few steps of everything (CI)
    python bench/run.py --workloads tiny --nprocs 2 --reps 5

Every measurement runs in a fresh process; systems are interleaved (ABAB...) within each repetition so that
load changes on a shared machine hit all of them alike. Reported: medians over repetitions of steps/s (after
a warm-up), per-step p50/p90, startup (process start to first step), peak RSS (sum over the processes), and
the ratio to raw; plus Python calls per step (a profile hook, independent of machine load).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from systems import COUNT_FROM, COUNT_TO, PEER_MODULES, SYSTEMS, WARMUP  # noqa: E402


def run_one(system: str, workload: str, nprocs: int, steps: int, count: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="ts-bench-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONHASHSEED": "0"}
        t_launch = time.time()
        proc = subprocess.run([sys.executable, str(HERE / "run.py"), "--worker", system, workload, str(nprocs),
                               str(steps), tmp, "1" if count else "0"], env=env, capture_output=True, text=True,
                              timeout=timeout)
        wall = time.time() - t_launch
        if proc.returncode != 0:
            raise RuntimeError(f"{system}/{workload}/N={nprocs} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        records = [json.loads(p.read_text()) for p in Path(tmp).glob("proc-*.json")]
    timed = next(r for r in records if "times" in r)
    times = timed["times"]
    # perf_counter values are per process; convert the first step to wall time with the process's offset
    first_step_wall = timed["t0_wall"] + times[0]
    steps_after = times[WARMUP:]
    diffs = sorted(b - a for a, b in zip(steps_after, steps_after[1:], strict=False))
    rate = (len(steps_after) - 1) / (steps_after[-1] - steps_after[0]) if len(steps_after) > 1 else float("nan")
    out = {"system": system, "workload": workload, "nprocs": nprocs, "steps": len(times), "steps_per_s": rate,
           "p50_ms": 1e3 * diffs[len(diffs) // 2] if diffs else None,
           "p90_ms": 1e3 * diffs[int(len(diffs) * 0.9)] if diffs else None,
           "startup_s": first_step_wall - t_launch, "wall_s": wall,
           "first_opt_s": timed["t0_wall"] + timed["opt_done"][0] - t_launch if timed.get("opt_done") else None,
           "checkpoint_s": timed.get("checkpoint_s"),
           "peak_rss_mb": sum(r["maxrss_kb"] for r in records) / 1024, "processes": len(records)}
    if count:
        out["calls_per_step"] = timed["calls"] / (COUNT_TO - COUNT_FROM)
    return out


def available(systems: list[str]) -> tuple[list[str], list[str]]:
    ok, missing = [], []
    for s in systems:
        module = PEER_MODULES.get(s)
        (missing if module and importlib.util.find_spec(module) is None else ok).append(s)
    return ok, missing


def table(rows: list[dict]) -> str:
    keys = sorted({(r["workload"], r["nprocs"]) for r in rows})
    lines = ["| workload | N | system | steps/s | ratio vs raw | p50 ms | p90 ms | startup s | startup vs raw | "
             "peak RSS MB | RSS vs raw | Python calls/step |", "|" + "---|" * 12]
    for workload, n in keys:
        group = [r for r in rows if r["workload"] == workload and r["nprocs"] == n]
        by_system: dict[str, list[dict]] = {}
        for r in group:
            by_system.setdefault(r["system"], []).append(r)
        med = {s: {k: statistics.median([x[k] for x in rs if x.get(k) is not None] or [float("nan")])
                   for k in ("steps_per_s", "p50_ms", "p90_ms", "startup_s", "peak_rss_mb", "calls_per_step")}
               for s, rs in by_system.items()}
        raw = med.get("raw")
        for system, m in med.items():
            def ratio(key: str, m: dict = m, raw: dict | None = raw) -> str:
                return f"{m[key] / raw[key]:.2f}" if raw and raw[key] else "-"
            calls = m["calls_per_step"]
            extra = f" ({calls - raw['calls_per_step']:+.0f})" if raw and system != "raw" and calls == calls else ""
            lines.append(f"| {workload} | {n} | {system} | {m['steps_per_s']:.1f} | {ratio('steps_per_s')} | "
                         f"{m['p50_ms']:.2f} | {m['p90_ms']:.2f} | {m['startup_s']:.2f} | {ratio('startup_s')}x | "
                         f"{m['peak_rss_mb']:.0f} | {ratio('peak_rss_mb')} | "
                         f"{'-' if calls != calls else f'{calls:.0f}{extra}'} |")
    return "\n".join(lines)


def loader_speed(nprocs: int, seconds: float) -> dict:
    """Samples/s of one rank's shard: raw DataLoader + DistributedSampler vs trainstack's prepared loader."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from trainstack.data import prepare_dataloader

    ds = TensorDataset(torch.randn(65536, 32), torch.randn(65536, 1))
    base = DataLoader(ds, batch_size=64, shuffle=True)
    raw = DataLoader(ds, batch_size=64, sampler=DistributedSampler(ds, num_replicas=nprocs, rank=0, shuffle=True))
    ours = prepare_dataloader(base, 0, nprocs)

    def rate(loader: DataLoader) -> float:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for x, _ in loader:
                n += len(x)
        return n / (time.perf_counter() - start)

    r, o = rate(raw), rate(ours)
    return {"nprocs": nprocs, "raw_samples_per_s": r, "trainstack_samples_per_s": o, "ratio": o / r}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        system, workload, nprocs, steps, out, count = sys.argv[2:8]
        SYSTEMS[system](workload, int(nprocs), int(steps), Path(out), count == "1")
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="tiny,mlp,classify")
    p.add_argument("--nprocs", default="1,2")
    p.add_argument("--systems", default="raw,accelerator-std,trainer-std,trainer-std-nowd,accelerator,"
                                         "accelerator-hf,trainer,trainer-lines,accelerate,fabric")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--smoke", action="store_true", help="a few steps of everything, 1 repetition (CI)")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    if args.smoke:
        args.reps, args.steps = 1, COUNT_TO + 5
    systems, missing = available(args.systems.split(","))
    if missing:
        print(f"not installed, skipped: {', '.join(missing)} (pip install 'trainstack[bench]')")
    workloads, nprocs = args.workloads.split(","), [int(n) for n in args.nprocs.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    jsonl = Path(args.out) / f"bench-{stamp}.jsonl"
    import torch

    meta = {"date": stamp, "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "machine": platform.machine()}
    rows: list[dict] = []
    with open(jsonl, "w") as fh:
        fh.write(json.dumps({"meta": meta}) + "\n")
        for rep in range(args.reps):
            for workload in workloads:
                for n in nprocs:
                    for system in systems:  # interleaved: every system once per repetition
                        steps = args.steps if workload != "mlp" or args.smoke else max(args.steps // 4, 80)
                        row = run_one(system, workload, n, steps, count=rep == 0 and workload == "tiny",
                                      timeout=900)
                        row["rep"] = rep
                        rows.append(row)
                        fh.write(json.dumps(row) + "\n")
                        fh.flush()
                        print(f"rep {rep} {workload:9s} N={n} {system:11s} {row['steps_per_s']:8.1f} steps/s "
                              f"startup {row['startup_s']:.2f}s", flush=True)
        loaders = [loader_speed(n, 0.5 if args.smoke else 3.0) for n in nprocs]
        for entry in loaders:
            fh.write(json.dumps({"loader": entry}) + "\n")
    print(f"\n{meta}\n")
    print(table(rows))
    print("\nTensorDataset fast path (one rank's shard, samples/s):")
    for e in loaders:
        print(f"  N={e['nprocs']}: raw DataLoader {e['raw_samples_per_s']:.0f}, trainstack "
              f"{e['trainstack_samples_per_s']:.0f}  ({e['ratio']:.1f}x)")
    print(f"\nresults: {jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
