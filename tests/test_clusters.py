"""Where a run across clusters goes next (trainstack._slurm.clusters): the pure decisions, every case."""

from __future__ import annotations

import json
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


def _follower(tmp_path, monkeypatch, answers: dict, submit_args: list[str] | None = None):
    """A follower over clusters a and b whose `trainstack` calls answer from ``answers`` (no Slurm): test-only
    answers {"start_in_s", "reason"} per cluster, a submit's (returncode, stdout); every call recorded."""
    import subprocess

    from trainstack._slurm.clusters import Cluster, Follower

    calls: list[tuple[str, list[str]]] = []

    def trainstack(self, args, timeout=600):
        calls.append((self.name, list(args)))
        if "--test-only" in args:
            return subprocess.CompletedProcess(args, 0, json.dumps(answers[self.name]["test"]) + "\n", "")
        code, out = answers[self.name]["submit"]
        return subprocess.CompletedProcess(args, code, out, "" if code == 0 else "sbatch: error: boom")

    monkeypatch.setattr(Cluster, "trainstack", trainstack)
    profiles = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.toml"
        path.write_text(f'cluster = "{name}"\n')
        profiles.append(Cluster(name, str(path)))
    said: list[str] = []
    follower = Follower(profiles, submit_args or ["--cpu", "--", "train.py"], "s3://b/r", said.append, poll_s=0.01)
    return follower, calls, said


def test_every_clusters_reason_is_said_and_permanent_refusals_stop_before_anything_is_submitted(tmp_path,
                                                                                                 monkeypatch):
    """Probe 5 C13: two bad partitions looped 'asking again in 30 s' forever with the reasons dropped."""
    bad = {"test": {"start_in_s": None, "reason": "sbatch: error: Batch job submission failed: Invalid partition "
                                                  "name specified"}, "submit": (1, "")}
    follower, calls, said = _follower(tmp_path, monkeypatch, {"a": bad, "b": bad})
    assert follower.place() is None
    assert not any(args[0] == "submit" and "--test-only" not in args for _, args in calls), calls
    assert any("no cluster can ever start the run as asked" in line and "a: sbatch: error" in line and
               "b: sbatch" in line and "Invalid partition" in line for line in said), said


def test_a_failed_submit_moves_on_and_job_folders_are_the_clusters_own(tmp_path, monkeypatch):
    """UX review 4 defect 1: a submit that failed on one cluster crashed the follower, leaving the run with no job
    anywhere; two clusters handing out the same job id shared one job folder."""
    answers = {"a": {"test": {"start_in_s": 0.0, "reason": "now"}, "submit": (1, "")},
               "b": {"test": {"start_in_s": 10.0, "reason": "soon"}, "submit": (0, "job 6 submitted\n")}}
    follower, calls, said = _follower(tmp_path, monkeypatch, answers, ["--cpu", "--log-dir", "shared", "--", "t.py"])
    move = follower.place()
    assert move is not None and move.cluster == "b" and move.job == "6", said
    assert any("submitting on a failed" in line and "asking the other clusters" in line for line in said), said
    submits = {name: args for name, args in calls if args[0] == "submit" and "--test-only" not in args}
    assert submits["a"][submits["a"].index("--log-dir") + 1] == "shared/a"
    assert submits["b"][submits["b"].index("--log-dir") + 1] == "shared/b" and submits["b"][-2:] == ["--", "t.py"]
