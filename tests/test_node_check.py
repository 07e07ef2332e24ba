"""The pre-flight node check, both halves. The measurement (``trainstack/node_check.py``, on each node): the compute
rate is a node's capacity (a paused moment does not make a node slow), and two real processes (a gloo ring over
loopback) write each node's figures and the links. The judge (``trainstack/_slurm/nodecheck.py``, in the driver):
a slow node named with its ratio, a missing report, missing GPUs, ECC errors, the site's floors, a slow link (two
slow neighbour pairs), and figures that are not numbers named, never taken for healthy ones."""

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

from trainstack._slurm.nodecheck import THRESHOLDS, check_threshold, describe, judge

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


@pytest.mark.alone  # compares its own rates: another process's load would be the finding
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


# ---------------------------------------------------------------------------------------------- the judge
def node(gflops: float, **extra):
    return {"gflops": [gflops], "gpus_visible": extra.pop("gpus_visible", 0), "gpus": extra.pop("gpus", []),
            "mem_available_gb": 100.0, "shm_free_gb": 50.0, "write_mbps": 500.0, **extra}


def test_a_node_far_below_the_others_is_named_with_its_figure():
    named = judge({"a": node(40), "b": node(42), "c": node(12)}, None, 0, THRESHOLDS)
    assert list(named) == ["c"] and "12.0 GFLOP/s, 0.29x the median" in named["c"]
    assert judge({"a": node(40), "b": node(30)}, None, 0, THRESHOLDS) == {}  # 0.75x: within the ratio


def test_missing_reports_gpus_ecc_and_site_floors():
    named = judge({"a": None, "b": node(40, gpus_visible=3), "c": node(40, gpus_visible=4, gpus=[
        {"index": 1.0, "ecc.errors.uncorrected.volatile.total": 2.0}]), "d": node(40, gpus_visible=4)},
        None, 4, {**THRESHOLDS, "min_write_mbps": 600.0})
    assert "did not report" in named["a"] and "3 GPU(s) visible, 4 requested" in named["b"]
    assert "uncorrected ECC errors on GPU 1" in named["c"] and "job folder writes 500.0 MB/s" in named["d"]
    assert "below the site's min_gflops = 50" in judge({"a": node(40)}, None, 0, {**THRESHOLDS,
                                                                                     "min_gflops": 50.0})["a"]


def test_a_slow_link_is_bisected_to_the_node_in_two_slow_pairs():
    pairs = [{"hosts": ["a", "b"], "seconds": 0.01}, {"hosts": ["b", "c"], "seconds": 0.05},
             {"hosts": ["c", "d"], "seconds": 0.05}, {"hosts": ["d", "a"], "seconds": 0.01}]
    named = judge({h: node(40) for h in "abcd"}, {"pairs": pairs}, 0, THRESHOLDS)
    assert list(named) == ["c"] and "slow link" in named["c"]


def test_the_line_says_when_the_ring_did_not_complete():
    check = {"figures": {"a": node(40), "b": node(41)}, "link": None, "named": {}, "seconds": 30.1}
    assert "the ring did not complete within the budget" in describe(check)
    check["link"] = {"ring_gbps": 1.25}
    assert "ring 1.25 GB/s; all nodes fit" in describe(check)


def test_figures_that_are_not_numbers_name_their_node_and_never_crash_the_judge():
    """A NaN rate is a broken measurement, named (it was never named); strings, None, a list of None, a string GPU
    count or ring speed, a report that is not a record: named or skipped, never a TypeError (the driver would have
    read a crash as "all nodes fit")."""
    healthy = {"a": node(40), "b": node(41)}
    for bad in ([float("nan")], "12", [None], 39.5, [], [float("inf")]):
        named = judge({**healthy, "c": {**node(40), "gflops": bad}}, None, 0, THRESHOLDS)
        if bad == 39.5:  # a plain number is a rate, as a one-element list is
            assert "c" not in named
        else:
            assert "broken measurement" in named["c"], (bad, named)
    assert "GPU count is not a number" in judge({**healthy, "c": node(40, gpus_visible="2")}, None, 0,
                                                THRESHOLDS)["c"]
    assert "not a record of figures" in judge({**healthy, "c": [1, 2]}, None, 0, THRESHOLDS)["c"]
    check = {"figures": {**healthy, "c": {**node(40), "gflops": "x"}}, "link": {"ring_gbps": "x"}, "named": {},
             "seconds": 3.0}
    assert "GFLOP/s a 40.0, b 41.0" in describe(check)
    assert judge(healthy, {"pairs": [{"hosts": ["a"], "seconds": "slow"}, 5, None]}, 0, THRESHOLDS) == {}


@pytest.mark.parametrize("key, value, problem", [
    ("min_ratio", float("nan"), "finite"), ("min_ratio", float("inf"), "finite"), ("min_ratio", 50, "at most 1"),
    ("min_ratio", 0, "above 0"), ("min_ratio", "0.5", "must be a number"), ("min_free_gb", 1e400, "finite"),
    ("min_gflops", -1, ">= 0"), ("min_shm_gb", True, "must be a number"),
])
def test_thresholds_are_finite_and_ranged(key, value, problem):
    """NaN turned the check off, infinity or a ratio above 1 named every node: refused with the key named (the
    profile's error reads ``node_check_thresholds.<key> <why>``)."""
    assert problem in check_threshold(key, value)
    assert check_threshold("min_ratio", 0.7) is None and check_threshold("min_free_gb", 0) is None
