"""DDP vs FSDP vs HSDP vs HSDP + activation checkpointing (part of `make bench`): per-rank parameter + optimizer-
state bytes, the activations a step keeps for its backward, peak RSS, steps/s, and checkpoint save (sync and async)
and load times, on N processes (gloo on CPU here).

    python bench/fsdp.py                 # 4 blocks of Linear(2048, 2048) + GELU, 4 processes, HSDP 2 x 2
    python bench/fsdp.py --width 4096 --nprocs 2 --strategies ddp,fsdp
    python bench/fsdp.py --smoke         # a small model, a few steps (tests the bench)

Each strategy runs in its own fresh set of processes; the table gives per-rank medians and the ratio to DDP.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _kept_mb(model, x) -> float:
    """MB of activations autograd keeps for the backward of one forward (saved-tensor hooks; a parameter kept by
    reference is counted too, alike in every strategy)."""
    import torch

    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).pow(2).mean()
    loss.backward()
    return kept[0] / 2**20


def work(acc, width: int, layers: int, steps: int, batch: int, folder: str) -> dict:
    import torch
    from torch import nn

    from trainstack.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.randn(batch, width)
    kept_mb = _kept_mb(model, x)
    optimizer.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters() if not hasattr(p, "to_local")) + sum(
        p.to_local().numel() for p in model.parameters() if hasattr(p, "to_local"))
    state_bytes = sum(_local_bytes(p) for p in model.parameters()) + sum(
        _local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    out = {"rank": acc.rank, "params_local": params, "state_mb": state_bytes / 2**20, "kept_mb": kept_mb,
           "step_s": sorted(times[2:])[len(times[2:]) // 2]}
    counters = {"epoch": 1, "global_step": 1}
    parts = {"model": model, "optimizer": optimizer}
    for mode in ("sync", "async"):
        ck = Checkpointer(Path(folder) / mode, is_main=acc.is_main_process, sharded=True, async_save=mode == "async")
        acc.barrier()
        start = time.perf_counter()
        ck.save(counters, parts)
        stall = time.perf_counter() - start
        ck.wait()
        acc.barrier()
        out[f"save_{mode}_stall_s"], out[f"save_{mode}_total_s"] = stall, time.perf_counter() - start
    acc.barrier()
    start = time.perf_counter()
    Checkpointer(Path(folder) / "sync", is_main=acc.is_main_process, sharded=True).restore(parts, rank=acc.rank)
    acc.barrier()
    out["load_s"] = time.perf_counter() - start
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return acc.gather(torch.tensor([[out[k] for k in _KEYS]], dtype=torch.float64)).tolist() \
        if acc.world_size > 1 else [[out[k] for k in _KEYS]]


_KEYS = ("rank", "params_local", "state_mb", "kept_mb", "step_s", "save_sync_stall_s", "save_sync_total_s",
         "save_async_stall_s", "save_async_total_s", "load_s", "peak_rss_mb")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--strategies", default="ddp,fsdp,hsdp,hsdp+ac",
                   help="hsdp: 2 replicas of nprocs/2 shards; +ac: activation_checkpointing='full' on every block")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.width, args.layers, args.steps, args.batch = 64, 2, 4, 8
    from trainstack import Accelerator

    total_params = args.layers * (args.width * args.width + args.width)
    rows = {}
    for strategy in args.strategies.split(","):
        base, _, ac = strategy.partition("+")
        acc = Accelerator(nprocs=args.nprocs, compute_setup="cpu", strategy=base, fsdp_blocks=("Sequential",),
                          hsdp_replicas=2 if base == "hsdp" else None, activation_checkpointing="full" if ac else None)
        with tempfile.TemporaryDirectory(prefix="ts-fsdp-bench-") as folder:
            per_rank = acc.distribute(work)(acc, args.width, args.layers, args.steps, args.batch, folder)
        rows[strategy] = [dict(zip(_KEYS, r, strict=True)) for r in per_rank]
        print(json.dumps({"strategy": strategy, "per_rank": rows[strategy]}), flush=True)

    def med(strategy: str, key: str) -> float:
        values = sorted(r[key] for r in rows[strategy])
        return values[len(values) // 2]

    print(f"\nmodel: {args.layers} x Linear({args.width}, {args.width}) = {total_params / 1e6:.1f}M parameters, "
          f"batch {args.batch} per rank, {args.nprocs} processes, AdamW, gloo on CPU; per-rank medians\n")
    print("| strategy | params per rank | param+optimizer MB per rank | vs DDP | activations kept MB | vs DDP | "
          "peak RSS MB per rank | vs DDP | steps/s | vs DDP | save sync s | save async: stall s / total s | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for strategy in rows:
        print(f"| {strategy} | {med(strategy, 'params_local') / 1e6:.1f}M | {med(strategy, 'state_mb'):.0f} | "
              f"{med(strategy, 'state_mb') / med('ddp', 'state_mb'):.2f} | {med(strategy, 'kept_mb'):.1f} | "
              f"{med(strategy, 'kept_mb') / med('ddp', 'kept_mb'):.2f} | {med(strategy, 'peak_rss_mb'):.0f} | "
              f"{med(strategy, 'peak_rss_mb') / med('ddp', 'peak_rss_mb'):.2f} | {1 / med(strategy, 'step_s'):.2f} | "
              f"{med('ddp', 'step_s') / med(strategy, 'step_s'):.2f} | {med(strategy, 'save_sync_total_s'):.2f} | "
              f"{med(strategy, 'save_async_stall_s'):.2f} / {med(strategy, 'save_async_total_s'):.2f} | "
              f"{med(strategy, 'load_s'):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
