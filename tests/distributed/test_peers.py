"""The survivors' agreement (``_train/peers.py``) in a real 3-process gloo group: the newest complete step any rank
holds wins, its lowest holder sends the state to every rank holding another (a survivor one step behind, a rank
that moved past its mark, a new rank), and nobody holding one means every rank restores from a checkpoint. Sharded
(HSDP): each rank needs its own shard, the newest step at which every needed shard has a holder wins
(``plan_transfer``), and two ranks that each hold the shard the other needs swap them point to point."""

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


def _swap_worker(rank: int, port: int, out: dict) -> None:
    from trainstack._train.peers import Held, Mark, agree

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = torch.nn.Linear(2, 1)
        with torch.no_grad():
            model.weight.fill_(10.0 + rank)  # rank r holds shard 1 - r (renumbered by a shrink) and needs shard r
        held = Held(Mark(7, {"global_step": 7}, None, 4), moved=False, shard=(1 - rank, 2))
        restored, _ = agree(held, {"model": model}, rank, 2, need=(rank, 2))
        assert restored is not None
        out[rank] = (float(model.weight[0, 0]), restored.source)
    finally:
        dist.destroy_process_group()


def test_two_ranks_holding_each_other_s_shard_swap_them():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_swap_worker, args=(_port(), out), nprocs=2, join=True)
        got = dict(out)
    assert got == {0: (11.0, "rank 1's live state at step 7 (no step redone)"),
                   1: (10.0, "rank 0's live state at step 7 (no step redone)")}, got


def test_the_plan_takes_each_shard_from_its_lowest_holder_at_the_newest_complete_step():
    from trainstack._train.peers import plan_transfer

    ddp = [(6, (0, 1), (0, 1)), (5, (0, 1), (0, 1)), (-1, None, (0, 1))]
    assert plan_transfer(ddp) == (6, {0: 0, 1: 0, 2: 0})
    # HSDP, 2 replica groups x 2 shards, rank 1 (group 0, shard 1) new: shard 1 from rank 3 (group 1)
    hsdp = [(5, (0, 2), (0, 2)), (-1, None, (1, 2)), (5, (0, 2), (0, 2)), (5, (1, 2), (1, 2))]
    assert plan_transfer(hsdp) == (5, {0: 0, 1: 3, 2: 2, 3: 3})
    # the survivors disagree on "completed": shard 1 is held at step 5 only, so all continue from 5
    split = [(6, (0, 2), (0, 2)), (-1, None, (1, 2)), (5, (0, 2), (0, 2)), (5, (1, 2), (1, 2))]
    assert plan_transfer(split) == (5, {0: 2, 1: 3, 2: 2, 3: 3})
    # a shrink to the second group's node: its ranks renumbered 0 and 1, their shards the same
    assert plan_transfer([(9, (0, 2), (0, 2)), (9, (1, 2), (1, 2))]) == (9, {0: 0, 1: 1})


def test_a_shard_nobody_holds_is_a_rollback_said_in_words():
    from trainstack._train.peers import plan_transfer

    fsdp = [(5, (0, 4), (0, 4)), (-1, None, (1, 4)), (5, (2, 4), (2, 4)), (5, (3, 4), (3, 4))]  # plain FSDP
    assert plan_transfer(fsdp) == ("no rank holds shard 1 of 4 at step 5 (the survivors hold no complete set of the "
                                   "state)")
    assert plan_transfer([(-1, None, (0, 1))] * 3) == "no rank that continued in place holds a complete step"
    # the layout changed the shard count (4 shards held, 2 needed): nothing fits
    assert isinstance(plan_transfer([(3, (0, 4), (0, 2)), (3, (1, 4), (1, 2))]), str)


def _commit_worker(rank: int, port: int, out: dict) -> None:
    import contextlib
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainstack._train.peers import commit_points

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    releases = contextlib.ExitStack()
    commit_points(optimizer, model, "no", releases)
    model(torch.ones(2, 4)).sum().backward()
    if rank == 1:  # its gradients are in, but it dies before its optimizer step (as a lost rank between collectives)
        os._exit(0)
    before = model.weight.to_local().clone()
    try:
        optimizer.step()
        out[rank] = "stepped"
    except RuntimeError:
        out[rank] = "refused" if torch.equal(model.weight.to_local(), before) else "moved"
    releases.close()
    assert not optimizer._optimizer_step_pre_hooks  # removed with the run's releases
    os._exit(0)


def test_a_sharded_model_steps_only_once_every_rank_has_its_gradients():
    """The commit point (``commit_points``): a rank whose peer died after the gradient collectives but before its
    own optimizer step does not step either -- the survivors hold the same step, so each shard has a holder."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_commit_worker, args=(_port(), out), nprocs=2, join=True)
        assert dict(out) == {0: "refused"}
