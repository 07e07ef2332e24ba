"""A required NCCL transport against the real NCCL (issue 53): one process, one GPU -- NCCL still chooses its network
at a communicator's init, so NCCL_NET=Socket must be what its init lines say, and NCCL_NET naming a network this
host lacks must fail at init with the reason, not fall back. Each case runs in its own process (NCCL reads its
variables once)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(180)]

PROGRAM = r"""
import os, sys, datetime, torch, torch.distributed as dist
from trainstack._common import transport as _transport
required = os.environ[_transport.REQUIRED_ENV]
try:
    _transport.check_before_init()
except _transport.TransportError as exc:
    print("PREFLIGHT", exc); sys.exit(3)
try:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"),
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(4, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize()
except Exception as exc:
    try:
        _transport.confirm_after_init(required, error=exc)
    except _transport.TransportError as why:
        print("REFUSED", why); sys.exit(4)
    raise
try:
    _transport.confirm_after_init(required)
except _transport.TransportError as why:
    print("REFUSED", why); sys.exit(4)
init = _transport.read_init_files(_transport.own_debug_files())
print("USED", sorted(init.networks), init.devices)
dist.destroy_process_group()
"""


def _run(tmp_path, transport: str, skip_preflight: bool = False) -> subprocess.CompletedProcess:
    from trainstack._common import transport as _transport

    env = {**os.environ, **_transport.step_env(transport, str(tmp_path / "nccl.%h.%p.log"))}
    program = PROGRAM.replace("_transport.check_before_init()", "pass") if skip_preflight else PROGRAM
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=150, env=env)


def test_socket_required_and_used(tmp_path):
    out = _run(tmp_path, "socket")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "USED ['Socket']" in out.stdout


def test_a_network_the_host_lacks_fails_at_init_with_the_reason(tmp_path):
    from trainstack._common import transport as _transport

    if not _transport.preflight("ib"):
        pytest.skip("this GPU host has working InfiniBand: nothing is missing")
    out = _run(tmp_path, "ib")
    assert out.returncode == 3 and "PREFLIGHT NCCL transport ib is required here" in out.stdout, out.stdout
    # without trainstack's pre-flight check NCCL itself refuses (NCCL_NET), and its lines give the reason
    out = _run(tmp_path, "ib", skip_preflight=True)
    assert out.returncode == 4, out.stdout + out.stderr[-2000:]
    assert "REFUSED NCCL transport ib was required" in out.stdout, out.stdout
    assert "NCCL has no such network" in out.stdout, out.stdout
    for log in tmp_path.glob("nccl.*.log"):  # NCCL's own lines, for the record (tests/data/nccl-init)
        print(log.read_text()[-3000:])
