"""The batch script's retry decision after a crash (on Slurm: tests/slurm/test_verdicts.py): the same root cause
again without progress stops the retries; a new cause, or progress, retries; every attempt leaves a row."""

from __future__ import annotations

import json

from trainstack._slurm.attempt import decide, main

ERROR = """epoch 1 | step {step} | loss 0.5
Traceback (most recent call last):
  File "/home/u/train.py", line 9, in <module>
    1 / 0
ZeroDivisionError: division by zero
"""


def test_the_same_cause_without_progress_stops_a_new_one_or_progress_retries(tmp_path, monkeypatch, capsys):
    rank0 = tmp_path / "rank-0.out"
    rank0.write_text(ERROR.format(step=40))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert decide(tmp_path, 1) == (True, "attempt 0 ended with python error: ZeroDivisionError: division by zero "
                                         "on rank 0 at train.py:9 (<module>); retrying")
    rank0.write_text(ERROR.format(step=40) + ERROR.format(step=60))  # the next attempt got further: progress
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert decide(tmp_path, 1)[0]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # failed again at the same step: deterministic
    assert main(["attempt", str(tmp_path), "1"]) == 3
    assert "not retried: python error: ZeroDivisionError: division by zero on rank 0 at train.py:9 (<module>), " \
           "same as attempt 1, no progress (last step 60)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "verdicts.jsonl").read_text().splitlines()]
    assert [r["attempt"] for r in rows] == [0, 1, 2] and [r["step"] for r in rows] == [40, 60, 60]


def test_a_host_fault_blames_the_host_the_failing_rank_ran_on(tmp_path, monkeypatch):
    (tmp_path / "rank-0.out").write_text(ERROR.replace("ZeroDivisionError: division by zero",
                                                       "RuntimeError: CUDA error: an illegal memory access"))
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert decide(tmp_path, 1)[0]
    row = json.loads((tmp_path / "verdicts.jsonl").read_text().splitlines()[-1])
    assert row["kind"] == "cuda error" and row["blamed"] == "node7"
