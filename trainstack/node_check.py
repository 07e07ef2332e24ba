"""Pre-flight node check: what each node of a job step can do, measured before training starts.

    srun --ntasks-per-node=1 python -m trainstack.node_check --out JOBDIR/node-check --port PORT

The batch script of a multi-node job runs it before each step's rendezvous (``--no-node-check`` skips it). Each
task (one per node) writes ``<out>/<host>.json`` -- a compute rate (a matrix multiply on each GPU, or on one CPU
core), the GPUs ``nvidia-smi`` sees (count, uncorrected ECC errors, clocks, memory), free memory,
free ``/dev/shm`` and the write speed of the job folder's file system -- then the tasks time an all-reduce ring
over the nodes and a ping-pong between neighbours (to name a slow link), which rank 0 writes to
``<out>/links.json``. Judging the figures is the torch-free ``trainstack._slurm.nodecheck`` (on the batch host):
a node that never wrote its file is named too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._common.files import atomic_write

__all__ = ["compute_rate", "gpu_facts", "host_facts", "write_speed", "links", "main"]

_GPU_QUERY = ("index,name,memory.used,memory.total,clocks.sm,clocks.max.sm,ecc.errors.uncorrected.volatile.total,"
              "temperature.gpu")


def compute_rate(device: torch.device, seconds: float = 0.5, windows: int = 5) -> float:
    """GFLOP/s of a square matrix multiply on ``device`` (bf16 on a GPU, float32 on a CPU core): the best of
    ``windows`` timed windows over ``seconds``. A slow node is slow in every window; a moment of noise (a process
    scheduled beside it, a clock ramping up, a neighbour task still starting) costs only some of them."""
    gpu = device.type == "cuda"
    n = 4096 if gpu else 384
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if gpu else torch.float32)
    b = torch.randn_like(a)
    torch.mm(a, b)  # warm-up
    _sync(device)
    best, window = 0.0, seconds / windows
    for _ in range(windows):
        iters, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            iters += 1
            if gpu and iters % 10:
                continue
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= window:
                break
        best = max(best, 2 * n ** 3 * iters / elapsed / 1e9)
    return best


def gpu_facts() -> list[dict[str, Any]]:
    """What ``nvidia-smi`` says of each GPU ([] without one)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    keys = _GPU_QUERY.split(",")
    rows = []
    for line in out.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        rows.append({k: (float(v) if v.replace(".", "", 1).isdigit() else v) for k, v in zip(keys, values,
                                                                                            strict=False)})
    return rows


def host_facts() -> dict[str, Any]:
    """Free memory and ``/dev/shm``, the CPUs this task may use."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    try:
        shm = shutil.disk_usage("/dev/shm").free / 2 ** 30
    except OSError:
        shm = None
    return {"cpus": len(os.sched_getaffinity(0)), "mem_available_gb": available, "shm_free_gb": shm}


def write_speed(folder: Path, megabytes: int = 32) -> float | None:
    """MB/s of writing and syncing ``megabytes`` into ``folder`` (the job folder's file system); the file is
    removed."""
    path = folder / f".write-test-{socket.gethostname()}-{os.getpid()}"
    block = os.urandom(2 ** 20)
    try:
        start = time.perf_counter()
        with open(path, "wb") as fh:
            for _ in range(megabytes):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return megabytes / (time.perf_counter() - start)
    except OSError:
        return None
    finally:
        path.unlink(missing_ok=True)


def links(device: torch.device, megabytes: int = 4, reps: int = 5) -> dict[str, Any]:
    """The ring (an all-reduce of every node) and each neighbour pair (ping-pong), each the best of ``reps`` timings
    (a link's capacity, not a moment's scheduling noise); every rank calls it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.ones(megabytes * 2 ** 18, device=device)
    dist.all_reduce(data)
    _sync(device)
    ring = min(_timed(lambda: dist.all_reduce(data), device) for _ in range(reps))
    pairs = []
    for first in range(world if world > 2 else 1):
        second = (first + 1) % world
        dist.barrier()
        if rank == first:
            # the closure runs within this iteration: ``second`` is the pair's
            seconds = min(_timed(lambda: (dist.send(data, second), dist.recv(data, second)), device)  # noqa: B023
                          for _ in range(reps))
            pairs.append({"ranks": [first, second], "seconds": seconds})
        elif rank == second:
            for _ in range(reps):
                dist.recv(data, first)
                dist.send(data, first)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"host": _host(), "pairs": pairs})
    hosts = [e["host"] for e in everyone]
    measured = {tuple(p["ranks"]): p["seconds"] for e in everyone for p in e["pairs"]}
    return {"megabytes": megabytes, "ring_seconds": ring,
            "ring_gbps": data.numel() * 4 * 2 * (world - 1) / world / ring / 1e9,
            "pairs": [{"hosts": [hosts[a], hosts[b]], "seconds": s} for (a, b), s in sorted(measured.items())]}


def _timed(work: Callable[[], object], device: torch.device) -> float:
    """Seconds ``work()`` takes, the device synchronised."""
    start = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainstack.node_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the folder each node writes its figures to")
    parser.add_argument("--port", type=int, help="the ring's rendezvous port on MASTER_ADDR (none: no ring)")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds the whole check may take")
    args = parser.parse_args(argv)
    started = time.monotonic()
    rank, world = int(os.environ.get("SLURM_PROCID", 0)), int(os.environ.get("SLURM_NTASKS", 1))
    torch.set_num_threads(1)  # a core's rate: comparable whatever each node's task binding, no thread oversubscription
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [torch.device("cuda", i) for i in range(gpus)] or [torch.device("cpu")]
    record: dict[str, Any] = {"host": _host(), "rank": rank, "time": time.time(), **host_facts(),
                              "gpus_visible": gpus, "gpus": gpu_facts(),
                              "gflops": [round(compute_rate(d), 2) for d in devices],
                              "write_mbps": write_speed(args.out.parent)}
    record["seconds"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / f"{record['host']}.json", json.dumps(record, indent=1))
    if args.port is None or world < 2:
        return 0
    left = max(args.budget - (time.monotonic() - started) - 2, 3)
    device = devices[0]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{args.port}",
                            timeout=datetime.timedelta(seconds=left))
    try:
        found = links(device)
        if rank == 0:
            atomic_write(args.out / "links.json", json.dumps(found, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
