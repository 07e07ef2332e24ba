"""A Llama-shaped reference benchmark (`make bench-llm`): a Llama-3-style decoder (RMSNorm, RoPE, SwiGLU, grouped-
query attention through SDPA) written here in plain PyTorch, trained on synthetic token ids in bf16 with fused
AdamW, by a raw PyTorch loop and by `Trainer.fit`, eager or compiled, bf16 or fp8 -- each row's tokens/s, TFLOP/s
and MFU by the published formula, next to the MFU the Trainer reports.

    python bench/llm.py                                  # 1b and 8b-proxy, seq 2048, compile on, 3 repetitions
    python bench/llm.py --sizes 1b --compile off,on --precision bf16,fp8
    python bench/llm.py --sizes 8b --systems raw --steps 20   # the full 8B shape, seq 4096 (where it fits)
    python bench/llm.py --device cpu --size tiny         # the dry run CI runs (the same code paths, a few steps)
    python bench/llm.py --device cpu --size small        # CPU rows (fp32): the Trainer's overhead beside the raw loop

MFU by formula (PaLM, appendix B; torchtitan's ``num_flops_per_token``): per token 6 N + 12 L H Q T FLOPs, N the
parameters less the input embedding, L layers, H heads, Q head dimension, T the sequence length; over the device's
dense bf16 peak (trainstack's peak table, named in the output; fp8 rows too, so fp8 speed-ups show as MFU).

Systems, each a fresh process, interleaved per repetition, medians over repetitions:

* ``raw``: the loop anyone writes: batches from a DataLoader in pinned memory, copied with ``non_blocking=True``.
* ``raw-resident``: the same loop with every batch already on the GPU (no copy at all): the ceiling of an input path.
* ``trainer``: ``Trainer.fit`` with its defaults on (live line, metrics, the end summary's MFU).
* ``torchtitan``: named with its version where its package imports on this torch, else why not (it is not run
  through this model: its own Llama needs its own config and launcher -- see docs/how-to/gpus.md).

Per row: tokens/s, TFLOP/s, MFU by formula, MFU as the Trainer reports it, peak GPU memory, host synchronisations per
step (torch's sync debug mode), start-up (process start -> first step) and the first step's time (the compile).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SIZES = {
    # Llama 3.2 1B's widths with an untied head (16 layers, d 2048, 32 / 8 heads, FFN 8192)
    "1b": {"layers": 16, "d": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256, "seq": 2048,
           "batch": 4},
    # Llama 3 8B's widths (d 4096, FFN 14336, 32 / 8 heads) on 6 of its 32 layers: fits one 80 GB GPU with AdamW
    "8b-proxy": {"layers": 6, "d": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "seq": 2048,
                 "batch": 2},
    # Llama 3 8B's whole shape (8.03 B) at seq 4096 with full activation checkpointing and each block compiled on
    # its own: KempnerForge's single-H200 configuration (docs/how-to/gpus.md). fp32 weights, gradients and AdamW
    # moments alone are 16 bytes a parameter (128 GB): built on the GPU, run only where the device holds that
    "8b": {"layers": 32, "d": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "seq": 4096,
           "batch": 1, "activation_checkpointing": True, "on_device": True},
    # the CPU rows: compute-bound enough that a framework's per-step work shows as a ratio, quick enough to run
    "small": {"layers": 4, "d": 256, "heads": 8, "kv_heads": 2, "ffn": 768, "vocab": 2048, "seq": 256, "batch": 4},
    # the dry run: the same code paths, a few steps
    "tiny": {"layers": 2, "d": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256, "seq": 32, "batch": 2},
}
SYSTEMS = ("raw", "raw-resident", "trainer")


# ------------------------------------------------------------------------------------------------ the model
def build(spec: dict, device: str = "cpu"):
    """The decoder of ``spec`` on ``device``, seeded (every system trains the same weights)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    d, heads, kv = spec["d"], spec["heads"], spec["kv_heads"]
    head_dim = d // heads

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return F.rms_norm(x, (d,), self.weight, 1e-5)

    def rope(x, cos, sin):  # x: (batch, heads, seq, head_dim)
        a, b = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm, self.ffn_norm = RMSNorm(), RMSNorm()
            self.wq = nn.Linear(d, heads * head_dim, bias=False)
            self.wkv = nn.Linear(d, 2 * kv * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, d, bias=False)
            self.w13 = nn.Linear(d, 2 * spec["ffn"], bias=False)  # SwiGLU's gate and up projections, fused
            self.w2 = nn.Linear(spec["ffn"], d, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).view(b, t, heads, head_dim).transpose(1, 2)
            k, v = self.wkv(h).view(b, t, 2, kv, head_dim).permute(2, 0, 3, 1, 4)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(out.transpose(1, 2).reshape(b, t, d))
            gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
            return x + self.w2(F.silu(gate) * up)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(spec["vocab"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(spec["layers"]))
            self.norm = RMSNorm()
            self.head = nn.Linear(d, spec["vocab"], bias=False)
            freqs = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            angles = torch.outer(torch.arange(spec["seq"]).float(), freqs)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            cos, sin = self.cos[: tokens.shape[1]].to(x.dtype), self.sin[: tokens.shape[1]].to(x.dtype)
            for block in self.blocks:
                x = block(x, cos, sin)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    with torch.device(device):
        return Decoder()


def fits(spec: dict, total: int) -> str | None:
    """Why ``spec`` cannot train on a GPU of ``total`` bytes (fp32 weights, gradients and two AdamW moments: 16
    bytes a parameter, and 4 GiB besides for activations and workspaces), or None where it may."""
    params = sum(p.numel() for p in build(spec, "meta").parameters())
    need = 16 * params + 4 * 2**30
    if need <= total:
        return None
    return (f"{params / 1e9:.2f} B parameters need {need / 2**30:.0f} GiB (16 bytes each for fp32 weights, gradients "
            f"and AdamW moments, 4 GiB besides); this GPU has {total / 2**30:.0f} GiB")


def flops_per_token(spec: dict, params: int) -> float:
    """6 N + 12 L H Q T (N: parameters less the input embedding)."""
    n = params - spec["vocab"] * spec["d"]
    return 6 * n + 12 * spec["layers"] * spec["heads"] * (spec["d"] // spec["heads"]) * spec["seq"]


def data(spec: dict, steps: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec["vocab"], ((steps + 2) * spec["batch"], spec["seq"] + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def loss_fn(model, batch):
    from torch.nn import functional as F

    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# ------------------------------------------------------------------------------------------------ the systems
def _optimizer(model, device: str):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")


def _raw(model, dataset, spec, device, steps, compile_, precision, resident: bool) -> None:
    import torch
    from torch.utils.data import DataLoader

    model, checkpointed = model.to(device), spec.get("activation_checkpointing", False)
    if checkpointed:  # as torchtitan: each block checkpointed, then compiled on its own
        from torch.utils.checkpoint import checkpoint

        for block in model.blocks:
            block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    if precision == "fp8":  # what mixed_precision="fp8" does: float8 Linear layers (torchao), bf16 autocast
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "head")
    opt = _optimizer(model, device)
    if compile_ and checkpointed:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    step_model = torch.compile(model) if compile_ and not checkpointed else model
    loader = DataLoader(dataset, batch_size=spec["batch"], shuffle=True, pin_memory=device == "cuda")
    batches = [tuple(t.to(device) for t in b) for _, b in zip(range(steps), loader, strict=False)] if resident \
        else loader
    for i, (x, y) in enumerate(batches):
        if i == steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision != "no"):
            loss = loss_fn(step_model, (x, y))
        loss.backward()
        opt.step()


def _trainer(model, dataset, spec, device, steps, compile_, precision, out: str) -> None:
    from torch.utils.data import DataLoader

    from trainstack import TrainConfig, Trainer

    os.environ["TRAINSTACK_PROGRESS"] = "1"  # the default experience: live line, metrics rows, the end summary
    # no final checkpoint: the raw loop writes none, and a 1.5B model's weights and AdamW moments are 18 GB of disk
    # writes after the timed window
    cfg = TrainConfig(max_iter=1, max_batches=steps, compute_setup="gpu" if device == "cuda" else "cpu",
                      mixed_precision=precision, compile=compile_, log_folder=Path(out) / "run", print_every=10,
                      checkpoint_final=False, **({"activation_checkpointing": "full", "fsdp_blocks": ("Block",)}
                                                 if spec.get("activation_checkpointing") else {}))
    Trainer(model, _optimizer(model, device), cfg, loss_fn=loss_fn).fit(
        DataLoader(dataset, batch_size=spec["batch"], shuffle=True))


def worker(system: str, size: str, device: str, steps: int, compile_: bool, precision: str, out: str,
           start: float) -> None:
    import torch
    from gpu import Probe

    spec = SIZES[size]
    model, dataset = build(spec, device if spec.get("on_device") else "cpu"), data(spec, steps)
    params = sum(p.numel() for p in model.parameters())
    tiny = size == "tiny"
    warmup, window = (2, steps - 3) if tiny else (10, steps - 15)
    probe = Probe(device, warmup, window, (3, 5) if tiny else (6, 10))
    seconds: list[float] = []  # the first steps' wall times (the compile)
    model.register_forward_pre_hook(lambda m, a: seconds.append(time.perf_counter()) if len(seconds) < 2 else None)
    model.register_forward_pre_hook(probe)
    if system == "trainer":
        _trainer(model, dataset, spec, device, steps, compile_, precision, out)
    else:
        _raw(model, dataset, spec, device, steps, compile_, precision, resident=system == "raw-resident")
    report = probe.report(start)
    tokens_per_s = report["steps_per_s"] * spec["batch"] * spec["seq"]
    flops = flops_per_token(spec, params) * tokens_per_s
    from trainstack._train.throughput import peak_flops

    peak, peak_name = peak_flops(torch.device(device), precision)  # fp8 rows over the bf16 peak, as torchtitan
    report.update(params=params, tokens_per_s=tokens_per_s, tflops=flops / 1e12,
                  mfu_formula=flops / peak if peak else None, peak=peak_name,
                  first_step_s=seconds[1] - seconds[0] if len(seconds) == 2 else None)
    Path(out, "result.json").write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------ the driver
def measure(system: str, size: str, device: str, steps: int, compile_: bool, precision: str) -> dict:
    env = dict(os.environ)
    if SIZES[size].get("on_device"):  # a GPU filled to the brim: segments that grow rather than fragment
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with tempfile.TemporaryDirectory(prefix="ts-llm-bench-") as out:
        start = time.time()
        proc = subprocess.run([sys.executable, str(Path(__file__)), "--worker", system, size, device, str(steps),
                               "1" if compile_ else "0", precision, out, repr(start)], capture_output=True,
                              text=True, timeout=1800, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{system}/{size} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        said = re.findall(r"mfu ([0-9.]+)%", proc.stdout)  # the Trainer's end summary
        return {"system": system, "size": size, "compile": compile_, "precision": precision,
                **json.loads(Path(out, "result.json").read_text()),
                "mfu_reported": float(said[-1]) / 100 if said else None}


def torchtitan_status() -> str:
    """torchtitan's version where its package imports on this torch, else why not."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan: not installed (pip install torchtitan; its wheels follow torch's nightly/release pairs)"
    try:
        from importlib.metadata import version

        import torchtitan  # noqa: F401

        return (f"torchtitan {version('torchtitan')} imports on this torch (its row: its own trainer and Llama config, "
                "with its repository's tests/assets -- docs/how-to/gpus.md)")
    except Exception as exc:  # noqa: BLE001 -- any import failure is the finding
        return f"torchtitan does not import on this torch: {type(exc).__name__}: {str(exc)[:200]}"


def table(rows: list[dict]) -> str:
    head = ["| size | compile | precision | system | tokens/s | TFLOP/s | MFU (formula) | MFU (Trainer) | vs raw | "
            "vs resident | host syncs/step | peak GPU GB | start-up s | first step s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = ("tokens_per_s", "tflops", "mfu_formula", "mfu_reported", "syncs_per_step", "peak_mem_mb", "startup_s",
            "first_step_s")
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        groups.setdefault((r["size"], r["compile"], r["precision"]), {}).setdefault(r["system"], []).append(r)
    for (size, comp, prec), by_system in groups.items():
        medians = {s: {k: (statistics.median(v) if (v := [r[k] for r in runs if r[k] is not None]) else None)
                       for k in keys} for s, runs in by_system.items()}
        raw, resident = medians.get("raw"), medians.get("raw-resident")
        for system, m in medians.items():
            def pct(x):
                return "-" if x is None else f"{100 * x:.1f}%"

            def ratio(base, mine=m):
                return f"{mine['tokens_per_s'] / base['tokens_per_s']:.3f}" if base and base["tokens_per_s"] else "-"

            mem = "-" if m["peak_mem_mb"] is None else f"{m['peak_mem_mb'] / 1024:.1f}"
            syncs = "-" if m["syncs_per_step"] is None else f"{m['syncs_per_step']:.2f}"
            first = "-" if m["first_step_s"] is None else f"{m['first_step_s']:.2f}"
            head.append(f"| {size} | {'on' if comp else 'off'} | {prec} | {system} | {m['tokens_per_s']:,.0f} | "
                        f"{m['tflops']:.2f} | {pct(m['mfu_formula'])} | {pct(m['mfu_reported'])} | {ratio(raw)} | "
                        f"{ratio(resident)} | {syncs} | {mem} | {m['startup_s']:.1f} | {first} |")
    return "\n".join(head)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        system, size, device, steps, comp, precision, out, start = sys.argv[2:10]
        worker(system, size, device, int(steps), comp == "1", precision, out, float(start))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", "--size", default="1b,8b-proxy")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--compile", default="on", help="on, off or off,on")
    p.add_argument("--precision", help="bf16, fp8, no (fp32) or a list (bf16,fp8); default bf16 on CUDA, no on a CPU "
                   "(a CPU without bf16 units emulates it ~50x slower: the rows would time the emulation)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=75, help="per process: 10 warm-up steps, then the timed window")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json", metavar="FILE", help="also write every row as JSON lines")
    args = p.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench-llm: no CUDA device here; run it on a GPU machine (or --device cpu --size tiny to test it)")
        return 1
    if args.json:
        Path(args.json).write_text("")
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"--sizes {','.join(unknown)}: not one of {', '.join(SIZES)}")
    tiny = sizes == ["tiny"]
    reps, steps = (1, 8) if tiny else (args.reps, args.steps)
    compiles = [c == "on" for c in args.compile.split(",")]
    precisions = (args.precision or ("bf16" if args.device == "cuda" else "no")).split(",")
    if bad := [x for x in precisions if x not in ("no", "bf16", "fp8")]:
        p.error(f"--precision {','.join(bad)}: not one of no, bf16, fp8")
    if "fp8" in precisions and (args.device != "cuda" or importlib.util.find_spec("torchao") is None):
        print("bench-llm: fp8 rows need CUDA and torchao: left out")
        precisions = [x for x in precisions if x != "fp8"] or ["bf16"]
    systems = [s for s in args.systems.split(",") if s != "raw-resident" or args.device == "cuda"]
    rows, failed = [], []
    for size in list(sizes) if args.device == "cuda" else []:  # a row that cannot fit is said, not started to fail
        if why := fits(SIZES[size], torch.cuda.get_device_properties(0).total_memory):
            print(f"bench-llm: {size} does not fit: {why}", flush=True)
            sizes.remove(size)
    for rep in range(reps):
        for size in sizes:
            for comp in compiles:
                for precision in precisions:
                    for system in systems:  # interleaved: a slow drift of the machine touches every system alike
                        try:
                            row = measure(system, size, args.device, steps, comp, precision)
                        except RuntimeError as exc:  # one row's failure is said; the other rows still count
                            failed.append(str(exc).splitlines()[0])
                            print(f"FAILED: {exc}", flush=True)
                            continue
                        rows.append(row | {"rep": rep})
                        if args.json:  # row by row: a run stopped at its time limit keeps what it measured
                            with open(args.json, "a") as f:
                                f.write(json.dumps(row | {"rep": rep}) + "\n")
                        print(f"rep {rep} {size} compile={'on' if comp else 'off'} {precision} {system:12s} "
                              f"{row['tokens_per_s']:12,.0f} tokens/s  first step {row['first_step_s'] or 0:.1f} s",
                              flush=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else "-"
    peak = rows[0]["peak"] if rows else "-"
    print(f"\n{device}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; MFU over: {peak}; "
          f"a fresh process per row, medians of {reps}\n{torchtitan_status()}\n")
    print(table(rows))
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
