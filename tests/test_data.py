"""Sharding of DataLoaders, checked rank by rank without a process group."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from trainstack.data import PreparedDataLoader, ResumableDistributedSampler, prepare_dataloader
from trainstack.errors import ConfigError


def _dataset(n=10):
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def _indices(loader):
    return [int(i) for _, ys in loader for i in ys]


def _collate(batch):
    xs, ys = zip(*batch, strict=True)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}


def _init(worker_id):  # pragma: no cover - runs in loader workers
    pass


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover(shuffle):
    loader = DataLoader(_dataset(12), batch_size=2, shuffle=shuffle)
    shards = [_indices(prepare_dataloader(loader, r, 3)) for r in range(3)]
    assert all(len(s) == 4 for s in shards)
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(12))


def test_uneven_tail_is_padded_so_ranks_step_together():
    loader = DataLoader(_dataset(10), batch_size=2)
    shards = [_indices(prepare_dataloader(loader, r, 3)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]
    assert set(i for s in shards for i in s) == set(range(10))


def test_shuffle_order_changes_between_epochs_and_is_the_same_on_every_rank():
    loader = DataLoader(_dataset(64), batch_size=8, shuffle=True)
    ranks = [prepare_dataloader(loader, r, 2) for r in range(2)]
    epoch0 = [_indices(r) for r in ranks]
    epoch1 = [_indices(r) for r in ranks]
    assert epoch0[0] != epoch1[0]
    for epoch in (epoch0, epoch1):  # the two ranks still partition the data each epoch
        assert sorted(epoch[0] + epoch[1]) == list(range(64))


def test_options_are_preserved():
    gen = torch.Generator().manual_seed(7)
    loader = DataLoader(_dataset(8), batch_size=3, shuffle=True, drop_last=True, collate_fn=_collate,
                        num_workers=1, persistent_workers=True, worker_init_fn=_init, generator=gen,
                        prefetch_factor=3, timeout=5)
    out = prepare_dataloader(loader, 1, 2)
    assert isinstance(out, PreparedDataLoader) and isinstance(out.sampler, ResumableDistributedSampler)
    assert out.sampler.shuffle and out.sampler.rank == 1 and out.sampler.num_replicas == 2
    assert (out.batch_size, out.drop_last, out.collate_fn, out.num_workers) == (3, True, _collate, 1)
    assert (out.persistent_workers, out.worker_init_fn, out.generator, out.prefetch_factor, out.timeout) == (
        True, _init, gen, 3, 5)
    batches = list(out)
    assert len(batches) == 1 and set(batches[0]) == {"x", "y"}


def test_skip_batches_resumes_mid_epoch():
    loader = DataLoader(_dataset(16), batch_size=2, shuffle=True)
    a = prepare_dataloader(loader, 0, 2)
    full = _indices(a)
    b = prepare_dataloader(loader, 0, 2)
    b.set_epoch(0)
    b.skip_batches(2)
    assert _indices(b) == full[4:]
    assert _indices(b) != full  # next epoch: full length again, new order
    assert len(_indices(b)) == 8


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_iterable_dataset_is_strided_per_rank():
    loader = DataLoader(_Stream(), batch_size=2)
    got = [[int(x) for b in prepare_dataloader(loader, r, 2) for x in b] for r in range(2)]
    assert got == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


def test_custom_sampler_is_a_clear_error_when_sharding():
    ds = _dataset(8)
    loader = DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with pytest.raises(ConfigError, match="custom sampler WeightedRandomSampler"):
        prepare_dataloader(loader, 0, 2)
    assert prepare_dataloader(loader, 0, 1) is loader  # one process: nothing to shard


def test_mismatched_distributed_sampler_is_rejected():
    ds = _dataset(8)
    loader = DataLoader(ds, batch_size=2, sampler=torch.utils.data.DistributedSampler(ds, num_replicas=4, rank=0))
    with pytest.raises(ConfigError, match="rank 0 of 4"):
        prepare_dataloader(loader, 0, 2)


@pytest.mark.parametrize("shuffle, drop_last", [(True, False), (False, True), (True, True)])
def test_fast_tensor_path_gives_the_same_batches_and_rng_draws(shuffle, drop_last, monkeypatch):
    from trainstack.data import FastTensorLoader

    ds = TensorDataset(torch.randn(37, 3), torch.arange(37))
    loader = DataLoader(ds, batch_size=4, shuffle=shuffle, drop_last=drop_last)
    fast = prepare_dataloader(loader, 1, 2, seed=3)
    monkeypatch.setenv("TRAINSTACK_FAST_TENSOR_PATH", "0")
    slow = prepare_dataloader(loader, 1, 2, seed=3)
    assert isinstance(fast, FastTensorLoader) and not isinstance(slow, FastTensorLoader)
    for _ in range(2):  # two epochs: reshuffled identically
        torch.manual_seed(0)
        a = list(fast)
        ra = torch.rand(1)
        torch.manual_seed(0)
        b = list(slow)
        rb = torch.rand(1)
        assert len(a) == len(b) == len(fast) and torch.equal(ra, rb)  # same draws from the global RNG
        for x, y in zip(a, b, strict=True):
            assert isinstance(x, list) and isinstance(y, list)
            assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
    fast.set_epoch(0)
    fast.skip_batches(2)
    assert len(list(fast)) == len(a) - 2


def test_fast_path_is_not_used_when_it_could_change_semantics():
    from trainstack.data import FastTensorLoader

    ds = TensorDataset(torch.randn(8, 3), torch.arange(8))
    assert not isinstance(prepare_dataloader(DataLoader(ds, batch_size=2, collate_fn=_collate), 0, 1),
                          FastTensorLoader)
    assert not isinstance(prepare_dataloader(DataLoader(ds, batch_size=2, num_workers=1), 0, 1), FastTensorLoader)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_a_global_position_continues_on_another_world_size_without_gap_or_repeat(shuffle, new_world):
    ds = TensorDataset(torch.arange(52))  # 52 - 16 = 36 samples left: no padding for 1, 2 or 3 ranks
    loader = DataLoader(ds, batch_size=2, shuffle=shuffle)
    old = [prepare_dataloader(loader, r, 2, seed=5) for r in range(2)]
    for ld in old:
        ld.set_epoch(3)
    consumed = []
    for ld in old:  # 4 steps on 2 ranks: 16 global samples
        consumed += [int(i) for b in itertools.islice(ld, 4) for i in b[0]]
    new = [prepare_dataloader(loader, r, new_world, seed=5) for r in range(new_world)]
    rest = []
    for ld in new:
        ld.set_epoch(3)
        ld.skip_samples(16)
        assert ld.batches_next_pass() == math.ceil((52 - 16) / new_world / 2)
        rest += [int(i) for b in ld for i in b[0]]
    assert sorted(consumed + rest) == list(range(52))  # every sample once: no gap, no repeat
    one = prepare_dataloader(loader, 0, 1, seed=5)
    one.set_epoch(3)
    order = [int(i) for b in one for i in b[0]]
    assert set(order[:16]) == set(consumed)  # the first 16 of the epoch's global order were the ones consumed


def test_the_same_world_size_continues_exactly():
    ds = TensorDataset(torch.arange(37))
    loader = DataLoader(ds, batch_size=3, shuffle=True)
    for rank in range(2):
        full = prepare_dataloader(loader, rank, 2, seed=1)
        expected = [b[0].tolist() for b in full][2:]
        resumed = prepare_dataloader(loader, rank, 2, seed=1)
        resumed.skip_samples(2 * 3 * 2)
        assert [b[0].tolist() for b in resumed] == expected
