"""Leaving a failed group in the process (issue 68): NCCL's communicators are aborted, not destroyed (a destroy may
wait on the lost peer); the capability is torch's, checked by name. Here on gloo with NCCL's branch chosen by the
session's backend name -- the GPU lane aborts a real NCCL group (tests/gpu/test_gpu_recovery.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch.distributed as dist

from trainstack._runtime import pgsession
from trainstack._runtime.pgsession import ProcessGroupSession, can_abort

pytestmark = pytest.mark.timeout(120)

_PEER_DIES = """
import os, sys, time, torch, torch.distributed as dist
from trainstack._runtime.pgsession import abort_groups
rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
t = torch.ones(2); dist.all_reduce(t)
if rank == 1:
    os._exit(9)  # the lost peer
try:
    dist.all_reduce(t)
except Exception as exc:
    print("collective failed:", type(exc).__name__)
start = time.perf_counter(); how = abort_groups()
os.environ["MASTER_PORT"] = str(int(port) + 1)
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(t)
print(f"aborted ({how}) and formed again in {time.perf_counter() - start:.2f} s:", t.tolist())
dist.destroy_process_group()
"""


def test_a_survivor_aborts_the_failed_group_and_forms_a_new_one_in_its_process(run_py, tmp_path):
    """Two processes, the second dies: the first's collective fails, it aborts every group of its process and
    joins a new one (another rendezvous) -- no hang, no new process."""
    script = tmp_path / "peer_dies.py"
    script.write_text(_PEER_DIES)
    port = "29811"
    import subprocess

    peer = subprocess.Popen([sys.executable, str(script), "1", port])
    try:
        proc = run_py([sys.executable, str(script), "0", port], timeout=90)
    finally:
        peer.kill()
        peer.wait()
    assert "collective failed" in proc.stdout and "formed again" in proc.stdout, proc.stdout
    assert "[2.0, 2.0]" in proc.stdout and "_abort_process_group" in proc.stdout, proc.stdout


def test_can_abort_follows_what_this_torch_has(monkeypatch):
    """gloo always; NCCL where torch can abort its communicators (``_abort_process_group``, else a group's
    ``abort``), else not in place (its ranks relaunch: in warm standbys)."""
    assert can_abort("gloo") and can_abort("nccl") and not can_abort("mpi")
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    assert can_abort("nccl")  # ProcessGroup.abort
    monkeypatch.delattr(dist.ProcessGroup, "abort")
    assert not can_abort("nccl") and can_abort("gloo")


def test_a_failed_nccl_session_is_left_by_abort_not_destroy(monkeypatch, capsys):
    """The session's backend says NCCL (faked over a one-process gloo group): a failed stop aborts (said in the
    rank's log) and the group is gone; a successful stop still destroys."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29821")
    destroyed: list[bool] = []
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: (destroyed.append(True), real_destroy(*a)))
    session = ProcessGroupSession(types.SimpleNamespace(rank=3, world_size=1), "nccl")  # type: ignore[arg-type]
    monkeypatch.setattr(pgsession._layout, "deactivate", lambda: None)
    dist.init_process_group("gloo", rank=0, world_size=1)
    session.stop(ok=False)
    assert not dist.is_initialized() and not destroyed
    assert "rank 3 left its failed NCCL group: communicators aborted (torch.distributed's _abort_process_group)" \
        in capsys.readouterr().err
    dist.init_process_group("gloo", rank=0, world_size=1)
    session.stop(ok=True, barrier=False)
    assert destroyed and not dist.is_initialized()
