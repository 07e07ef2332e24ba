"""The seed examples run unchanged (but for the import) under python and torchrun, within a timeout."""

from __future__ import annotations

import re
import time

import pytest
import torch
from helpers import ROOT, ci_leaves_out, python_exe, torchrun_exe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
# The seed script prints from every rank; unbuffered, two ranks' print() pieces interleave mid-line
# (../shared/docs/pitfalls.md #3). Block-buffered, each worker writes its short output in one piece at exit.
BLOCK_BUFFERED = {"PYTHONUNBUFFERED": ""}


def test_seed_000_under_python_spawns_four_processes(run_py):
    start = time.monotonic()
    out = run_py([python_exe(), "examples/accelerator_loop.py"], timeout=240, env=BLOCK_BUFFERED).stdout
    print(f"seed 000 under python (4 procs): {time.monotonic() - start:.1f}s")
    assert out.count("Epoch:  9") == 4  # every rank finished all 10 epochs (lines may interleave)
    for rank in range(4):
        assert f"Rank:  {rank}" in out
    assert "DistributedDataParallel" in out


def test_seed_000_under_torchrun_joins_its_workers(run_py, tmp_path):
    start = time.monotonic()
    # --tee: torchrun's agent copies each worker's output line by line, so ranks never interleave mid-line
    out = run_py([torchrun_exe(), "--standalone", "--nproc_per_node", "2", "--log-dir", str(tmp_path), "--tee", "3",
                  "examples/accelerator_loop.py"], timeout=240).stdout
    print(f"seed 000 under torchrun (2 procs): {time.monotonic() - start:.1f}s")
    assert out.count("Epoch:  9") == 2
    assert "nprocs=4 ignored: torchrun started 2 processes" in out


def test_demo_prints_per_epoch_loss(run_py):
    out = run_py([python_exe(), "examples/demo.py", "--nprocs", "2", "--epochs", "3"], timeout=240).stdout
    assert "training on 2 process(es)" in out and "epoch   3/3" in out and "from rank 0" in out


def test_seed_001_train_py_on_two_cpu_processes(run_py, tmp_path):
    start = time.monotonic()
    out = run_py([python_exe(), str(ROOT / "examples/train.py"), "--nprocs", "2", "--backend", "gloo",
                  "--compute_setup", "cpu"], cwd=tmp_path, timeout=240).stdout
    print(f"seed 001 nprocs=2: {time.monotonic() - start:.1f}s")
    printed = re.findall(r"^epoch (\d+)/50 \| step \d+ \| train_loss ", out, re.MULTILINE)
    assert printed == [str(e) for e in range(5, 51, 5)], out[-3000:]  # print_every=5, max_iter=50, rank 0 only
    assert list((tmp_path / "qml_logs").glob("*/checkpoints/ckpt-e00050-*.pt"))


def test_seed_001_default_nccl_on_cpu_fails_fast_with_the_fix(run_py, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only message")
    proc = run_py([python_exe(), str(ROOT / "examples/train.py"), "--nprocs", "1"], cwd=tmp_path, timeout=60,
                  check=False)
    assert proc.returncode != 0
    assert "backend='nccl' needs CUDA GPUs" in proc.stdout and "--backend gloo --compute_setup cpu" in proc.stdout


def test_classification_example(run_py, tmp_path):
    out = run_py([python_exe(), str(ROOT / "examples/classification.py"), "--nprocs", "2", "--epochs", "1",
                  "--samples", "256"], cwd=tmp_path, timeout=240).stdout
    assert "val_accuracy" in out and "test: {'test_loss'" in out


def test_the_lightning_port_trains_keeps_the_two_best_and_predicts_from_the_best(run_py, tmp_path):
    out = run_py([python_exe(), str(ROOT / "examples/lightning_port.py"), "--max_steps", "40",
                  "--val_every_n_steps", "10", "--log_folder", str(tmp_path / "run"), "--lr", "3e-3"], cwd=tmp_path,
                 timeout=240).stdout
    assert re.search(r"^epoch [\d.]+ \| step 10/40 \| loss ", out, re.MULTILINE), out[-3000:]  # live lines
    assert out.count("test accuracy") == 1  # printed once, by rank 0
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("best-val_acc-*"))
    assert len(kept) == 2 and (tmp_path / "run" / "checkpoints" / "last.pt").exists(), kept
    assert (tmp_path / "run" / "config.yaml").exists() or (tmp_path / "run" / "config.json").exists()
    accuracy = float(re.search(r"test accuracy ([0-9.]+) on 200 samples", out).group(1))
    assert accuracy > 0.5, out[-3000:]  # 4 classes: chance is 0.25


@ci_leaves_out("each example trains in its own test here")
def test_the_commands_in_the_examples_docstrings_are_accepted_as_written(run_py, tmp_path):
    """Every `trainstack submit` line of an example's docstring is a valid command (rendered with --dry-run), and
    every `python examples/...` line's options parse (--help of the script itself, which lists them)."""
    import shlex

    for example in sorted((ROOT / "examples").glob("*.py")):
        doc = example.read_text().split('"""')[1]
        lines = [line.strip() for line in doc.replace("\\\n", " ").splitlines()]
        for line in (x for x in lines if x.startswith(("trainstack submit", "python examples/"))):
            words = shlex.split(line.split("  #")[0])
            if words[:2] == ["trainstack", "submit"]:
                run_py([python_exe(), "-m", "trainstack", "submit", "--dry-run", *words[2:]], cwd=ROOT, timeout=60)
            elif words[:1] == ["python"] and words[1:2] and words[1].startswith("examples/"):
                out = run_py([python_exe(), *words[1:], "--help"], cwd=ROOT, timeout=120).stdout
                for option in (w for w in words[2:] if w.startswith("--")):
                    assert f"{option.replace('-', '_').replace('__', '--', 1)} " in out or option in out, \
                        (example.name, option, out[-2000:])
