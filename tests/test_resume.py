"""The resume cursor, without processes: a position saved by 2 ranks continues on 3 at the same global sample, with
no sample of the epoch skipped or repeated; the same world size continues at its batch with its partial sums."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainstack._train.resume import EpochCursor, derived_seed
from trainstack.data import prepare_dataloader

N = 48


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(N, dtype=torch.float32).reshape(-1, 1)), batch_size=4, shuffle=True)


def _ids(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch[0].reshape(-1).tolist()]


def _stopped_position(world: int, batches: int) -> tuple[dict, list[int]]:
    """What a run on ``world`` ranks records when stopped after ``batches`` batches of epoch 0, and what it saw."""
    seen: list[int] = []
    cursor = EpochCursor()
    for rank in range(world):
        loader = prepare_dataloader(_loader(), rank, world, seed=7)
        it = iter(loader)
        seen += _ids(next(it) for _ in range(batches))
    spb = prepare_dataloader(_loader(), 0, world, seed=7).samples_per_step
    cursor.stop_at(batches, spb, world, torch.tensor(1.0), {"acc": torch.tensor(2.0)})
    return cursor.checkpoint(), seen


def test_a_position_of_two_ranks_continues_on_three_at_the_same_global_sample():
    partial, seen = _stopped_position(world=2, batches=3)
    assert partial["samples_in_epoch"] == 24 and partial["batch_in_epoch"] == 3
    rest: list[int] = []
    for rank in range(3):
        loader = prepare_dataloader(_loader(), rank, 3, seed=7)
        cursor = EpochCursor()
        assert cursor.take(partial, saved_world=2, world=3, samples_per_step=loader.samples_per_step) is True
        done, totals, batches, left = cursor.begin(loader, per_epoch=len(loader), capped=False)
        assert done == 0 and totals == {}  # a new segment of the epoch: partial sums of another layout are not kept
        rest += _ids(batches)
    assert sorted(seen + rest) == list(range(N))  # every sample of the epoch exactly once


def test_the_same_world_size_continues_at_its_batch_with_its_partial_sums():
    partial, seen = _stopped_position(world=2, batches=3)
    rest: list[int] = []
    for rank in range(2):
        loader = prepare_dataloader(_loader(), rank, 2, seed=7)
        cursor = EpochCursor()
        assert cursor.take(partial, saved_world=2, world=2, samples_per_step=loader.samples_per_step) is False
        done, totals, batches, left = cursor.begin(loader, per_epoch=len(loader), capped=False)
        assert done == 3 and float(totals["loss_sum"]) == 1.0 and left == len(loader) - 3
        rest += _ids(batches)
        assert cursor.position(3 + left, loader.samples_per_step, 2)["samples_in_epoch"] == N  # the epoch's end
    assert sorted(seen + rest) == list(range(N))


def test_an_old_checkpoint_without_global_positions_and_the_derived_seeds():
    cursor = EpochCursor()
    assert cursor.take({"batch_in_epoch": 2}, saved_world=2, world=2, samples_per_step=8) is False
    assert cursor.samples == 16 and cursor.base == 0
    seeds = {derived_seed(3, rank, step) for rank in range(4) for step in (0, 10)}
    assert len(seeds) == 8 and derived_seed(3, 1, 10) == derived_seed(3, 1, 10)
