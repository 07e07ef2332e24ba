"""A warm standby's side (``trainstack._runtime.standby``): what it takes from the driver's order -- the step's
rendezvous and counters, its rank as srun's task or as torchrun's worker -- and nothing else; an order that is
not the driver's is passed over."""

from __future__ import annotations

import json
import os
import sys

import pytest

from trainstack._common.jobfiles import JobFiles
from trainstack._runtime import standby

NAME = "trainstack-standby-node1-7"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A job folder of this user's; the standby's environment as a job step gives it (its rank log already teed)."""
    files = JobFiles.mine(tmp_path / "job")
    files.make_own()
    monkeypatch.setenv("TRAINSTACK_JOB_DIR", str(files.folder))
    monkeypatch.setenv("TRAINSTACK_RANK_LOG", str(tmp_path / "standby.out"))
    monkeypatch.setenv("MASTER_PORT", "1")  # the standby's start: never the step's
    for key in ("TRAINSTACK_TASK_RANKS", "RANK", "WORLD_SIZE", "TRAINSTACK_PLANNED_WORLD"):
        monkeypatch.delenv(key, raising=False)
    saved = dict(os.environ)  # what become() sets is the standby's for good: a test's, only for the test
    yield files
    os.environ.clear()
    os.environ.update(saved)


def _order(files: JobFiles, rank: int = 3) -> None:
    files.standby.order(NAME, 2, {"MASTER_ADDR": "node1", "MASTER_PORT": "40001", "TRAINSTACK_STEP": "2",
                                  "TRAINSTACK_NPROCS": "4", "TRAINSTACK_ATTEMPT": "0"}, rank, 2)


def test_a_standby_becomes_the_ordered_rank_of_an_srun_step(folder, monkeypatch):
    _order(folder)
    order = standby.wait_for_order(folder, NAME)
    assert order is not None and order.ranks == (3,)
    assert standby.become(folder, NAME, order) == 3
    assert os.environ["MASTER_PORT"] == "40001" and os.environ["TRAINSTACK_TASK_RANKS"] == "2/3"
    assert "RANK" not in os.environ and folder.standby.has_taken(NAME)
    from trainstack.environment import detect_environment

    monkeypatch.setenv("SLURM_STEP_ID", "5")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    env = detect_environment()
    assert (env.name, env.rank, env.world_size, env.local_rank, env.node_rank) == ("slurm", 3, 4, 1, 1)


def test_a_torchrun_standby_takes_torchruns_worker_variables(folder, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's agent is not there: rank 0 hosts
    _order(folder, rank=2)
    order = standby.wait_for_order(folder, NAME)
    assert order is not None
    standby.become(folder, NAME, order, torchrun=True)
    assert {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == \
        {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ and "TRAINSTACK_TASK_RANKS" not in os.environ
    from trainstack.environment import detect_environment

    env = detect_environment()
    assert (env.name, env.rank, env.world_size, env.master_port) == ("torchrun", 2, 4, 40001)


def test_an_order_that_is_not_the_drivers_is_passed_over(folder, capsys):
    """Only OFFERED names with values of their type, exactly one rank, in a file of the job's owner."""
    path = folder.folder / "standby" / f"{NAME}.json"
    path.parent.mkdir(exist_ok=True)
    for forged in ({"step": 2, "env": {"LD_PRELOAD": "/tmp/x.so"}, "ranks": [0], "per_node": 1},
                   {"step": 2, "env": {}, "ranks": [0, 1], "per_node": 1}, "not json {"):
        path.write_text(forged if isinstance(forged, str) else json.dumps(forged))
        assert folder.standby.order_for(NAME) is None
    assert "LD_PRELOAD" in capsys.readouterr().err


def test_a_standby_leaves_once_the_driver_ended(folder):
    folder.driver.ended("done")
    assert standby.wait_for_order(folder, NAME) is None


def test_a_standby_runs_the_program_as_its_main(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print('main with', sys.argv[1:])\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    standby.run_program([str(script), "--lr", "1"])
    assert "main with ['--lr', '1']" in capsys.readouterr().out


def test_the_standby_says_how_it_is_used(capsys):
    assert standby.main(["x"]) == 2 and "usage:" in capsys.readouterr().err
