"""The torch side of the pre-flight node check: the compute rate is a node's capacity (a paused moment does not
make a node slow), and two real processes (a gloo ring over loopback) write each node's figures and the links."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

RATE = "from trainstack.node_check import compute_rate; import torch, sys; print('ready', flush=True); " \
       "print(compute_rate(torch.device('cpu'), seconds=1.0), flush=True)"


def rate(pause: float) -> float:
    """The compute rate of a fresh process (one thread), stopped for ``pause`` seconds while it measures."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", RATE], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        if pause:
            time.sleep(0.3)  # inside the 1 s it measures
            proc.send_signal(signal.SIGSTOP)
            time.sleep(pause)
            proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
        return float(out.split()[-1])
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_moment_stopped_does_not_make_a_node_slow():
    """Stopped for as long as it measures: a rate over the whole time would halve; the best window does not."""
    steady = max(rate(0.0) for _ in range(2))
    paused = rate(1.0)
    assert paused >= 0.7 * steady, (paused, steady)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_two_nodes_write_their_figures_and_links(tmp_path: Path):
    out, port = tmp_path / "node-check", _free_port()
    procs = []
    for rank, host in enumerate(("hosta", "hostb")):
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1",
               "SLURMD_NODENAME": host, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "trainstack.node_check", "--out", str(out), "--port",
                                       str(port), "--budget", "30"], env=env))
    try:
        assert [p.wait(timeout=90) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    for host in ("hosta", "hostb"):
        fig = json.loads((out / f"{host}.json").read_text())
        assert fig["host"] == host and fig["gflops"][0] > 0 and fig["gpus_visible"] == 0, fig
        assert fig["mem_available_gb"] > 0 and fig["write_mbps"] > 0, fig
    links = json.loads((out / "links.json").read_text())
    assert links["ring_gbps"] > 0 and [p["hosts"] for p in links["pairs"]] == [["hosta", "hostb"]], links
    assert all(p["seconds"] > 0 for p in links["pairs"]), links
    assert not list(tmp_path.glob("**/.write-test-*")), "the write-speed file is removed"
