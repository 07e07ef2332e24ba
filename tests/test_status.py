"""`trainstack status/logs/cancel` answers from the job folder alone (what is left once Slurm forgets a job and
accounting is off); the table and the bad ids. The live paths run on the real cluster in tests/slurm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainstack._slurm.jobs import JobError
from trainstack._slurm.status import _from_folder, exit_status, format_table, job_status, last_metric
from trainstack.cli import main


def _job_folder(tmp_path: Path, job_id: str, tasks: dict[str, dict[str, str]] | None = None) -> dict:
    """A job folder as the job script leaves it: started (one line per start), exit_code, the combined log."""
    logs = tmp_path / "logs"
    job_dir = logs / f"demo-{job_id}"
    units = tasks or {"": {}}
    for task, files in units.items():
        folder = job_dir / task if task else job_dir
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    return {"job_id": job_id, "name": "demo", "job_dir": str(job_dir), "log_dir": str(logs),
            "tasks": [int(t.split("-")[1]) for t in units if t]}


def test_states_from_the_folder(tmp_path):
    started = "2026-01-01T10:00:00+00:00\n2026-01-01T10:05:00+00:00\n"
    record = _job_folder(tmp_path, "77", {"task-0": {"started": started, "exit_code": "0\n"},
                                          "task-1": {"started": started, "exit_code": "3\n"},
                                          "task-2": {"started": started},
                                          "task-3": {}, "task-4": {"started": started, "cancelled": "x"},
                                          "task-5": {"started": started, "exit_code": "143\n"}})
    (tmp_path / "logs" / "demo-77_0.out").write_text("Iteration      1 | loss: 1.0\nIteration      2 | loss: 0.5\n"
                                                     "done\n")
    rows = _from_folder("77", record, None)
    assert [r.job for r in rows] == ["77_0", "77_1", "77_2", "77_3", "77_4", "77_5"]
    assert [r.state for r in rows] == ["COMPLETED", "FAILED (exit 3)", "ENDED (killed: no exit status recorded)",
                                       "NEVER RAN", "CANCELLED",
                                       "ENDED (exit 143, SIGTERM: scancel, the time limit or a preemption)"]
    assert exit_status(rows[5].state) == 143  # a signalled job is never read as a success
    assert rows[0].restarts == 1 and rows[0].metric == "Iteration      2 | loss: 0.5" and rows[0].source == "folder"
    assert all(r.ended for r in rows)
    table = format_table(rows).splitlines()
    assert table[0].split()[:3] == ["JOB", "NAME", "STATE"] and table[1].startswith("77_0") and len(table) == 7


def test_a_job_slurm_forgot_is_answered_from_the_submission_record(tmp_path, monkeypatch):
    record = _job_folder(tmp_path, "987650", {"": {"started": "2026-01-01T10:00:00+00:00\n", "exit_code": "0"}})
    state = tmp_path / "state"
    (state / "trainstack").mkdir(parents=True)
    (state / "trainstack" / "jobs.jsonl").write_text("not json\n" + json.dumps(record) + "\n")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.setenv("PATH", "/nonexistent")  # no Slurm commands at all on this machine
    rows = job_status("987650")
    assert len(rows) == 1 and rows[0].state == "COMPLETED" and rows[0].source == "folder"
    result = CliRunner().invoke(main, ["status", "987650"])
    assert result.exit_code == 0 and "COMPLETED" in result.output
    with pytest.raises(JobError, match="987651: Slurm is not available here .scontrol not found on PATH."):
        job_status("987651")


@pytest.mark.parametrize("command", ["status", "logs", "cancel", "debug"])
@pytest.mark.parametrize("job_id", ["abc", "12;rm -rf ~", "-5", "1_2_3", "0", "0_1", "000"])
def test_malformed_job_ids_are_refused_before_anything_runs(command, job_id):
    result = CliRunner().invoke(main, [command, "--", job_id] if job_id.startswith("-") else [command, job_id])
    assert result.exit_code == 1 and "is not a Slurm job id" in result.output and "Traceback" not in result.output


def test_last_metric_reads_only_the_tail(tmp_path):
    log = tmp_path / "x.out"
    with open(log, "w") as fh:
        fh.write("Iteration      1 | loss: 9\n" + "x" * 200_000 + "\nIteration      7 | loss: 0.1 | acc: 0.9\n")
    assert last_metric(log) == "Iteration      7 | loss: 0.1 | acc: 0.9"
    assert last_metric(tmp_path / "missing.out") == "" and last_metric(None) == ""
    assert os.path.getsize(log) > 65536


def test_progress_and_eta_come_from_the_last_live_line_less_its_age(tmp_path):
    from trainstack._slurm.progress import progress_of
    from trainstack._slurm.status import TaskStatus

    log = tmp_path / "job.out"
    line = ("epoch 2/10 | step 150/400 | loss 0.4123 | lr 1.00e-03 | 812 samples/s | eta 00:05:10 | data 3% | "
            "optim 12%")
    log.write_text(f"noise\n{line}\n")
    os.utime(log, (1000.0, 1000.0))  # the line was written at t=1000
    p = progress_of(line, log, now=1010.0)
    assert (p.step, p.total_steps, p.epoch, p.total_epochs, p.rate) == (150, 400, 2, 10, "812 samples/s")
    assert p.eta_s == 300.0 and p.age_s == 10.0  # 5 min 10 s at the line, 10 s ago
    assert p.text() == "38% step 150/400, 812 samples/s, eta 00:05:00"
    assert progress_of(line, log, now=2000.0).eta_s == 0.0  # never negative
    days = progress_of("epoch 1 | step 5 | 3 tokens/s | eta 2.5 d", None)
    assert days.eta_s == 2.5 * 86400 and days.total_steps is None and days.rate == "3 tokens/s"
    assert days.text() == "step 5, 3 tokens/s, eta 2.5 d"
    assert progress_of("Iteration      2 | train_loss: 0.25", log) is None  # qadence lines carry no step total
    row = TaskStatus("7", "job", "RUNNING", "1", "0:10", 0, line, "squeue", log)
    assert row.progress.step == 150 and "38% eta" in format_table([row])
    ended = TaskStatus("7", "job", "COMPLETED", "1", "0:10", 0, line, "sacct", log)
    assert ended.progress is None and "PROGRESS" in format_table([ended]).splitlines()[0]


def test_a_forgotten_job_that_recovered_in_its_allocation_keeps_its_story(tmp_path):
    """Two job steps in one allocation (a crash retried in place): once Slurm forgot the job, the folder tells the
    same as Slurm did -- the allocation's nodes, the whole attempt's time, no requeue (not the last step's time and
    one 'restart' per step)."""
    from trainstack._slurm.status import _folder_record

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "started").write_text("2026-11-28T10:00:00+00:00\n2026-11-28T10:00:40+00:00\n")
    ev = [{"kind": "job_start", "time": 100.0, "attempt": 0, "nnodes": "3"}, {"kind": "step_start", "time": 101.0},
          {"kind": "step_end", "time": 130.0}, {"kind": "step_start", "time": 131.0},
          {"kind": "job_end", "time": 206.0, "status": 0}]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    assert _folder_record(folder) == ("0:01:46", 0, "3")
    ev += [{"kind": "job_start", "time": 300.0, "attempt": 1, "nnodes": "2"},
           {"kind": "job_end", "time": 360.0, "status": 0}]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    assert _folder_record(folder) == ("0:01:00", 1, "2")  # a requeue: Slurm's restart count, its last attempt


def test_an_array_lists_the_tasks_slurm_already_forgot(tmp_path, monkeypatch):
    """Slurm forgets an ended task after MinJobAge while its siblings still run or wait: `status` and `logs` of
    the array still list every task (the forgotten ones from the job folder where accounting is off), in order,
    and a pending range is not listed twice."""
    from trainstack._slurm import status
    from trainstack._slurm.jobs import JobInfo

    record = _job_folder(tmp_path, "1868", {f"task-{t}": {"started": "2026-01-01T10:00:00+00:00\n",
                                                        **({"exit_code": "0\n"} if t == 0 else {})} for t in range(5)})
    monkeypatch.setattr(status, "_record", lambda base: record if base == "1868" else None)
    monkeypatch.setattr(status, "_sacct", lambda job_id: None)  # accounting off
    live = [JobInfo("1870", "demo", "RUNNING", "node1", 1, None, None, "0:05", 0, None, "1868", "1"),
            JobInfo("1868", "demo", "RUNNING", "node1", 1, None, None, "0:03", 0, None, "1868", "2"),
            JobInfo("1868", "demo", "PENDING", "", 1, None, None, "0:00", 0, None, "1868", "3-4%2")]
    monkeypatch.setattr(status, "job_infos", lambda job_id: live)
    rows = job_status("1868")
    assert [r.job for r in rows] == ["1868_0", "1868_1", "1868_2", "1868_[3-4]"]
    assert rows[0].state == "COMPLETED" and rows[0].source == "folder"
    with pytest.raises(JobError, match=r"array of 4 tasks; name one, e.g. `trainstack logs 1868_0`"):
        status.find_log("1868")
    # with accounting on, a forgotten task's state is accounting's and its log the folder's
    from trainstack._slurm.status import TaskStatus

    (tmp_path / "logs" / "demo-1868_0.out").write_text("Iteration      9 | loss: 0.1\n")
    monkeypatch.setattr(status, "_sacct", lambda job_id: [TaskStatus("1868_0", "demo", "COMPLETED", "1", "0:09", 0,
                                                                     "", "sacct")])
    first = job_status("1868")[0]
    assert (first.job, first.source, first.state) == ("1868_0", "sacct", "COMPLETED")
    assert first.metric == "Iteration      9 | loss: 0.1" and first.log is not None
