"""Where a run across clusters goes next (trainstack._slurm.clusters): the pure decisions, every case."""

from __future__ import annotations

import time

import pytest

from trainstack._slurm.clusters import DEFAULT_MARGIN_S, choose, parse_test_only


@pytest.mark.parametrize("starts, current, expected", [
    ({"a": 0.0, "b": 0.0}, None, "a"),                 # first placement: the first that starts (ties: by name)
    ({"a": 600.0, "b": 30.0}, None, "b"),              # no move yet: nothing to pay
    ({"a": None, "b": 500.0}, None, "b"),              # a partition down
    ({"a": None, "b": None}, None, None),              # nowhere now: wait
    ({"a": 0.0, "b": 0.0}, "b", "b"),                  # a tie stays
    ({"a": 0.0, "b": 100.0}, "b", "b"),                # better by 100 s, a move costs 120: stay
    ({"a": 0.0, "b": 150.0}, "b", "b"),                # better by 150 s: within cost + margin (180): stay
    ({"a": 0.0, "b": 250.0}, "b", "a"),                # better by 250 s: past cost + margin: move
    ({"a": 0.0, "b": 400.0}, "b", "a"),                # better by 400 s: move
    ({"a": 0.0, "b": None}, "b", "a"),                 # the current cluster cannot start it (blocked): move
    ({"a": None, "b": None, "c": 10.0}, "a", "c"),
])
def test_choose(starts, current, expected):
    assert choose(starts, current, move_cost_s=120.0, margin_s=DEFAULT_MARGIN_S) == expected


def test_a_costlier_move_needs_a_bigger_win():
    starts = {"a": 0.0, "b": 400.0}
    assert choose(starts, "b", move_cost_s=120.0, margin_s=60.0) == "a"
    assert choose(starts, "b", move_cost_s=600.0, margin_s=60.0) == "b"


def test_parse_test_only():
    now = time.mktime(time.strptime("2026-11-28T14:50:00", "%Y-%m-%dT%H:%M:%S"))
    said = "sbatch: Job 3 to start at 2026-11-28T14:51:01 using 2 processors on nodes beta[1-2] in partition debug"
    assert parse_test_only(said, now) == 61.0
    assert parse_test_only("sbatch: Job 3 to start at 2026-11-28T14:40:00 using 2 processors", now) == 0.0
    assert parse_test_only("allocation failure: Requested node configuration is not available", now) is None


def test_the_run_ledger_across_clusters():
    from trainstack._common.goodput import run_ledger

    alpha = {"ledger": {"parts": {"queue": 5.0, "startup": 4.0, "compile": 2.0, "productive": 30.0}}, "left": True}
    beta = {"ledger": {"parts": {"queue": 1.0, "startup": 6.0, "compile": 3.0, "productive": 20.0}},
            "moved_in": True, "download_s": 1.5}
    found = run_ledger([alpha, beta], wall_s=80.0)
    parts = found["parts"]
    assert parts["pending_elsewhere"] == 5.0 and parts["queue"] == 1.0  # alpha's wait: the run left it
    assert parts["transfer"] == 1.5 and parts["startup"] == 4.0 + 4.5
    assert parts["cold_cache"] == 3.0 and parts["compile"] == 2.0  # beta's first compile after the move
    assert parts["productive"] == 50.0 and parts["other"] == 80.0 - 71.0
    assert found["goodput"] == round(50 / 80, 4) and found["total_s"] == 80.0
    # hedged jobs overlap: the total is what was spent, never less
    assert run_ledger([beta, beta], wall_s=10.0)["total_s"] == 60.0


def test_a_move_costs_what_the_runs_earlier_moves_cost():
    from trainstack._slurm.clusters import measured_move_cost

    def move(moved_in, startup, compile_s):
        return {"moved_in": moved_in, "ledger": {"parts": {"startup": startup, "compile": compile_s, "queue": 50}}}

    ledger = {"moves": [move(False, 40.0, 5.0), move(True, 20.0, 10.0), move(True, 30.0, 0.0)]}
    assert measured_move_cost(ledger) == 30.0  # (30 + 30) / 2: the jobs the run came to; queues are not the move
    assert measured_move_cost({"moves": [move(False, 40.0, 5.0)]}) is None and measured_move_cost(None) is None
    assert measured_move_cost({"moves": [{"moved_in": True, "ledger": {"parts": "forged"}}]}) is None
    assert measured_move_cost({"moves": "forged"}) is None


@pytest.mark.parametrize("body, said", [
    ('host = 123\n', "host in {path} must be text, got 123"),
    ('slurm_conf = 5\n', "slurm_conf in {path} must be text, got 5"),
    ('cluster = ["b"]\n', "cluster in {path} must be text, got ['b']"),
    ('slurm_cfg = "x"\n', "unknown option 'slurm_cfg' in {path}"),
    ('slurm_conf = "/nonexistent/slurm.conf"\n', "names /nonexistent/slurm.conf, which is not a file here"),
])
def test_every_cluster_profile_is_checked_before_anything_is_asked(tmp_path, body, said):
    """Probe 5 C3, C4, C5, C10, C12: raw exceptions at a cluster's first ask (C4 killed the follower), a list taken
    as a name, a missing slurm_conf costing 118 s per ask in silence -- now a usage error at once."""
    from click.testing import CliRunner

    from trainstack.cli import main

    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('cluster = "good"\n')
    bad.write_text(body)
    result = CliRunner().invoke(main, ["submit", "--cpu", "--cluster", str(good), "--cluster", str(bad), "--store",
                                       "s3://b/r", "--", "train.py"])
    assert result.exit_code == 2 and said.format(path=bad) in result.output, result.output
