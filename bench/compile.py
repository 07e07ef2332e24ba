"""torch.compile: a raw compiled loop vs ``Trainer(compile=True)`` (steps/s, ratio to raw in the same run), and the
first step cold vs warm -- a fresh compile cache vs the cache a previous attempt left (what a requeue sees).

    python bench/compile.py                 # 3 interleaved repetitions (make bench-compile)
    python bench/compile.py --smoke         # 1 repetition, few steps (CI)
    python bench/compile.py --device cuda   # on a GPU (scripts/gpu-check.sh): inductor's Triton kernels

Every measurement is a fresh process, so inductor's in-memory caches start empty and only the on-disk cache can
make a start warm. Steps/s: the steps after the first (compiling) one; first step: process-relative, from the
start of the first step to its end (compile included). One process, CPU inductor with the system C++ compiler
(or CUDA when there is one).
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _data(steps: int, device: str = "cpu"):
    import torch

    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 256, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device))
            for _ in range(steps)]


def _stamp(device: str) -> float:
    """A step's end as the host sees the device's work done (CUDA runs ahead of the host)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))


def worker_raw(steps: int, out: Path, device: str) -> None:
    import torch

    model = torch.compile(_model().to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _data(steps, device)
    stamps = [_stamp(device)]
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(_stamp(device))
    out.write_text(json.dumps(stamps))


def worker_trainer(steps: int, out: Path, device: str) -> None:
    import torch

    from trainstack import Callback, TrainConfig, Trainer

    stamps: list[float] = []

    def first(*_: object) -> None:  # the first batch's start, as the raw loop's (fit's own set-up is not the step)
        if not stamps:
            stamps.append(_stamp(device))

    model = _model()
    config = TrainConfig(compute_setup="gpu" if device == "cuda" else "cpu", max_iter=1, compile=True,
                         verbose=False, log_folder=out.parent / "run",
                         checkpoint_every=0, plot_every=0, write_every=0,
                         callbacks=[Callback(on="train_batch_start", callback=first),
                                    Callback(on="train_batch_end", callback=lambda *a: stamps.append(
                                        _stamp(device)))])
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config, loss_fn="cross_entropy")
    trainer.fit(_data(steps))
    out.write_text(json.dumps(stamps))


def measure(system: str, steps: int, cache: Path, device: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ts-compile-") as tmp:
        out = Path(tmp) / "stamps.json"
        path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # wheels carried there too
        env = {**os.environ, "PYTHONPATH": path, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
               "TRAINSTACK_COMPILE_CACHE": str(cache), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        proc = subprocess.run([sys.executable, __file__, "--worker", system, str(steps), str(out), device], env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        stamps = json.loads(out.read_text())
    after = stamps[3:]  # after the first two steps: the optimizer's state appears (and may recompile) in step 2
    return {"system": system, "first_step_s": stamps[1] - stamps[0],
            "steps_per_s": (len(after) - 1) / (after[-1] - after[0])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    if args.worker:
        system, steps, out, device = args.worker
        (worker_raw if system == "raw" else worker_trainer)(int(steps), Path(out), device)
        return 0
    reps, steps = (1, 30) if args.smoke else (args.reps, args.steps)
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(reps):
        for system in ("raw", "trainer"):  # interleaved: load changes hit both alike
            with tempfile.TemporaryDirectory(prefix="ts-cache-") as cache:
                for start in ("cold", "warm"):  # warm: a new process on the cache the cold one left
                    rows.setdefault((system, start), []).append(measure(system, steps, Path(cache), args.device))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("first_step_s", "steps_per_s")}
           for k, v in rows.items()}
    print(f"torch.compile, 1 process on {args.device}, {steps} steps, medians of {reps}\n")
    print("| system | start | first step (s) | steps/s | vs raw compiled |")
    print("|---|---|---|---|---|")
    for (system, start), m in med.items():
        print(f"| {system} | {start} | {m['first_step_s']:.2f} | {m['steps_per_s']:.1f} | "
              f"{m['steps_per_s'] / med[('raw', start)]['steps_per_s']:.2f}x |")
    for system in ("raw", "trainer"):
        cold, warm = med[(system, "cold")]["first_step_s"], med[(system, "warm")]["first_step_s"]
        print(f"\n{system}: first step cold {cold:.2f} s -> warm {warm:.2f} s ({cold / warm:.1f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
