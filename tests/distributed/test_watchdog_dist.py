"""The hang watchdog on real gloo processes: a stuck rank is named with the function it is stuck in, every rank's
stacks are dumped, the run exits (code 124) instead of hanging; slow progress and long checkpoints never trigger it."""

from __future__ import annotations

import time

import _hang_train as ht
import pytest
import torch
from psutil_free import own_children

from trainstack import Callback, TrainConfig, Trainer
from trainstack.errors import TrainingHung

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]
TIMEOUT = 4.0


def _fit(tmp_path, nprocs, loss, **kw):
    cfg = TrainConfig(**({"nprocs": nprocs, "compute_setup": "cpu", "max_iter": 2, "log_folder": tmp_path / "run",
                          "verbose": False, "hang_timeout": TIMEOUT} | kw))
    m = ht.model()
    return Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), cfg, loss_fn=loss).fit(ht.data())


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_stuck_rank_is_named_and_the_run_exits(tmp_path, nprocs):
    start = time.monotonic()
    with pytest.raises(TrainingHung) as exc:
        _fit(tmp_path, nprocs, ht.Stuck(stuck_rank=1, at_step=5))
    took = time.monotonic() - start
    assert took < TIMEOUT + 15 + 10, took  # detection within timeout + 15 s (+ start-up)
    assert exc.value.exitcode == 124
    [folder] = list((tmp_path / "run").glob("hang-*"))
    assert sorted(p.name for p in folder.glob("rank-*.txt")) == [f"rank-{r}.txt" for r in range(nprocs)]
    summary = (folder / "SUMMARY.txt").read_text()
    line = next(line for line in summary.splitlines() if line.startswith("rank 1 "))
    assert "sleep_forever" in line and "_hang_train.py" in line and "behind" in line, summary
    assert "waiting in" in summary  # the others wait in the collective
    assert "sleep_forever" in (folder / "rank-1.txt").read_text()
    assert "rank 1" in str(exc.value) and "sleep_forever" in str(exc.value)  # the caller sees the summary
    assert not own_children()


def test_slow_but_progressing_and_long_checkpoints_never_trigger(tmp_path, monkeypatch):
    # rank 1 is slow (0.5 s a step: a 16-step epoch is twice the timeout) but keeps making progress ...
    _fit(tmp_path, 2, ht.Stuck(stuck_rank=1, at_step=0, slow=0.5), max_iter=1)
    assert not list((tmp_path / "run").glob("hang-*"))
    # ... and a checkpoint that takes longer than the timeout (the watchdog allows saves 3x as long)
    monkeypatch.setenv("SLOW_SAVE_S", str(TIMEOUT * 1.8))
    slow = Callback(on="train_start", callback=ht.slow_save)
    _fit(tmp_path, 2, ht.Stuck(stuck_rank=9, at_step=0), log_folder=tmp_path / "ckpt", max_iter=2,
         checkpoint_every=1, callbacks=[slow])
    assert not list((tmp_path / "ckpt").glob("hang-*"))


def test_hang_timeout_is_validated_and_can_come_from_the_environment(monkeypatch):
    from trainstack._watchdog import resolve_timeout
    from trainstack.errors import ConfigError

    with pytest.raises(ConfigError, match="hang_timeout=-1"):
        TrainConfig(hang_timeout=-1)
    monkeypatch.setenv("TRAINSTACK_HANG_TIMEOUT", "30")
    assert resolve_timeout(None) == 30 and resolve_timeout(0) == 0
    monkeypatch.setenv("TRAINSTACK_HANG_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="'soon'"):
        resolve_timeout(None)
