"""Torch-level communication sanity check, run through the same launch scripts as training.

    trainstack submit --setup multi-node --nodes 2 --launcher torchrun --wait -- -m trainstack.nccl_check
    torchrun --standalone --nproc_per_node 2 -m trainstack.nccl_check

Every rank allocates on its device, runs all_reduce and barrier, and checks the result; rank 0 then times a
larger all_reduce (bus bandwidth as nccl-tests reports it) and prints the torch/CUDA/NCCL versions.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from . import _envvars as envvars
from .accelerator import Accelerator


def check(accelerator: Accelerator, megabytes: int) -> dict:
    rank, world, device = accelerator.rank, accelerator.world_size, accelerator.device
    host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    t = torch.full((1024,), float(rank + 1), device=device)
    if accelerator.is_distributed:
        dist.all_reduce(t)
        dist.barrier()
    expected = world * (world + 1) / 2
    ok = bool(torch.allclose(t, torch.full_like(t, expected)))
    print(f"[rank {rank}/{world}] host={host} device={device} backend={accelerator.backend} all_reduce "
          f"{'ok' if ok else f'WRONG ({t[0].item()} != {expected})'}", flush=True)
    busbw = None
    if accelerator.is_distributed and megabytes > 0:
        big = torch.ones(megabytes * 262144, device=device)  # float32: 4 bytes each
        dist.all_reduce(big)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        iters = 5
        for _ in range(iters):
            dist.all_reduce(big)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / iters
        busbw = big.numel() * 4 / elapsed * 2 * (world - 1) / world / 1e9
    flags = accelerator.all_reduce_dict({"ok": float(ok)}, op="min")
    return {"ok": bool(flags["ok"]), "world": world, "busbw_GBps": busbw}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=1, help="processes to spawn when not under a launcher")
    parser.add_argument("--compute-setup", default=os.environ.get(envvars.COMPUTE_SETUP, "auto"),
                        choices=["auto", "gpu", "cpu"])
    parser.add_argument("--megabytes", type=int, default=64, help="size of the timed all_reduce (0: skip)")
    args = parser.parse_args(argv)
    accelerator = Accelerator(nprocs=args.nprocs, compute_setup=args.compute_setup)
    result = accelerator.distribute(check)(accelerator, args.megabytes)
    if result is not None and accelerator.is_main_process:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        bw = f"{result['busbw_GBps']:.2f} GB/s bus bandwidth" if result["busbw_GBps"] else "no timing"
        print(f"nccl-check {'PASSED' if result['ok'] else 'FAILED'}: world {result['world']}, {bw}; torch "
              f"{torch.__version__} cuda {torch.version.cuda} nccl {nccl}", flush=True)
        return 0 if result["ok"] else 1
    return 0 if result is None or result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
