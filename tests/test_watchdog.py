"""The watchdog's pieces without processes: where a thread is, the plain-words summary, the stack dump, and a
single-rank hang detected and reported from a real thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from trainstack._runtime.watchdog import _library_roots, dump_stacks, summarise, where


def _user_function_that_waits(event):
    event.wait(10)


def test_where_finds_the_innermost_user_frame(tmp_path):
    event = threading.Event()
    thread = threading.Thread(target=_user_function_that_waits, args=(event,))
    thread.start()
    try:
        time.sleep(0.1)
        frame = sys._current_frames()[thread.ident]
        found = where(frame, _library_roots())
        assert found["user_frame"].startswith("test_watchdog.py:") and "_user_function_that_waits" in found[
            "user_frame"]
        assert found["waiting_in"] is None
    finally:
        event.set()
        thread.join()


def test_summary_groups_ranks_and_names_the_one_behind():
    infos = {r: {"host": "node1", "pid": 100 + r, "step": 42, "phase": "backward",
                 "waiting_in": "backward (gradient all-reduce)", "user_frame": "train.py:80 (main)"}
             for r in (0, 2, 3)}
    infos[1] = {"host": "node2", "pid": 4242, "step": 41, "phase": "forward", "waiting_in": None,
                "user_frame": "train.py:57 (loss_fn)"}
    text = summarise(infos, 5, "no progress")
    assert "rank 1 (node2, pid 4242) is at step 41 (forward) in train.py:57 (loss_fn)   <- behind the others" in text
    assert "ranks 0, 2-3 are at step 42 (backward) waiting in backward (gradient all-reduce)" in text
    assert "ranks 4 sent no report" in text


def test_dump_stacks_writes_every_thread(tmp_path):
    info = dump_stacks(tmp_path / "rank-0.txt")
    text = (tmp_path / "rank-0.txt").read_text()
    assert "--- thread MainThread" in text and "test_dump_stacks_writes_every_thread" in text
    assert "test_dump_stacks_writes_every_thread" in info["user_frame"]


def test_one_process_that_stops_progressing_is_reported_and_exits_124(tmp_path):
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from trainstack._runtime import watchdog as _watchdog

        def stuck_here():
            time.sleep(60)

        _watchdog.start(0, 1, 1.0, Path({str(tmp_path)!r}))
        _watchdog.heartbeat().phase = "forward"  # past the first step's longer allowance
        _watchdog.heartbeat().step = 7
        stuck_here()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 124, proc.stderr
    [folder] = list(tmp_path.glob("hang-*"))
    summary = (folder / "SUMMARY.txt").read_text()
    assert "rank 0" in summary and "step 7 (forward)" in summary and "stuck_here" in summary
    assert "trainstack hang report" in proc.stderr


def test_store_traffic_per_interval_grows_linearly_with_the_ranks(tmp_path):
    """One watchdog tick of every rank, on a real TCPStore: rank 0 reads every heartbeat, the others only its
    summary -- requests grow as N, not N² (bench/watchdog_store.py measures it with real processes)."""
    import datetime
    import socket

    import torch.distributed as dist

    from trainstack._runtime.watchdog import Watchdog

    class Counting:
        def __init__(self, store):
            self.store, self.calls = store, 0

        def __getattr__(self, name):
            attr = getattr(self.store, name)
            if not callable(attr):
                return attr

            def counted(*args, **kwargs):
                self.calls += 1
                return attr(*args, **kwargs)
            return counted

    def requests(world: int) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
        stores = [Counting(dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=30)))
                  for _ in range(world)]
        dogs = [Watchdog(r, world, 30.0, tmp_path, stores[r]) for r in range(world)]
        for _ in range(2):  # the second round: every rank has a heartbeat and rank 0 a summary
            for dog in dogs:
                dog._exchange({"step": 1, "phase": "data", "tick": 0, "beats": 1})
        before = sum(s.calls for s in stores)
        for dog in dogs:
            dog._exchange({"step": 2, "phase": "data", "tick": 0, "beats": 2})
        del server
        return sum(s.calls for s in stores) - before

    small, large = requests(2), requests(16)
    assert large <= 8 * small * 1.2, (small, large)  # linear: 8x the ranks, ~8x the requests (N² would be ~50x)


def test_a_rank_whose_watchdog_falls_silent_is_lost_one_that_ended_is_not(tmp_path):
    """Real TCPStore, two ranks' watchdogs ticking by hand: rank 1 stops ticking (its process or node gone) -> rank 0
    names it after ``lost_after`` and three of its own ticks; a rank that ended its run (its watchdog stopped) is
    never lost. Rank 0 keeps the furthest step in the job folder's ``progress``."""
    import datetime
    import json
    import socket

    import torch.distributed as dist

    from trainstack._runtime.watchdog import Watchdog, heartbeat

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
    store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=30))
    heartbeat().step = 7  # this process's heartbeat: both hand-ticked ranks report it
    zero, one = (Watchdog(r, 2, 600.0, tmp_path, store, job_dir=tmp_path) for r in (0, 1))
    assert zero.lost_after == 15.0  # three intervals, at least 15 s
    zero.lost_after = 0.2
    lost: list[list[int]] = []
    zero._on_lost = lambda ranks, everyone: lost.append(ranks)  # the real one exits the process
    for _ in range(3):  # both alive
        one._tick()
        zero._tick()
        time.sleep(0.1)
    assert not lost
    for _ in range(5):  # rank 1 silent
        zero._tick()
        time.sleep(0.1)
    assert lost and lost[-1] == [1], lost
    assert json.loads((tmp_path / "progress").read_text())["step"] == 7
    lost.clear()
    store.set("trainstack/hb/1", json.dumps({"ended": True}))  # what a stopping watchdog publishes
    for _ in range(5):
        zero._tick()
        time.sleep(0.1)
    assert not lost
    del server


def test_a_frozen_nodes_ranks_are_named_together_a_healthy_nodes_never(tmp_path):
    """Two ranks of one node freeze together but their last heartbeats lie up to an interval apart: when the first
    crosses ``lost_after``, its node's other quiet rank is named with it (one message, one exclusion); a rank of
    another node that keeps beating is never added."""
    from trainstack._runtime.watchdog import Watchdog

    zero = Watchdog(0, 4, 600.0, tmp_path)
    zero.interval, zero.lost_after = 0.1, 0.4
    lost: list[list[int]] = []
    zero._on_lost = lambda ranks, everyone: lost.append(ranks)  # the real one exits the process
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    counts = dict.fromkeys(hosts, 0)

    def look(moving: set[int]) -> None:
        for rank in moving:
            counts[rank] += 1
        zero._alive += 1
        zero._watch_alive({r: {"alive": counts[r], "host": hosts[r], "step": 3} for r in hosts})
        time.sleep(0.06)

    for _ in range(3):
        look({0, 1, 2, 3})
    look({0, 1, 2})  # rank 3 froze; rank 2 beat once more before its node froze
    while not lost:
        look({0, 1})
    assert lost[0] == [2, 3], lost
