"""Torch-level communication sanity check, run through the same launch scripts as training.

    trainstack submit --setup multi-node --nodes 2 --launcher torchrun --wait -- -m trainstack.nccl_check
    torchrun --standalone --nproc_per_node 2 -m trainstack.nccl_check
    ... -m trainstack.nccl_check --expect ib     # fail unless NCCL really uses InfiniBand (no silent TCP fallback)

Every rank allocates on its device, runs all_reduce and barrier, and checks the result; rank 0 then times a
larger all_reduce (bus bandwidth as nccl-tests reports it) and prints the torch/CUDA/NCCL versions and the network
NCCL chose, from its own init lines. With ``--expect`` (or ``TRAINSTACK_NCCL_TRANSPORT``, which ``--nccl-transport``
sets in generated scripts) each host is checked before NCCL starts and NCCL may not fall back (``NCCL_NET``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ._common import envvars as envvars
from ._common import transport as _transport
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
    init = _transport.read_init_files(_transport.own_debug_files())
    return {"ok": bool(flags["ok"]), "world": world, "busbw_GBps": busbw,
            "network": ", ".join(sorted(init.networks)) or None, "devices": init.devices}


def require(expect: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Make the processes this check starts require ``expect`` (NCCL_NET, the pre-flight check, the init lines in
    files of their own) unless a generated script already did: the temp folder made for those files (the caller
    removes it: the temp folder is left as found), or None."""
    if not expect or environ.get(_transport.REQUIRED_ENV) == expect:
        return None
    folder = tempfile.mkdtemp(prefix="trainstack-nccl-check-")
    environ.update(_transport.step_env(expect, os.path.join(folder, "nccl.%h.%p.log")))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=1, help="processes to spawn when not under a launcher")
    parser.add_argument("--compute-setup", default=os.environ.get(envvars.COMPUTE_SETUP, "auto"),
                        choices=["auto", "gpu", "cpu"])
    parser.add_argument("--megabytes", type=int, default=64, help="size of the timed all_reduce (0: skip)")
    parser.add_argument("--expect", choices=sorted(_transport.TRANSPORTS), default=None,
                        help="the network NCCL must use; a host that lacks it, or a fallback, fails the check "
                             f"(default: {_transport.REQUIRED_ENV})")
    args = parser.parse_args(argv)
    given = os.environ.get(_transport.REQUIRED_ENV) or None
    if args.expect is None and given is not None and given not in _transport.TRANSPORTS:
        parser.error(f"{_transport.REQUIRED_ENV}={given!r} is not a transport: "
                     f"{', '.join(sorted(_transport.TRANSPORTS))}")
    args.expect = args.expect or given
    made = require(args.expect)
    try:
        return _check(args)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _check(args: argparse.Namespace) -> int:
    accelerator = Accelerator(nprocs=args.nprocs, compute_setup=args.compute_setup)
    if args.expect and accelerator.backend != "nccl":
        print(f"nccl-check FAILED: --expect {args.expect} checks NCCL's network, and this run uses "
              f"{accelerator.backend} (no GPU here, or compute_setup=cpu)", file=sys.stderr, flush=True)
        return 2
    try:
        result = accelerator.distribute(check)(accelerator, args.megabytes)
    except _transport.TransportError as exc:
        print(f"nccl-check FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    if result is not None and accelerator.is_main_process:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        bw = f"{result['busbw_GBps']:.2f} GB/s bus bandwidth" if result["busbw_GBps"] else "no timing"
        net = f"; network {result['network']}" if result["network"] else ""
        print(f"nccl-check {'PASSED' if result['ok'] else 'FAILED'}: world {result['world']}, {bw}; torch "
              f"{torch.__version__} cuda {torch.version.cuda} nccl {nccl}{net}", flush=True)
        for line in result["devices"]:
            print(f"  {line}", flush=True)
        return 0 if result["ok"] else 1
    return 0 if result is None or result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
