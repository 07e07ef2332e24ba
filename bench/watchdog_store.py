"""The hang watchdog's traffic on the process group's store, per interval, as the number of ranks grows (the probe's
scale finding: every rank reading every rank's heartbeat was N² -- 6 TCP segments/s at N=2, 273 at N=16).

    python bench/watchdog_store.py                  # N = 2, 4, 8, 16
    python bench/watchdog_store.py --nprocs 2,4 --seconds 3

N real processes share one real TCPStore (rank 0 hosts it, as the process group does); each runs the watchdog with
its heartbeat moving, for a few intervals; a counting wrapper around each rank's store client counts the requests
(set, get, check, multi_get, compare_set, wait). Reported: requests per interval, all ranks together, and per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INTERVAL_S = 0.5


class Counting:
    """A store client that counts its requests (multi_get is one request for all its keys)."""

    def __init__(self, store: object) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.store, name)
        if name in ("set", "get", "check", "multi_get", "compare_set", "wait", "add"):
            def counted(*args: object, **kwargs: object) -> object:
                self.calls += 1
                return attr(*args, **kwargs)
            return counted
        return attr


def worker(rank: int, world: int, port: int, seconds: float, out: str) -> None:
    import torch.distributed as dist

    from trainstack._runtime import watchdog

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
    counting = Counting(store)
    dog = watchdog.Watchdog(rank, world, timeout=6 * INTERVAL_S, dump_dir=Path(out), store=counting, armed=True)
    dog.interval = INTERVAL_S
    hb = watchdog.heartbeat()
    store.add("ready", 1)
    while int(store.add("ready", 0)) < world:  # every rank up before counting
        time.sleep(0.05)
    dog.start()
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        hb.step += 1
        hb.beats += 1
        time.sleep(0.05)
    dog.stop()
    dog.join()
    intervals = (time.monotonic() - started) / INTERVAL_S
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"calls": counting.calls, "intervals": intervals}))
    store.add("done", 1)
    if rank == 0:
        while int(store.add("done", 0)) < world:
            time.sleep(0.05)


def measure(world: int, seconds: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="ts-wd-") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port), str(seconds),
                                   out], env=env) for r in range(world)]
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"rank of N={world} failed")
        rows = [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(world)]
    per_interval = sum(r["calls"] / r["intervals"] for r in rows)
    return {"nprocs": world, "requests_per_interval": per_interval, "per_rank": per_interval / world,
            "rank0": rows[0]["calls"] / rows[0]["intervals"]}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", default="2,4,8,16")
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()
    rows = [measure(int(n), args.seconds) for n in args.nprocs.split(",")]
    print("\n| N | store requests per interval (all ranks) | per rank | rank 0 | the old N² design (2N² + N) |")
    print("|---|---|---|---|---|")
    for r in rows:
        n = r["nprocs"]
        print(f"| {n} | {r['requests_per_interval']:.1f} | {r['per_rank']:.2f} | {r['rank0']:.1f} | {2 * n * n + n} |")
    first, last = rows[0], rows[-1]
    growth = (last["requests_per_interval"] / first["requests_per_interval"]) / (last["nprocs"] / first["nprocs"])
    print(f"\ngrowth from N={first['nprocs']} to N={last['nprocs']}: {growth:.2f}x the growth of N (1.00 = linear)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
