"""Straggler detection on hand-made heartbeats: a slow node's ranks named with their phase after two intervals,
uniform slowness and a slower backward (where DDP's fast ranks wait) never named, a rank that keeps pace cleared."""

from __future__ import annotations

from trainstack._runtime.stragglers import Stragglers


def run(slowdown, intervals: int = 10, start: int = 3, phase: str = "forward"):
    found = Stragglers(1.5)
    spent = {r: {"data": 0.0, "forward": 0.0, "optimizer": 0.0, "backward": 0.0} for r in range(4)}
    named, cleared, beats = [], [], 0
    for i in range(intervals):
        beats += 10
        for r in range(4):
            spent[r][phase] += 10 * 0.01 * slowdown(r, i)
            spent[r]["backward"] += 10 * 0.02 * (3 if phase == "forward" and r < 2 and i >= start else 1)
        new, gone = found.observe({r: {"spent": dict(spent[r]), "beats": beats, "host": f"n{r // 2}",
                                       "step": beats} for r in range(4)})
        named += [(i, s) for s in new]
        cleared += [(i, s) for s in gone]
    return named, cleared


def test_a_slow_nodes_ranks_are_named_with_their_phase():
    named, _ = run(lambda r, i: 3.0 if r >= 2 and i >= 3 else 1.0)
    assert sorted(s.rank for _, s in named) == [2, 3] and {s.phase for _, s in named} == {"forward"}
    assert min(i for i, _ in named) == 5  # three readings running (the slowdown began at 3)
    assert all(s.host == "n1" and s.ratio > 2 for _, s in named)
    assert "rank 2 (n1) is" in named[0][1].describe() and "slower in forward" in named[0][1].describe()


def test_uniform_slowness_a_longer_backward_and_a_blip_name_nobody():
    named, _ = run(lambda r, i: 3.0 if i >= 3 else 1.0)
    assert named == []
    named, _ = run(lambda r, i: 4.0 if r == 3 and i == 4 else 1.0)  # one slow interval: in two windows, not three
    assert named == []


def test_a_rank_that_keeps_pace_again_is_cleared_soon_with_the_step_it_is_cleared_at():
    """Slow in intervals 2-5, keeping pace from 6: cleared at the second reading of its latest interval keeping pace
    (7), not once the rolling window has forgotten its slow past; the note carries the step of that reading."""
    named, cleared = run(lambda r, i: 3.0 if r == 1 and 2 <= i < 6 else 1.0, intervals=14)
    assert [s.rank for _, s in named] == [1] and [s.rank for _, s in cleared] == [1]
    (when, gone), = cleared
    assert when == 7 and gone.step == 80, (when, gone)


def test_the_data_phase_is_compared_too():
    named, _ = run(lambda r, i: 4.0 if r == 0 and i >= 2 else 1.0, phase="data")
    assert [(s.rank, s.phase) for _, s in named] == [(0, "data")]


def test_a_bad_ratio_is_a_clear_error(monkeypatch):
    import pytest

    from trainstack._runtime.stragglers import resolve_ratio
    from trainstack.errors import ConfigError

    monkeypatch.setenv("TRAINSTACK_STRAGGLER_RATIO", "fast")
    with pytest.raises(ConfigError, match="TRAINSTACK_STRAGGLER_RATIO='fast' must be a number >= 0"):
        resolve_ratio()
    monkeypatch.setenv("TRAINSTACK_STRAGGLER_RATIO", "0.8")
    with pytest.raises(ConfigError, match="use a ratio above 1"):
        resolve_ratio()
    monkeypatch.setenv("TRAINSTACK_STRAGGLER_RATIO", "0")
    assert resolve_ratio() == 0
