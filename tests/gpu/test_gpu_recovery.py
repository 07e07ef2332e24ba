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


def _peer_worker(rank: int, port: int, out: dict, device: str = "cuda") -> None:
    """Two processes on the one GPU over gloo (NCCL refuses two ranks on one device): rank 0 trained three steps
    on ``device`` and holds its mark; rank 1 is a replacement with other weights and no optimizer state."""
    import os
    import time

    import torch.distributed as dist

    from trainstack._train.peers import Held, Mark, agree

    if device == "cuda":
        torch.cuda.set_device(0)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        held = None
        if rank == 0:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(32, 256, device=device)).square().mean().backward()
                opt.step()
            held = Held(Mark(3, {"global_step": 3, "epoch": 0}, None, 2), moved=False)
        started = time.perf_counter()
        restored, why = agree(held, {"model": model, "optimizer": opt}, rank, 2)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        assert restored is not None, why
        moments = [s["exp_avg"] for s in opt.state.values()]
        out[rank] = {"source": restored.source, "seconds": seconds,
                     "devices": sorted({t.device.type for t in [*model.parameters(), *moments]}),
                     "params": [p.detach().cpu() for p in model.parameters()],
                     "moments": [m.cpu() for m in moments]}
    finally:
        dist.destroy_process_group()


def peer_transfer(device: str) -> dict:
    """What each of the two ranks holds after the survivor's live state moved to the replacement."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_peer_worker, args=(port, out, device), nprocs=2, join=True)
        return dict(out)


def test_a_replacement_takes_a_survivors_live_cuda_state_bitwise():
    """Zero rollback on CUDA: the replacement takes the survivor's weights and AdamW moments (CUDA tensors, sent
    point to point) and holds them on its GPU, equal bit for bit; the survivor keeps its own."""
    got = peer_transfer("cuda")
    assert got[0]["source"] == "its own live state at step 3 (no step redone)", got[0]["source"]
    assert got[1]["source"] == "rank 0's live state at step 3 (no step redone)", got[1]["source"]
    assert got[1]["devices"] == ["cuda"], got[1]["devices"]
    for key in ("params", "moments"):
        assert len(got[1][key]) == len(got[0][key]) > 0
        assert all(torch.equal(a, b) for a, b in zip(got[0][key], got[1][key], strict=True)), key
    print(f"live CUDA state moved to rank 1 in {got[1]['seconds']:.3f} s")


STANDBY_PROGRAM = """\
import os, time
import torch
x = torch.randn(1024, 1024, device=os.environ.get("DEVICE", "cuda"))
(x @ x).sum().item()
print(f"rank {os.environ['TRAINSTACK_TASK_RANKS']}: first result at {time.time()!r}", flush=True)
"""


def _first_result(said: str, since: float) -> float:
    """Seconds from ``since`` to the program's first result, read from what it printed."""
    import re

    found = re.findall(r"first result at ([0-9.]+)", said)
    assert found, said
    return float(found[-1]) - since


def standby_then_cold(tmp_path, device: str) -> tuple[float, float]:
    """(order -> first result through a warm standby, start -> first result of a cold ``python``) on ``device``;
    a waiting standby on a GPU holds no CUDA context (not among nvidia-smi's compute processes)."""
    import os
    import subprocess
    import time

    from trainstack._common.jobfiles import JobFiles

    files = JobFiles.mine(tmp_path / "job")
    files.make_own()
    program = tmp_path / "rank.py"
    program.write_text(STANDBY_PROGRAM)
    env = {**os.environ, "TRAINSTACK_JOB_DIR": str(files.folder), "TRAINSTACK_RANK_LOG": str(tmp_path / "rank.out"),
           "PYTHONUNBUFFERED": "1", "DEVICE": device}
    name = "trainstack-standby-gpu-1"
    standby = subprocess.Popen([sys.executable, "-m", "trainstack._runtime.standby", name, "--", str(program)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while name not in files.standby.ready_ones() and time.monotonic() < deadline:
            assert standby.poll() is None, standby.communicate()[0]
            time.sleep(0.05)
        assert name in files.standby.ready_ones(), "the standby never said it was ready"
        if device == "cuda":
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30).stdout.split()
            assert str(standby.pid) not in apps, f"the waiting standby holds a CUDA context: {apps}"
        ordered = time.time()
        files.standby.order(name, 2, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29733", "TRAINSTACK_STEP": "2",
                                      "TRAINSTACK_NPROCS": "1", "TRAINSTACK_ATTEMPT": "0"}, 0, 1)
        said, _ = standby.communicate(timeout=120)
    finally:
        if standby.poll() is None:
            standby.kill()
            standby.wait(timeout=30)
    assert standby.returncode == 0 and "rank 1/0: first result" in said, said
    started = time.time()
    cold = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=120,
                          env={**env, "TRAINSTACK_TASK_RANKS": "1/0"})
    assert cold.returncode == 0, cold.stderr
    return _first_result(said, ordered), _first_result(cold.stdout, started)


def test_a_standby_touches_no_gpu_while_waiting_and_computes_on_it_once_ordered(tmp_path):
    """A warm standby has imported torch and trainstack but holds no CUDA context while it waits; ordered to be a
    rank it creates the context and computes at once: order -> first CUDA result, beside a cold ``python`` start
    doing the same."""
    warm, cold = standby_then_cold(tmp_path, "cuda")
    print(f"first CUDA result: {warm:.2f} s after the order through a standby, {cold:.2f} s for a cold python")
    assert warm < cold, (warm, cold)
