"""The step schedule: which duties fall on which optimizer step, found with one comparison per step."""

from __future__ import annotations

from trainstack._train.schedule import NEVER, Clock, Schedule


def _walk(schedule: Schedule, start: int, stop: int) -> dict[int, set[str]]:
    """Every step the loop would stop at (``step >= schedule.next``), with its duties."""
    schedule.start(start)
    seen = {}
    for step in range(start + 1, stop + 1):
        if step >= schedule.next:
            seen[step] = schedule.due(step)
    return seen


def test_duties_fall_on_multiples_of_their_period_and_only_there():
    seen = _walk(Schedule({"log": 5, "val": 3, "off": 0}), 0, 15)
    assert seen == {3: {"val"}, 5: {"log"}, 6: {"val"}, 9: {"val"}, 10: {"log"}, 12: {"val"}, 15: {"log", "val"}}


def test_the_step_limit_is_due_once_reached_and_a_resumed_run_continues_on_the_same_grid():
    seen = _walk(Schedule({"log": 4}, last_step=10), 5, 12)  # resumed at step 5
    assert seen == {8: {"log"}, 10: {"max_steps"}, 12: {"log", "max_steps"}}  # the loop stops at 10 anyway
    assert Schedule({}).next == NEVER and _walk(Schedule({}), 0, 100) == {}


def test_changing_a_period_takes_effect_from_the_current_step():
    schedule = Schedule({"clock": 1, "log": 50})
    schedule.start(0)
    assert schedule.next == 1 and schedule.due(1) == {"clock"}
    schedule.set_period("clock", 20, 1)
    assert schedule.next == 20
    schedule.set_period("clock", 0, 1)
    assert schedule.next == 50 and "clock" not in schedule.periods


def test_the_clock_reads_time_about_once_a_second_and_says_when_a_line_is_due(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("trainstack._train.schedule.time.monotonic", lambda: now[0])
    clock = Clock(30.0)
    now[0] += 0.5
    due, period = clock.reading(500)  # 1000 steps/s: read again in ~1 s
    assert not due and period == 1000
    now[0] += 30.0
    due, period = clock.reading(600)  # 100 steps in 30 s: read every 3 steps (~1 s)
    assert due and period == 3
    clock.lined()
    assert clock.reading(601)[0] is False
