"""The benchmarks run end to end in smoke mode, so they cannot rot (numbers are not asserted: not a timed test).
Marked `bench`: `make bench-smoke` runs them (CI does), `make test` does not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import ROOT, ci_leaves_out

pytestmark = [pytest.mark.bench, pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_smoke(run_py, tmp_path):
    # 2 processes: every system's distributed path (one process is the unit tests' everyday case)
    # (the raw loop and the Trainer: the harness's two ends; make bench runs every system)
    out = run_py([sys.executable, str(ROOT / "bench/run.py"), "--smoke", "--workloads", "tiny,classify",
                  "--nprocs", "2", "--systems", "raw,trainer", "--out", str(tmp_path)],
                 timeout=560).stdout
    assert "| tiny | 2 | trainer |" in out and "| classify | 2 | raw |" in out and "fast path" in out
    rows = [json.loads(line) for line in next(Path(tmp_path).glob("*.jsonl")).read_text().splitlines()]
    measured = [r for r in rows if "system" in r]
    assert len(measured) == 2 * 2 and all(r["steps_per_s"] > 0 and r["peak_rss_mb"] > 0 for r in measured)
    assert all("calls_per_step" in r for r in measured if r["workload"] == "tiny")


def test_gpu_bench_code_paths_on_the_cpu(run_py):
    """bench/gpu.py's systems and table, run on the CPU (`--device cpu --smoke`); the GPU numbers need a GPU."""
    out = run_py([sys.executable, str(ROOT / "bench/gpu.py"), "--device", "cpu", "--smoke", "--systems",
                  "raw,accelerator,trainer"], timeout=300).stdout
    for workload in ("mlp", "gpt"):
        for system in ("raw", "accelerator", "trainer"):
            assert f"| {workload} | {system} |" in out, out


def test_fsdp_bench_runs(run_py):
    out = run_py([sys.executable, str(ROOT / "bench/fsdp.py"), "--smoke"], timeout=300).stdout
    for strategy in ("ddp", "fsdp", "hsdp", "hsdp+ac"):
        assert f"| {strategy} |" in out, out
    assert "| 0.25 |" in out and "| 0.50 |" in out  # a quarter of the state per rank on 4 processes, half in HSDP 2x2


@ci_leaves_out("the benches' shared harness: test_bench_smoke")
def test_startup_and_restart_benches_run(run_py):
    """bench/startup.py, bench/time_to_result.py and bench/restart.py (make bench) stay runnable; their numbers come
    from make bench."""
    out = run_py([sys.executable, str(ROOT / "bench/startup.py"), "--nprocs", "2", "--reps", "1", "--steps", "12",
                  "--systems", "raw,trainer,trainer-spawn"], timeout=300).stdout
    assert "| 2 | trainer | " in out and "| 2 | raw | " in out and "(1.00x)" in out and "N=2 trainer: start-up" in out
    out = run_py([sys.executable, str(ROOT / "bench/time_to_result.py"), "--nprocs", "2", "--reps", "1", "--steps",
                  "5"], timeout=300).stdout
    assert "| 2 | trainer | " in out and "N=2 trainer: start-up" in out, out
    out = run_py([sys.executable, str(ROOT / "bench/restart.py"), "--reps", "1"], timeout=400).stdout
    rows = dict(line.strip("|").split("|")[:2] for line in out.splitlines()[2:] if line.startswith("| "))
    assert {"imports ", "checkpoint load ", "total "} <= {k.strip() + " " for k in rows}
    # the requeued run resumed mid-epoch after the stop at step 600; the restarted one from the checkpoint at 400
    assert "| resumed at step | 601.00 | 401.00 |" in out, out


@ci_leaves_out("a compiled run: tests/distributed/test_compile.py")
def test_compile_bench_runs(run_py):
    """bench/compile.py (make bench-compile): raw compiled loop vs Trainer(compile=True), cold vs warm first step."""
    out = run_py([sys.executable, str(ROOT / "bench/compile.py"), "--smoke"], timeout=500).stdout
    assert "| trainer | warm |" in out and "| raw | cold |" in out and "first step cold" in out, out


def test_checkpoint_store_bench_runs(run_py):
    """bench/checkpoint_store.py (make bench-store): local vs s3:// save and restore against a local S3 server."""
    pytest.importorskip("s3fs")
    out = run_py([sys.executable, str(ROOT / "bench/checkpoint_store.py"), "--width", "256", "--layers", "2",
                  "--reps", "1"], timeout=300).stdout
    assert "| file |" in out and "| sharded |" in out, out


def test_llm_bench_dry_run(run_py):
    """bench/llm.py (make bench-llm): the Llama-shaped decoder, the raw loop and Trainer.fit, the table and the MFU
    formula's columns, on the CPU at the tiny size (the GPU rows need a GPU: scripts/gpu-check.sh)."""
    out = run_py([sys.executable, str(ROOT / "bench/llm.py"), "--device", "cpu", "--size", "tiny", "--compile",
                  "off"], timeout=300).stdout
    assert "| tiny | off | no | raw |" in out and "| tiny | off | no | trainer |" in out, out  # fp32: the CPU default
    assert "MFU (formula)" in out and "torchtitan" in out, out


def test_llm_bench_says_what_does_not_fit_and_checkpoints_each_compiled_block():
    """The full 8B row: on an 80 GB GPU it is left out with the arithmetic (16 bytes a parameter); where it runs,
    each block's activations are recomputed in the backward and each block is compiled on its own -- the same
    path on the CPU at the tiny size."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import llm

    why = llm.fits(llm.SIZES["8b"], 80 * 10**9)
    assert why == ("8.03 B parameters need 124 GiB (16 bytes each for fp32 weights, gradients and AdamW moments, "
                   "4 GiB besides); this GPU has 75 GiB"), why
    assert llm.fits(llm.SIZES["8b"], 141 * 2**30) is None
    spec = dict(llm.SIZES["tiny"], activation_checkpointing=True)
    model, calls = llm.build(spec), []
    forward = model.blocks[0].forward
    model.blocks[0].forward = lambda *a: calls.append(torch.is_grad_enabled()) or forward(*a)
    llm._raw(model, llm.data(spec, 2), spec, "cpu", 2, False, "no", resident=False)
    assert len(calls) == 4, calls  # two steps: each block's forward, then again in the backward
    model = llm.build(spec)
    llm._raw(model, llm.data(spec, 2), spec, "cpu", 2, True, "no", resident=False)
    assert {type(b).__name__ for b in model.blocks} == {"OptimizedModule"}
