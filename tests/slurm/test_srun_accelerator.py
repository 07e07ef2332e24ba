"""Accelerator under a real `srun` on the local 2-node Slurm: both Slurm process models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]
PROBE = Path(__file__).with_name("_probe.py")


def _srun(slurm_env, args, out_dir, nprocs):
    cmd = ["srun", "--job-name=trainstack-test", "--kill-on-bad-exit=1", "--time=3", *args,
           sys.executable, str(PROBE), str(out_dir), str(nprocs)]
    proc = subprocess.run(cmd, env=slurm_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]


def _check(records, world, nodes):
    assert sorted(r["rank"] for r in records) == list(range(world))
    assert all(r["world"] == world and r["sum"] == sum(range(world)) for r in records)
    assert {r["node"] for r in records} == nodes
    assert all(r["num_nodes"] == 2 for r in records)


def test_one_task_per_process(slurm_env, shared_tmp):
    """srun --nodes=2 --ntasks-per-node=2 python probe.py (nprocs=1): ranks from SLURM_PROCID."""
    records = _srun(slurm_env, ["--nodes=2", "--ntasks-per-node=2"], shared_tmp, 1)
    _check(records, 4, {"node1", "node2"})
    by_rank = {r["rank"]: r for r in records}
    assert [by_rank[i]["node"] for i in range(4)] == ["node1", "node1", "node2", "node2"]
    assert [by_rank[i]["local_rank"] for i in range(4)] == [0, 1, 0, 1]


def test_one_task_per_node_spawns_its_share(slurm_env, shared_tmp):
    """The seeds' recipe: --nodes=2 --ntasks=2 and nprocs=4, so each task spawns 2 processes."""
    records = _srun(slurm_env, ["--nodes=2", "--ntasks=2"], shared_tmp, 4)
    _check(records, 4, {"node1", "node2"})
    by_rank = {r["rank"]: r for r in records}
    assert [by_rank[i]["node_rank"] for i in range(4)] == [0, 0, 1, 1]
    assert len({r["pid"] for r in records}) == 4


def test_mismatch_fails_fast_with_a_clear_message(slurm_env, shared_tmp):
    cmd = ["srun", "--job-name=trainstack-test", "--nodes=2", "--ntasks=2", "--time=2",
           sys.executable, str(PROBE), str(shared_tmp), "3"]
    proc = subprocess.run(cmd, env=slurm_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "nprocs=3 is not a multiple of the 2 Slurm tasks" in proc.stderr + proc.stdout


def test_hsdp_replicates_across_the_nodes_and_shards_within_each(slurm_env, shared_tmp):
    """srun --nodes=2 --ntasks-per-node=2, strategy='hsdp' with the default layout: a copy per node (replicate
    groups span the nodes), the shards of a copy on one node."""
    cmd = ["srun", "--job-name=trainstack-test", "--kill-on-bad-exit=1", "--time=3", "--nodes=2",
           "--ntasks-per-node=2", sys.executable, str(PROBE.with_name("_hsdp_probe.py")), str(shared_tmp)]
    proc = subprocess.run(cmd, env=slurm_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    records = {r["rank"]: r for r in (json.loads(p.read_text()) for p in Path(shared_tmp).glob("rank*.json"))}
    node = {rank: r["node"] for rank, r in records.items()}
    assert records[0]["dims"] == ["dp_replicate", "dp_shard"]
    for rank, r in records.items():
        assert {node[other] for other in r["dp_shard"]} == {node[rank]}, r  # a copy's shards: one node
        assert {node[other] for other in r["dp_replicate"]} == {"node1", "node2"}, r  # its copies: both nodes
