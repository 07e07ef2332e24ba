"""GPU benchmark (`make bench-gpu`): one GPU, the same model and data on a raw PyTorch loop, the trainstack
Accelerator loop, `Trainer.fit` (defaults on), HF Accelerate and Lightning Fabric (when installed).

    python bench/gpu.py                       # mlp (overhead-bound) and gpt (bf16 transformer), 3 repetitions
    python bench/gpu.py --device cpu --smoke  # the same code paths on the CPU, a few steps (tests the bench)

Every measurement is a fresh process; systems are interleaved per repetition and the table shows medians and
ratios to the raw loop of the same run. Per system: steps/s (synchronised wall time over a window after warm-up),
host synchronisations per step (torch's sync debug mode, counted in a separate window), peak GPU memory, and
start-up (process start to the first step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = {
    # overhead-bound: a small MLP, the per-step work of the framework shows
    "mlp": {"kind": "mlp", "dims": (256, 1024, 1024, 10), "batch": 256, "precision": "no"},
    # a small GPT block stack in bf16: compute-bound, the framework must stay out of the way
    "gpt": {"kind": "gpt", "layers": 6, "d": 768, "heads": 12, "seq": 512, "vocab": 8192, "batch": 8,
            "precision": "bf16"},
}
# bf16 vs fp8 (mixed_precision="fp8": torchao's float8 Linear layers): matrices large enough for fp8 to matter
WORKLOADS["gpt2k"] = {"kind": "gpt", "layers": 4, "d": 2048, "heads": 16, "seq": 1024, "vocab": 8192, "batch": 8,
                      "precision": "bf16"}
WORKLOADS["gpt2k-fp8"] = WORKLOADS["gpt2k"] | {"precision": "fp8"}
SMOKE = {"mlp": {"dims": (16, 32, 32, 10), "batch": 8}, "gpt": {"layers": 1, "d": 32, "heads": 2, "seq": 16,
                                                                "vocab": 64, "batch": 2}}
SMOKE["gpt2k"] = SMOKE["gpt2k-fp8"] = SMOKE["gpt"]
#: The systems that can train in fp8 (a raw loop converts with torchao itself; the Trainer with mixed_precision).
FP8_SYSTEMS = ("raw", "trainer")
SYSTEMS = ("raw", "accelerator", "trainer", "accelerate", "fabric")
PEERS = {"accelerate": "accelerate", "fabric": "lightning"}


# ------------------------------------------------------------------------------------------------ worker side
def _spec(name: str, smoke: bool) -> dict:
    return WORKLOADS[name] | (SMOKE[name] if smoke else {})


def _model(spec: dict):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if spec["kind"] == "mlp":
        dims = spec["dims"]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False)):
            layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(dims) - 2 else [])
        return nn.Sequential(*layers)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(spec["vocab"], spec["d"])
            self.pos = nn.Parameter(torch.zeros(spec["seq"], spec["d"]))
            layer = nn.TransformerEncoderLayer(spec["d"], spec["heads"], 4 * spec["d"], dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, spec["layers"], enable_nested_tensor=False)
            self.head = nn.Linear(spec["d"], spec["vocab"])
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(spec["seq"]),
                                 persistent=False)

        def forward(self, tokens):
            h = self.embed(tokens) + self.pos
            return self.head(self.blocks(h, mask=self.mask, is_causal=True))

    return GPT()


def _data(spec: dict, steps: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    n = (steps + 2) * spec["batch"]
    if spec["kind"] == "mlp":
        return TensorDataset(torch.randn(n, spec["dims"][0], generator=g),
                             torch.randint(0, spec["dims"][-1], (n,), generator=g))
    tokens = torch.randint(0, spec["vocab"], (n, spec["seq"] + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _loss(model, batch):
    from torch import nn

    x, y = batch
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class Probe:
    """Forward pre-hook, identical in every system: the first step's time, a synchronised timing window, and a
    separate window in which torch counts host synchronisations."""

    def __init__(self, device: str, warmup: int, window: int, count: tuple[int, int]) -> None:
        self.device, self.warmup, self.window, self.count = device, warmup, window, count
        self.calls, self.first, self.t0, self.t1 = 0, None, None, None
        self.caught: list = []
        self._record = None

    def _sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, module, args) -> None:
        import torch

        self.calls += 1
        if self.first is None:
            self.first = time.time()
        if self.device == "cuda" and self.calls == self.count[0]:
            self._record = warnings.catch_warnings(record=True)
            self.caught = self._record.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        if self.device == "cuda" and self.calls == self.count[1]:
            torch.cuda.set_sync_debug_mode(0)
            self._record.__exit__(None, None, None)
        if self.calls == self.warmup:
            self._sync()
            self.t0 = time.perf_counter()
        if self.calls == self.warmup + self.window:
            self._sync()
            self.t1 = time.perf_counter()

    def report(self, start: float) -> dict:
        import torch

        # one warning per sync ("called a synchronizing CUDA operation"), not the notice that turning the mode on prints
        syncs = sum("called a synchronizing" in str(w.message) for w in self.caught)
        return {"steps_per_s": self.window / (self.t1 - self.t0) if self.t1 else float("nan"),
                "syncs_per_step": syncs / (self.count[1] - self.count[0]) if self.device == "cuda" else None,
                "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if self.device == "cuda" else None,
                "startup_s": self.first - start, "steps": self.calls}


def _run_raw(model, data, spec, device, steps, probe):
    import torch
    from torch.utils.data import DataLoader

    model = model.to(device)
    if spec["precision"] == "fp8":  # what mixed_precision="fp8" does: float8 Linear layers, bf16 autocast around
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear)
                                   and m.in_features % 16 == 0 and m.out_features % 16 == 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(data, batch_size=spec["batch"], shuffle=True, pin_memory=device == "cuda")
    amp = spec["precision"] in ("bf16", "fp8")
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = _loss(model, (x, y))
        loss.backward()
        opt.step()


def _run_accelerator(model, data, spec, device, steps, probe):
    import torch
    from torch.utils.data import DataLoader

    from trainstack import Accelerator

    acc = Accelerator(compute_setup="gpu" if device == "cuda" else "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=spec["batch"], shuffle=True))
    amp = spec["precision"] == "bf16"
    for i, batch in enumerate(loader):
        if i == steps:
            break
        batch = acc.prepare_batch(batch)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = _loss(model, batch)
        loss.backward()
        opt.step()


def _run_trainer(model, data, spec, device, steps, probe, out):
    import torch
    from torch.utils.data import DataLoader

    from trainstack import TrainConfig, Trainer

    os.environ["TRAINSTACK_PROGRESS"] = "1"  # the default experience on: bar, metrics line, jsonl, checkpoint
    cfg = TrainConfig(max_iter=1, print_every=1, compute_setup="gpu" if device == "cuda" else "cpu",
                      mixed_precision=spec["precision"], log_folder=Path(out) / "run", max_batches=steps)
    Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg, loss_fn=_loss).fit(
        DataLoader(data, batch_size=spec["batch"], shuffle=True))


def _run_accelerate(model, data, spec, device, steps, probe):
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    acc = Accelerator(mixed_precision="bf16" if spec["precision"] == "bf16" else "no", cpu=device == "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=spec["batch"], shuffle=True))
    for i, batch in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch)
        acc.backward(loss)
        opt.step()


def _run_fabric(model, data, spec, device, steps, probe):
    import torch
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    fabric = Fabric(accelerator="cuda" if device == "cuda" else "cpu", devices=1,
                    precision="bf16-mixed" if spec["precision"] == "bf16" else "32-true")
    fabric.launch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=spec["batch"], shuffle=True))
    for i, batch in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch)
        fabric.backward(loss)
        opt.step()


def hand_flops(spec: dict) -> float:
    """One training step's FLOPs by hand (3x the forward: the backward costs two forwards): 2 per multiply-add of
    every Linear, plus attention's two (seq x seq x d) products per layer, full (as torch's counter counts them)."""
    if spec["kind"] == "mlp":
        weights = sum(a * b for a, b in zip(spec["dims"], spec["dims"][1:], strict=False))
        return 3 * 2 * spec["batch"] * weights
    layers, d, seq = spec["layers"], spec["d"], spec["seq"]
    per_token = 2 * (12 * layers * d * d + d * spec["vocab"]) + 4 * layers * seq * d
    return 3 * spec["batch"] * seq * per_token


def mfu_by_hand(spec: dict, device: str, steps_per_s: float) -> float | None:
    """MFU by hand: ``hand_flops`` x the measured steps/s / the peak trainstack uses (None without a peak)."""
    import torch

    from trainstack._train.throughput import peak_flops

    # over the bf16 peak for fp8 too (the table's convention); a CPU has one only from TRAINSTACK_PEAK_TFLOPS
    peak, _ = peak_flops(torch.device(device), "bf16" if spec["precision"] == "fp8" else spec["precision"])
    return hand_flops(spec) * steps_per_s / peak if peak else None


def worker(system: str, workload: str, device: str, steps: int, out: str, smoke: bool, start: float) -> None:
    spec = _spec(workload, smoke)
    model, data = _model(spec), _data(spec, steps)
    warmup, window = (2, 3) if smoke else (30, steps - 40)
    probe = Probe(device, warmup, window, (5, 25) if not smoke else (2, 4))
    model.register_forward_pre_hook(probe)
    run = {"raw": _run_raw, "accelerator": _run_accelerator, "accelerate": _run_accelerate,
           "fabric": _run_fabric}.get(system)
    if run is None:
        _run_trainer(model, data, spec, device, steps, probe, out)
    else:
        run(model, data, spec, device, steps, probe)
    report = probe.report(start)
    report["mfu_hand"] = mfu_by_hand(spec, device, report["steps_per_s"])
    Path(out, "result.json").write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------ driver side
def measure(system: str, workload: str, device: str, steps: int, smoke: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="ts-gpu-bench-") as out:
        start = time.time()
        proc = subprocess.run([sys.executable, str(Path(__file__)), "--worker", system, workload, device, str(steps),
                               out, "1" if smoke else "0", repr(start)], capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"{system}/{workload} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        said = re.findall(r"mfu ([0-9.]+)%", proc.stdout)  # the Trainer's end summary: its MFU over the run
        return {"system": system, "workload": workload, **json.loads(Path(out, "result.json").read_text()),
                "mfu_reported": float(said[-1]) / 100 if said else None}


def table(rows: list[dict]) -> str:
    lines = ["| workload | system | steps/s | ratio vs raw | host syncs/step | peak GPU MB | startup s | MFU by hand |"
             " MFU reported |", "|---|---|---|---|---|---|---|---|---|"]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        med = {}
        for system in dict.fromkeys(r["system"] for r in group):
            runs = [r for r in group if r["system"] == system]
            med[system] = {k: statistics.median([r[k] for r in runs]) if runs[0][k] is not None else None
                           for k in ("steps_per_s", "syncs_per_step", "peak_mem_mb", "startup_s", "mfu_hand",
                                     "mfu_reported")}
        raw = med.get("raw")
        for system, m in med.items():
            ratio = f"{m['steps_per_s'] / raw['steps_per_s']:.3f}" if raw else "-"
            syncs = "-" if m["syncs_per_step"] is None else f"{m['syncs_per_step']:.2f}"
            mem = "-" if m["peak_mem_mb"] is None else f"{m['peak_mem_mb']:.0f}"
            hand, said = (("-" if m[k] is None else f"{100 * m[k]:.1f}%") for k in ("mfu_hand", "mfu_reported"))
            lines.append(f"| {workload} | {system} | {m['steps_per_s']:.1f} | {ratio} | {syncs} | {mem} | "
                         f"{m['startup_s']:.2f} | {hand} | {said} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        system, workload, device, steps, out, smoke, start = sys.argv[2:9]
        worker(system, workload, device, int(steps), out, smoke == "1", float(start))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="mlp,gpt")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    import importlib.util

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench-gpu: no CUDA device here; run it on a GPU machine (or --device cpu --smoke to test the bench)")
        return 1
    systems = [s for s in args.systems.split(",") if s not in PEERS or importlib.util.find_spec(PEERS[s])]
    reps, steps = (1, 8) if args.smoke else (args.reps, args.steps)
    rows = []
    for rep in range(reps):
        for workload in args.workloads.split(","):
            for system in [s for s in systems if s in FP8_SYSTEMS or "fp8" not in workload]:  # interleaved
                row = measure(system, workload, args.device, steps, args.smoke)
                rows.append(row | {"rep": rep})
                print(f"rep {rep} {workload} {system:11s} {row['steps_per_s']:9.1f} steps/s "
                      f"syncs/step {row['syncs_per_step']} startup {row['startup_s']:.2f}s", flush=True)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else "-"
    print(f"\n{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
