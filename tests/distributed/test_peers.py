"""The survivors' agreement (``_train/peers.py``) in a real 3-process gloo group: the newest complete step any rank
holds wins, its lowest holder sends the state to every rank holding another (a survivor one step behind, a rank
that moved past its mark, a new rank), and nobody holding one means every rank restores from a checkpoint."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, held_steps: list, moved: list, out: dict) -> None:
    from trainstack._train.peers import Held, Mark, agree

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        model = torch.nn.Linear(2, 1)
        with torch.no_grad():  # each rank's parameters say which step it holds (a new rank: zeros)
            model.weight.fill_(float(held_steps[rank] if held_steps[rank] is not None else 0))
        step = held_steps[rank]
        mark = Mark(step, {"global_step": step, "epoch": 0}, {"held_by": rank}, 3) if step is not None else None
        held = Held(mark, moved=moved[rank]) if rank < 2 else None  # rank 2 is the new rank
        restored, why = agree(held, {"model": model}, rank, 3)
        out[rank] = (None, why) if restored is None else (int(restored.counters["global_step"]),
                                                         float(model.weight[0, 0]), restored.source,
                                                         restored.rng)
    finally:
        dist.destroy_process_group()


def _agree(held_steps: list, moved: list) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_port(), held_steps, moved, out), nprocs=3, join=True)
        return dict(out)


def test_the_survivors_agree_on_the_newest_complete_step_and_send_it():
    # one survivor completed step 6 (its gradient all-reduce finished, it stepped), the other failed before it
    got = _agree([6, 5, None], [False, False, False])
    assert got[0] == (6, 6.0, "its own live state at step 6 (no step redone)", {"held_by": 0})
    assert got[1][:3] == (6, 6.0, "rank 0's live state at step 6 (no step redone)") and got[1][3] is None
    assert got[2][:2] == (6, 6.0) and got[2][3] is None  # the new rank: rank 0's state, its RNG derived


def test_a_rank_that_moved_past_its_mark_offers_nothing_and_receives():
    got = _agree([5, 5, None], [True, False, False])  # rank 0 failed between its optimizer step and the mark
    assert got[0][:3] == (5, 5.0, "rank 1's live state at step 5 (no step redone)")
    assert got[2][:2] == (5, 5.0)


def test_nobody_holding_a_complete_step_restores_from_a_checkpoint():
    got = _agree([None, 3, None], [False, True, False])
    assert all(v == (None, "no rank that continued in place holds a complete step") for v in got.values()), got
