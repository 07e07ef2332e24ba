"""What a memory checkpoint costs training, against a synchronous durable save of the same state, in the same run.

2 processes under torchrun, each counted as a node of its own (TRAINSTACK_NODE_NAME), so every memory checkpoint
is also copied to the other rank; an MLP of ``--width``/``--layers`` with AdamW (the state: weights + two moments).
Three fits of the same steps on the same data:

* ``plain``: no checkpoints (the reference time per step);
* ``memory``: a memory checkpoint every ``--every`` steps: the stall per checkpoint (what ``save`` took on the
  training thread: the CPU copy, and any wait for the previous checkpoint's write and copy when the interval is
  shorter than they take), and the run's time against ``plain`` (on a CPU-only machine the writer thread and the
  copy share the CPUs with training);
* ``durable``: the same state saved synchronously (``trainer.save_checkpoint()``, a ``.pt`` file on local disk,
  fsynced) -- what the stall is compared with.

On a CUDA machine the state lives on the GPU (compute_setup "auto"), so the staging stall is the device-to-pinned
copy; one GPU takes ``--nproc 1`` (no peer copy then).

Run: ``make bench-memory`` (or ``python bench/memory_checkpoints.py [--width 2048 --layers 6 --every 10 --nproc 2]``).
Writes bench/results/memory_checkpoints.json."""

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

REPO = Path(__file__).resolve().parents[1]


def worker(out: Path, width: int, layers: int, steps: int, every: int) -> None:
    rank = int(os.environ["RANK"])
    os.environ["TRAINSTACK_NODE_NAME"] = f"n{rank}"
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainstack import Callback, TrainConfig, Trainer

    results: dict[str, float] = {}

    def fit(name: str, **config: object) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        x = torch.randn(64 * steps, width)  # on the host: the Trainer moves each batch, as for a user's data
        loader = DataLoader(TensorDataset(x, x), batch_size=64)

        def at_end(trainer, *_args) -> None:
            run = trainer.run
            if run is not None and run.memory is not None:
                saves = max(run.memory.saves, 1)
                results["memory_stall_s"] = run.tracker.live.memory_stall / saves
                results["memory_wait_s"] = run.memory.waited_seconds / saves
                results["staging_first_s"] = run.memory.staging[0]
                results["staging_median_s"] = statistics.median(run.memory.staging[1:] or run.memory.staging)
                results["memory_saves"] = run.memory.saves
            if name == "durable":
                start = time.perf_counter()
                trainer.save_checkpoint(name="bench-sync")
                results["durable_save_s"] = time.perf_counter() - start

        cfg = TrainConfig(max_iter=1, max_steps=steps, log_folder=out / name, resume="auto", verbose=False,
                          checkpoint_format="file", callbacks=[Callback(on="train_end", callback=at_end)], **config)
        start = time.perf_counter()
        Trainer(model, torch.optim.AdamW(model.parameters(), 1e-4), cfg, loss_fn="mse").fit(loader)
        results[f"{name}_s"] = time.perf_counter() - start
        results["state_mb"] = sum(p.numel() * 4 * 3 for p in model.parameters()) / 1e6

    fit("warm-up")  # not compared: the first fit pays the device's and the allocator's start (on a GPU: 0.46x before)
    fit("plain")
    fit("memory", memory_checkpoint_every_n_steps=every)
    fit("durable")
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2, help="processes (one per GPU on a CUDA machine)")
    parser.add_argument("--worker", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.layers, args.steps, args.every)
        return
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        out = Path(tmp)
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(args.nproc), __file__, "--worker", str(out),
               "--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps),
               "--every", str(args.every)]
        subprocess.run(cmd, check=True, timeout=1800, cwd=REPO)
        r = json.loads((out / "results.json").read_text())
    ratio = r["staging_median_s"] / r["durable_save_s"]
    import torch

    where = (f"{torch.cuda.get_device_name()} (CUDA tensors -> pinned host buffers)" if torch.cuda.is_available()
             else "CPU")
    print(f"{args.nproc} process(es), state on: {where}")
    rows = [("state per rank (weights + AdamW moments)", f"{r['state_mb']:.0f} MB"),
            ("memory checkpoint: staging stall per save (CPU copy into reused buffers), median",
             f"{r['staging_median_s'] * 1000:.1f} ms"),
            ("memory checkpoint: the first save (maps the buffers once)", f"{r['staging_first_s'] * 1000:.1f} ms"),
            ("memory checkpoint: stall per save, all included (mean)", f"{r['memory_stall_s'] * 1000:.1f} ms"),
            ("of which waiting for the previous save's write and copy", f"{r['memory_wait_s'] * 1000:.1f} ms"),
            ("durable checkpoint: synchronous save (.pt, fsync)", f"{r['durable_save_s'] * 1000:.1f} ms"),
            ("staging stall (median) / synchronous save", f"{100 * ratio:.1f} %"),
            (f"run time with a memory checkpoint every {args.every} steps / none",
             f"{r['memory_s'] / r['plain_s']:.3f}")]
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    results = REPO / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "memory_checkpoints.json").write_text(json.dumps({**r, "staging_over_sync_save": ratio,
                                                                  "device": where,
                                                                  "args": vars(args) | {"worker": None}}, indent=1))


if __name__ == "__main__":
    main()
