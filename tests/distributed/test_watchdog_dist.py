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
    from trainstack._runtime.watchdog import resolve_timeout
    from trainstack.errors import ConfigError

    with pytest.raises(ConfigError, match="hang_timeout=-1"):
        TrainConfig(hang_timeout=-1)
    monkeypatch.setenv("TRAINSTACK_HANG_TIMEOUT", "30")
    assert resolve_timeout(None) == 30 and resolve_timeout(0) == 0
    monkeypatch.setenv("TRAINSTACK_HANG_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="'soon'"):
        resolve_timeout(None)


def _custom(seconds, acc):
    return ht.custom_loop(seconds)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_custom_loop_without_heartbeats_is_never_killed(nprocs, monkeypatch, capfd):
    """The watchdog arms at the first heartbeat: a loop that never beats runs as long as it likes."""
    from trainstack import Accelerator

    monkeypatch.setenv("TRAINSTACK_HANG_TIMEOUT", "1")
    acc = Accelerator(nprocs=nprocs, compute_setup="cpu")
    assert acc.distribute(_custom)(5.0, acc) > 10  # > 3 x the timeout, steady progress
    assert "hang watchdog armed" not in capfd.readouterr().err


_BEATS_THEN_STALLS = """
import sys, time
from trainstack import Accelerator
from trainstack.errors import TrainingHung

def work(acc):
    acc.heartbeat(1)
    time.sleep(60)

if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    try:
        acc.distribute(work)(acc)
    except TrainingHung:
        sys.exit(7)
"""


def test_a_custom_loop_that_beats_is_watched_from_its_first_beat(tmp_path, run_py):
    import sys

    script = tmp_path / "beats.py"
    script.write_text(_BEATS_THEN_STALLS)
    proc = run_py([sys.executable, str(script)], env={"TRAINSTACK_HANG_TIMEOUT": "1", "TRAINSTACK_HANG_DIR":
                                                      str(tmp_path)}, check=False, timeout=120)
    assert proc.returncode == 7, proc.stdout[-3000:]
    assert "hang watchdog armed at the first heartbeat" in proc.stdout
    assert list(tmp_path.glob("hang-*/SUMMARY.txt"))


def test_slow_first_steps_callbacks_and_async_commits_are_not_hangs(tmp_path, monkeypatch):
    """Each phase takes ~2 x the timeout: a first (compiling) forward on every rank, a rank-0 epoch-end callback,
    and the background write of an asynchronous save that the final commit waits for."""
    _fit(tmp_path, 2, ht.SlowFirst(TIMEOUT * 2), log_folder=tmp_path / "first", max_iter=1)
    monkeypatch.setenv("SLOW_CALLBACK_S", str(TIMEOUT * 2))
    _fit(tmp_path, 2, ht.Stuck(stuck_rank=9), log_folder=tmp_path / "callback", max_iter=1,
         callbacks=[Callback(on="train_epoch_end", callback=ht.slow_callback)])
    monkeypatch.setenv("SLOW_SAVE_S", str(TIMEOUT * 2))
    _fit(tmp_path, 2, ht.Stuck(stuck_rank=9), log_folder=tmp_path / "async", max_iter=1, checkpoint_every=1,
         checkpoint_format="sharded", async_checkpoint=True,
         callbacks=[Callback(on="train_start", callback=ht.slow_async_commit)])
    assert not list(tmp_path.glob("*/hang-*"))
    assert list((tmp_path / "async" / "checkpoints").glob("ckpt-*/COMMITTED"))  # the final commit completed


def test_a_rank_holding_the_gil_is_named_by_the_rank_that_noticed(tmp_path):
    with pytest.raises(TrainingHung) as exc:
        _fit(tmp_path, 2, ht.Stuck(stuck_rank=9), max_iter=50,
             callbacks=[Callback(on="train_batch_end", callback=ht.hold_the_gil)])
    [summary] = list((tmp_path / "run").glob("hang-*/SUMMARY.txt"))
    text = summary.read_text()
    assert "ranks 0 sent no report" in text or "rank 0" in text, text
    assert "no report" in str(exc.value) and "GIL" in str(exc.value)
    assert not own_children()
