"""Accelerate's data-loader semantics, one process, no group: which batches each of N processes gets from the user's
own batch sampler (whole batches, split batches, even or not, drop_last), iterable datasets, lengths, skipping."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from trainstack.data_loader import BatchSamplerShard, IterableDatasetShard, prepare_data_loader, skip_first_batches
from trainstack.errors import ConfigError


def _shards(length, batch_size, n, drop_last=False, split=False, even=True):
    base = BatchSampler(SequentialSampler(range(length)), batch_size, drop_last)
    return [list(BatchSamplerShard(base, n, i, split_batches=split, even_batches=even)) for i in range(n)]


def test_whole_batches_go_round_robin():
    p0, p1 = _shards(24, 3, 2)
    assert p0 == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]]
    assert p1 == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]]


def test_an_incomplete_last_group_is_completed_from_the_start_of_the_pass():
    assert _shards(21, 3, 2)[1][-1] == [0, 1, 2]  # 7 batches: process 1 gets one from the start
    p0, p1 = _shards(22, 3, 2)  # a short last batch [21] is completed, the next process continues
    assert p0[-1] == [18, 19, 20] and p1[-1] == [21, 0, 1]
    assert _shards(2, 3, 2) == [[[0, 1, 0]], [[1, 0, 1]]]  # fewer samples than one batch per process


def test_drop_last_and_uneven_batches_repeat_nothing():
    p0, p1 = _shards(21, 3, 2, drop_last=True)
    assert (len(p0), len(p1)) == (3, 3)
    p0, p1 = _shards(22, 3, 2, even=False)
    assert p0[-1] == [18, 19, 20] and p1[-1] == [21] and sorted(sum(p0 + p1, [])) == list(range(22))


def test_split_batches_give_each_process_a_slice():
    p0, p1 = _shards(10, 4, 2, split=True)
    assert p0 == [[0, 1], [4, 5], [8, 9]] and p1 == [[2, 3], [6, 7], [0, 1]]
    p0, p1 = _shards(10, 4, 2, split=True, even=False)
    assert p1 == [[2, 3], [6, 7]]


@pytest.mark.parametrize(("length", "size", "n", "drop_last", "split", "even"), [
    combo for combo in itertools.product((1, 5, 8, 13, 24), (1, 2, 4), (1, 2, 3), (False, True), (False, True),
                                         (False, True)) if not combo[4] or combo[1] % combo[2] == 0])
def test_the_length_is_what_a_pass_yields(length, size, n, drop_last, split, even):
    base = BatchSampler(SequentialSampler(range(length)), size, drop_last)
    for i in range(n):
        shard = BatchSamplerShard(base, n, i, split_batches=split, even_batches=even)
        if split and not even and not drop_last and length % size:
            continue  # split, uneven: the last slice depends on the process (Accelerate's length counts it)
        assert len(shard) == len(list(shard)), (i, list(shard))


def test_one_process_passes_the_batches_through():
    assert _shards(7, 3, 1) == [[[0, 1, 2], [3, 4, 5], [6]]]


def test_a_skip_leaves_out_the_first_batches_of_the_next_pass_only():
    shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(16)), 2, False), 2, 0)
    shard.skip = 2
    assert list(shard) == [[8, 9], [12, 13]]
    assert list(shard) == [[0, 1], [4, 5], [8, 9], [12, 13]]


def test_iterable_datasets_are_sharded_by_groups():
    p0 = list(IterableDatasetShard(range(10), batch_size=2, num_processes=2, process_index=0))
    p1 = list(IterableDatasetShard(range(10), batch_size=2, num_processes=2, process_index=1))
    assert p0 == [0, 1, 4, 5, 8, 9] and p1 == [2, 3, 6, 7, 0, 1]
    assert list(IterableDatasetShard(range(10), batch_size=2, drop_last=True, num_processes=2)) == [0, 1, 4, 5]


def test_split_batches_need_a_multiple_of_the_processes():
    with pytest.raises(ConfigError, match="multiple of the number of processes"):
        prepare_data_loader(DataLoader(range(10), batch_size=3), num_processes=2, process_index=0,
                            split_batches=True)


def test_dispatch_batches_is_refused_with_the_alternative():
    with pytest.raises(ConfigError, match="dispatch_batches=True.*every process reads its own shard"):
        prepare_data_loader(DataLoader(range(10), batch_size=2), dispatch_batches=True)


def test_a_prepared_loader_keeps_the_users_order_and_batches():
    loader = DataLoader(torch.arange(10.0), batch_size=3)
    prepared = prepare_data_loader(loader, num_processes=1, process_index=0)
    assert [b.tolist() for b in prepared] == [b.tolist() for b in loader]
    assert [b.tolist() for b in skip_first_batches(loader, 2)] == [[6.0, 7.0, 8.0], [9.0]]
    with pytest.raises(ConfigError, match="num_batches=-1"):
        skip_first_batches(loader, -1)


def test_a_tensor_dataset_is_indexed_a_batch_at_a_time_with_the_same_result():
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(20.0), torch.arange(20) % 3)
    gen = torch.Generator().manual_seed(3)
    plain = [[t.clone() for t in b] for b in DataLoader(data, batch_size=4, shuffle=True, generator=gen)]
    gen.manual_seed(3)
    fast = prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True, generator=gen), num_processes=1,
                               process_index=0)
    assert type(fast.dataset).__name__ == "_WholeBatches"
    got = list(fast)
    assert all(torch.equal(a, b) for pa, pb in zip(plain, got, strict=True) for a, b in zip(pa, pb, strict=True))
