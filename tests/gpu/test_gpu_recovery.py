"""Recovery on a GPU: memory checkpoints (CUDA tensors staged into pinned buffers) and sharded durable checkpoints
(DCP over NCCL, written in the background) resume a torchrun restart bitwise, under DDP and FSDP2, one process."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import torchrun_exe

pytestmark = [pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).parents[1] / "distributed" / "_memory_train.py")


def _torchrun(run_py, out: Path, restarts: int = 0, **env: object):
    return run_py([torchrun_exe(), "--standalone", "--nproc_per_node", "1", "--max-restarts", str(restarts),
                   "--monitor-interval", "0.2", SCRIPT, str(out)], timeout=240,
                  env={"TRAINSTACK_MEMORY_DIR": str(out.parent / "shm"), "CRASH_RANK": "0", "MEM": "2",
                       "DURABLE": "5", "CHECKPOINT_FORMAT": "sharded", "ASYNC": "1", "STEPS": "20",
                       **{k: str(v) for k, v in env.items()}})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_memory_then_durable_restores_on_cuda_bitwise(run_py, tmp_path, strategy):
    """Step 7: the process dies -> resumed from its memory checkpoint of step 6 (CUDA RNG, optimizer state on the
    GPU); step 12: the memory is lost too -> resumed from the sharded durable checkpoint of step 10; the final
    weights equal an uninterrupted run's bit for bit."""
    reference = tmp_path / "ref" / "out"
    _torchrun(run_py, reference, STRATEGY=strategy)
    out = tmp_path / "cut" / "out"
    proc = _torchrun(run_py, out, restarts=2, STRATEGY=strategy, FAULTS="7:exit,12:both")
    assert re.findall(r"Resumed from memory at step (\d+)", proc.stdout) == ["6"], proc.stdout[-3000:]
    assert "resuming from the durable checkpoint" in proc.stdout, proc.stdout[-3000:]
    mine, ref = torch.load(out / "final-rank0.pt"), torch.load(reference / "final-rank0.pt")
    assert next(iter(ref.values())).device.type == "cuda"  # trained on the GPU
    different = [k for k in ref if not torch.equal(mine[k], ref[k])]
    assert not different, f"{different} differ from the uninterrupted run"


def test_an_nccl_group_is_aborted_and_formed_again_in_the_same_process(run_py, tmp_path):
    """Issue 68, NCCL in place on one GPU: a process joins an NCCL group, reduces, aborts its communicators
    (``abort_groups``: what a survivor does after losing a peer) and joins a new group on another port in the same
    process -- its CUDA context kept -- and reduces again. (Aborting beside a really lost peer needs a machine with
    several GPUs: a multi-GPU test waits for one.)"""
    script = tmp_path / "abort.py"
    script.write_text(
        "import os, time, torch, torch.distributed as dist\n"
        "from trainstack._runtime.pgsession import abort_groups, can_abort\n"
        "assert can_abort('nccl')\n"
        "torch.cuda.set_device(0)\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29731')\n"
        "dist.init_process_group('nccl', rank=0, world_size=1, device_id=torch.device('cuda', 0))\n"
        "t = torch.ones(4, device='cuda'); dist.all_reduce(t); torch.cuda.synchronize()\n"
        "start = time.perf_counter(); how = abort_groups(); aborted = time.perf_counter() - start\n"
        "assert not dist.is_initialized()\n"
        "os.environ['MASTER_PORT'] = '29732'\n"
        "start = time.perf_counter()\n"
        "dist.init_process_group('nccl', rank=0, world_size=1, device_id=torch.device('cuda', 0))\n"
        "dist.all_reduce(t); torch.cuda.synchronize(); formed = time.perf_counter() - start\n"
        "print(f'aborted in {aborted:.3f} s ({how}); formed again and reduced in {formed:.3f} s; {t.tolist()}')\n"
        "dist.destroy_process_group()\n")
    proc = run_py([sys.executable, str(script)], timeout=120)
    assert "formed again and reduced" in proc.stdout and "[1.0, 1.0, 1.0, 1.0]" in proc.stdout, proc.stdout
    print(proc.stdout.strip())
