"""Data: shard a user's DataLoader across ranks without losing any of its options, and qadence's data helpers.

The rebuilt loader keeps ``batch_size``, ``shuffle``, ``drop_last``, ``collate_fn``, ``num_workers``,
``pin_memory``, ``generator``, ``worker_init_fn``, ``persistent_workers``, ``timeout``,
``prefetch_factor`` and ``multiprocessing_context``; it calls ``set_epoch`` on every new pass, so the
shuffle order changes between epochs; and it can jump over the first batches of a pass (exact mid-epoch resume)
without loading them.

qadence names: ``DictDataLoader`` (``{name: batch}`` from several loaders), ``InfiniteTensorDataset`` and
``to_dataloader``.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from ._common import envvars as envvars
from .errors import ConfigError

__all__ = ["ResumableDistributedSampler", "PreparedDataLoader", "FastTensorLoader", "prepare_dataloader",
           "ShardedIterableDataset", "EvalShardSampler", "prepare_eval_dataloader", "DictDataLoader",
           "InfiniteTensorDataset", "to_dataloader", "epoch_batches", "batches_per_epoch", "check_loader",
           "prepare_train"]

_COPIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "generator",
           "persistent_workers", "pin_memory_device", "in_order")


class ResumableDistributedSampler(_TorchDistributedSampler):
    """torch's DistributedSampler whose next pass can start at a *global* sample position.

    The position counts samples of the epoch's order consumed by all ranks together, so it means the same for any
    number of ranks: a run stopped after ``g`` samples on ``W`` ranks continues at sample ``g`` on ``W'`` ranks,
    with nothing skipped or repeated (padding aside). On the same ``W`` the continuation is exactly the rest of
    the pass it would have had. The skipped samples are never loaded.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start = 0

    def skip_samples(self, n_samples: int) -> None:
        """The next pass starts at global sample ``n_samples`` of the epoch's order."""
        self._start = max(int(n_samples), 0)

    def _order(self) -> list[int]:
        if self.shuffle:  # the order torch's DistributedSampler uses: independent of the number of ranks
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]
        return list(range(len(self.dataset)))  # type: ignore[arg-type]

    def _indices_from(self, start: int) -> list[int]:
        order = self._order()
        rest = order[start:]
        replicas = self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % replicas]
        elif rest:
            pad = (-len(rest)) % replicas  # padded from the start of the order, as torch pads
            rest += (order * math.ceil(pad / len(order)))[:pad]
        return rest[self.rank::replicas]

    @property
    def start_sample(self) -> int:
        """The global sample the next pass starts at (0, or where a skip put it)."""
        return self._start

    def padding(self) -> int:
        """Duplicates at the end of this rank's next pass (padding shards to equal length; at most one per rank
        when the dataset has at least as many samples as ranks)."""
        rest = len(self.dataset) - self._start  # type: ignore[arg-type]
        if self.drop_last or rest <= 0:
            return 0
        return self.next_len() - len(range(self.rank, rest, self.num_replicas))

    def next_len(self) -> int:
        """How many indices this rank's next pass yields."""
        return len(self._indices_from(self._start)) if self._start else self.num_samples

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        if not start:
            return super().__iter__()
        return iter(self._indices_from(start))


class ShardedIterableDataset(IterableDataset):
    """Element ``rank`` of every complete group of ``world_size`` elements of an iterable dataset.

    Every rank gets the same number of elements (a tail shorter than ``world_size`` is dropped): with uneven
    counts one rank would wait forever in a collective its peers never reach.
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.dataset)
        while True:
            group = list(itertools.islice(it, self.world_size))
            if len(group) < self.world_size:
                return
            yield group[self.rank]


class PreparedDataLoader(DataLoader):
    """A DataLoader that advances its sampler's epoch on each ``iter()`` (so shuffles differ per epoch)."""

    epoch: int = 0
    heartbeat: Any = None  # set by Accelerator.prepare: every batch counts as progress for the hang watchdog
    loop_state: Any = None  # set by Accelerator.prepare: the loop's LoopState (last batch, padding, position)
    place: Any = None  # set by Accelerator.prepare (device_placement): moves each batch to the device

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch``'s order (used when resuming)."""
        self.epoch = epoch

    @property
    def can_skip(self) -> bool:
        """True when a pass can start at a global sample position, jumping over the rest without loading it."""
        return isinstance(self.sampler, ResumableDistributedSampler)

    @property
    def samples_per_step(self) -> int:
        """Global samples one step of every rank consumes (batch size x ranks)."""
        sampler: Any = self.sampler
        return (self.batch_size or 1) * getattr(sampler, "num_replicas", 1)

    def skip_samples(self, n_samples: int) -> None:
        """Start the next pass at global sample ``n_samples`` of the epoch (mid-epoch resume, any world size)."""
        sampler = self.sampler
        if not isinstance(sampler, ResumableDistributedSampler):
            raise ConfigError("this loader cannot skip batches: its sampler is not a ResumableDistributedSampler")
        sampler.skip_samples(n_samples)

    def skip_batches(self, n_batches: int) -> None:
        """Skip the first ``n_batches`` batches of every rank's next pass."""
        self.skip_samples(n_batches * self.samples_per_step)

    def batches_next_pass(self) -> int:
        """Batches of the next pass on this rank (after a skip)."""
        sampler: Any = self.sampler
        n = sampler.next_len() if isinstance(sampler, ResumableDistributedSampler) else len(sampler)
        size = self.batch_size or 1
        return n // size if self.drop_last else math.ceil(n / size)

    def __iter__(self) -> Any:
        sampler = self.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        skipped, n_batches, padding = self._pass_plan()
        self.epoch += 1
        return self._wrapped(super().__iter__(), skipped, n_batches, padding)

    def _pass_plan(self) -> tuple[int, int, int]:
        """(batches skipped, batches, padding duplicates at the end) of the pass about to start (tracked loops)."""
        if self.loop_state is None:
            return 0, 0, 0
        sampler: Any = self.sampler
        skipped = sampler.start_sample // self.samples_per_step if isinstance(sampler, ResumableDistributedSampler) \
            else 0
        padding = sampler.padding() if isinstance(sampler, ResumableDistributedSampler) else 0
        return skipped, self.batches_next_pass(), padding

    def _wrapped(self, it: Any, skipped: int, n_batches: int, padding: int) -> Any:
        if self.loop_state is not None:
            from ._runtime.loop import tracked

            it = tracked(it, self, n_batches, padding, skipped, self.place, self.loop_state)
        return _beating(it, self.heartbeat) if self.heartbeat is not None else it


class FastTensorLoader(PreparedDataLoader):
    """Fast path for in-memory ``TensorDataset``: index whole batches instead of ``__getitem__`` + collate.

    Same sampler (so the same seeded, per-epoch order and the same shard per rank), the same batches
    (``drop_last`` included), the same list-of-tensors structure ``default_collate`` returns, and the same draw
    from the loader's generator (or the global RNG) a DataLoader iterator makes, so training is bit-identical
    to the standard path, just without ~batch_size Python calls per batch.
    """

    def __iter__(self) -> Any:
        sampler: Any = self.sampler
        sampler.set_epoch(self.epoch)
        skipped, n_batches, padding = self._pass_plan()
        self.epoch += 1
        order = torch.as_tensor(list(sampler), dtype=torch.long)
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # what _BaseDataLoaderIter draws
        dataset: Any = self.dataset
        it = _tensor_batches(dataset.tensors, order, self.batch_size or 1, self.drop_last,
                             self.pin_memory and torch.cuda.is_available())
        return self._wrapped(it, skipped, n_batches, padding)


def _beating(batches: Iterator[Any], hb: Any) -> Iterator[Any]:
    """Batches, counting each as a step for the hang watchdog (plain attribute stores: no call, no sync)."""
    for batch in batches:
        hb.step += 1
        hb.phase = "step"
        yield batch
        hb.beats += 1  # the step that used the batch has finished
        hb.phase = "data"


def _tensor_batches(tensors: tuple[torch.Tensor, ...], order: torch.Tensor, batch_size: int, drop_last: bool,
                    pin: bool) -> Iterator[list[torch.Tensor]]:
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        if pin:  # gather straight into page-locked memory (one copy, not two); the caching host allocator
            # keeps each block until the asynchronous host-to-GPU copy that reads it has finished
            yield [torch.index_select(t, 0, idx, out=torch.empty((len(idx), *t.shape[1:]), dtype=t.dtype,
                                                                 pin_memory=True)) for t in tensors]
        else:
            yield [t[idx] for t in tensors]


def _fast_path_ok(loader: DataLoader) -> bool:
    from torch.utils.data import TensorDataset
    from torch.utils.data._utils.collate import default_collate

    return (type(loader.dataset) is TensorDataset and loader.num_workers == 0 and loader.collate_fn is default_collate
            and loader.batch_size is not None and os.environ.get(envvars.FAST_TENSOR_PATH, "1") != "0")


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    kwargs = {name: getattr(loader, name) for name in _COPIED if hasattr(loader, name)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    else:
        kwargs["persistent_workers"] = False
    return kwargs


def _shuffles(loader: DataLoader) -> bool | None:
    """True/False for the samplers we understand, None for a custom one."""
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            return None  # sampling with replacement / a custom num_samples is not a plain shuffle
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    return None


def prepare_dataloader(loader: DataLoader, rank: int, world_size: int, seed: int = 0,
                       pin_memory: bool = False) -> DataLoader:
    """Return a loader that yields this rank's shard; see the module docstring for what is preserved.

    ``pin_memory=True`` (the Accelerator asks for it on CUDA) turns page-locked batches on, so host-to-GPU copies
    run asynchronously; a loader that already pins keeps its own settings.
    """
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"prepare() expected a torch DataLoader, got {type(loader).__name__}")
    dataset = loader.dataset
    kwargs = _loader_kwargs(loader)
    pin = pin_memory and not loader.pin_memory
    if pin:
        kwargs["pin_memory"] = True
    if isinstance(dataset, IterableDataset):
        if world_size == 1:
            return DataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs) \
                if pin and loader.batch_size is not None else loader
        return DataLoader(ShardedIterableDataset(dataset, rank, world_size), batch_size=loader.batch_size,
                          drop_last=loader.drop_last, **kwargs)
    custom_batches = loader.batch_size is None or not isinstance(loader.batch_sampler, BatchSampler) \
        or type(loader.batch_sampler) is not BatchSampler
    if isinstance(loader.sampler, _TorchDistributedSampler):
        sampler = loader.sampler
        if sampler.num_replicas != world_size or sampler.rank != rank:
            raise ConfigError(
                f"the DataLoader already has a DistributedSampler for rank {sampler.rank} of "
                f"{sampler.num_replicas}, but this process is rank {rank} of {world_size}. HINT: pass a plain "
                f"DataLoader (shuffle=True/False) and let prepare() shard it.")
        return PreparedDataLoader(dataset, batch_size=loader.batch_size, sampler=sampler,
                                  drop_last=loader.drop_last, **kwargs)
    shuffle = _shuffles(loader)
    if shuffle is None or custom_batches:
        if world_size == 1:
            return loader
        what = "batch_sampler" if custom_batches else f"sampler {type(loader.sampler).__name__}"
        raise ConfigError(
            f"cannot shard a DataLoader with a custom {what} across {world_size} processes: its order is "
            f"unknown to trainstack. HINT: build the loader with shuffle=True/False and batch_size, or give "
            f"it a torch DistributedSampler(dataset, num_replicas=world_size, rank=rank) yourself.")
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=loader.drop_last)
    cls = FastTensorLoader if _fast_path_ok(loader) else PreparedDataLoader
    return cls(dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last, **kwargs)


def prepare_train(loader: Any, rank: int, world_size: int, seed: int, pin_memory: bool) -> Any:
    """This rank's share of a training loader: every DataLoader (each one of a dict of loaders) sharded with the
    run's seed; anything else passes through."""
    def prepare(dl: Any) -> Any:
        if isinstance(dl, DataLoader):
            return prepare_dataloader(dl, rank, world_size, seed=seed, pin_memory=pin_memory)
        return dl

    return loader.prepared(prepare) if isinstance(loader, DictDataLoader) else prepare(loader)


def generator_seed(loader: DataLoader) -> int:
    """A deterministic seed for the sampler: the loader's generator's initial seed, else 0."""
    gen = getattr(loader, "generator", None)
    return int(gen.initial_seed()) if isinstance(gen, torch.Generator) else 0


class EvalShardSampler(torch.utils.data.Sampler[int]):
    """Indices ``rank, rank + world, ...``: every sample exactly once over all ranks (no padding)."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


def prepare_eval_dataloader(loader: DataLoader, rank: int, world_size: int, ordered: bool = False) -> DataLoader:
    """Shard an evaluation loader without the padding duplicates a DistributedSampler adds. ``ordered`` (predict):
    in dataset order even on one process, rank ``r`` taking samples ``r, r + W, ...``."""
    if (world_size == 1 and not ordered) or loader is None:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        if ordered and world_size > 1:
            raise ConfigError("predict() on several processes needs a map-style dataset (an IterableDataset has no "
                              "order to put the outputs back in). HINT: predict on one process (nprocs=1), or use "
                              "a Dataset with __getitem__.")
        return loader if world_size == 1 else prepare_dataloader(loader, rank, world_size)
    if _shuffles(loader) is None or loader.batch_size is None:
        raise ConfigError("cannot shard an evaluation DataLoader with a custom sampler/batch_sampler without "
                          "duplicates. HINT: build it with batch_size and shuffle=False.")
    sampler = EvalShardSampler(len(loader.dataset), rank, world_size)  # type: ignore[arg-type]
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=False,
                      **_loader_kwargs(loader))


# ---------------------------------------------------------------------------------------------------- qadence helpers
class InfiniteTensorDataset(IterableDataset):
    """Samples of ``tensors`` (equal first dimension) in a fresh random order, forever (qadence's dataset).

    A loader over it has no end: the Trainer takes ``max_batches`` batches from it per epoch (1 when unset, as
    qadence does).
    """

    infinite = True

    def __init__(self, *tensors: torch.Tensor) -> None:
        sizes = {t.size(0) for t in tensors}
        if len(sizes) != 1:
            raise ConfigError(f"InfiniteTensorDataset: every tensor needs the same first dimension, got "
                              f"{[t.size(0) for t in tensors]}.")
        self.tensors = tensors

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        indices = list(range(self.tensors[0].size(0)))
        while True:
            random.shuffle(indices)
            for i in indices:
                yield tuple(t[i] for t in self.tensors)


def to_dataloader(*tensors: torch.Tensor, batch_size: int = 1, infinite: bool = False) -> DataLoader:
    """qadence's helper: a DataLoader over ``tensors`` (no shuffle), endless with ``infinite=True``."""
    from torch.utils.data import TensorDataset

    dataset = InfiniteTensorDataset(*tensors) if infinite else TensorDataset(*tensors)
    return DataLoader(dataset, batch_size=batch_size)


def is_infinite(loader: Any) -> bool:
    """A loader whose dataset says it never ends (``infinite = True``, as ``InfiniteTensorDataset``)."""
    if isinstance(loader, DictDataLoader):
        return all(is_infinite(dl) for dl in loader.dataloaders.values())
    dataset = getattr(loader, "dataset", None)
    while isinstance(dataset, ShardedIterableDataset):
        dataset = dataset.dataset
    return bool(getattr(dataset, "infinite", False))


class DictDataLoader:
    """Batches from several loaders at once: each item is ``{name: batch}``; a pass ends with the shortest loader.

    Under several processes every inner loader is sharded on its own (``prepare`` and ``Trainer.fit`` do it).
    """

    def __init__(self, dataloaders: Mapping[str, Any]) -> None:
        if not isinstance(dataloaders, Mapping) or not dataloaders:
            raise ConfigError(f"DictDataLoader needs a non-empty dict of DataLoaders, got {dataloaders!r}.")
        bad = {k: type(v).__name__ for k, v in dataloaders.items() if not isinstance(v, Iterable)}
        if bad:
            raise ConfigError(f"DictDataLoader: the values must be DataLoaders; {bad} are not iterable.")
        self.dataloaders = dict(dataloaders)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        iterators = {k: iter(v) for k, v in self.dataloaders.items()}
        while True:
            try:
                yield {k: next(it) for k, it in iterators.items()}
            except StopIteration:
                return

    def __len__(self) -> int:
        return min(len(v) for v in self.dataloaders.values())

    @property
    def can_skip(self) -> bool:
        return all(getattr(v, "can_skip", False) for v in self.dataloaders.values())

    @property
    def samples_per_step(self) -> dict[str, int]:
        return {k: v.samples_per_step for k, v in self.dataloaders.items()}

    def set_epoch(self, epoch: int) -> None:
        for v in self.dataloaders.values():
            if hasattr(v, "set_epoch"):
                v.set_epoch(epoch)

    def skip_samples(self, n_samples: dict[str, int]) -> None:
        for k, v in self.dataloaders.items():
            v.skip_samples(n_samples[k])

    def skip_batches(self, n_batches: int) -> None:
        for v in self.dataloaders.values():
            v.skip_batches(n_batches)

    def batches_next_pass(self) -> int:
        return min(v.batches_next_pass() for v in self.dataloaders.values())

    def prepared(self, prepare: Any) -> DictDataLoader:
        """The same dict with every inner loader passed through ``prepare`` (sharding)."""
        return DictDataLoader({k: prepare(v) for k, v in self.dataloaders.items()})


def check_loader(loader: Any, what: str = "training") -> Any:
    """Refuse what is not a loader (a Dataset, a one-shot generator, an empty loader) with the fix; wrap a plain
    dict of loaders into a ``DictDataLoader``."""
    if loader is None:
        return None
    if isinstance(loader, Mapping):
        return DictDataLoader(loader)
    if isinstance(loader, torch.utils.data.Dataset) and not isinstance(loader, DataLoader):
        raise ConfigError(f"the {what} data is a {type(loader).__name__} (a Dataset), not a DataLoader: it would be "
                          f"read one sample at a time and not sharded across processes. HINT: pass "
                          f"DataLoader(dataset, batch_size=..., shuffle=...).")
    if isinstance(loader, Iterator):
        raise ConfigError(f"the {what} data is a one-shot iterator ({type(loader).__name__}): it would be empty after "
                          f"the first epoch. HINT: pass a DataLoader (or any object whose iter() starts a new pass).")
    if not isinstance(loader, Iterable):
        raise ConfigError(f"the {what} data must be a DataLoader, got {type(loader).__name__} ({loader!r:.60}).")
    try:
        empty = len(loader) == 0  # type: ignore[arg-type]
    except TypeError:  # no length: an IterableDataset, decided while iterating
        empty = False
    if empty:
        raise ConfigError(f"the {what} DataLoader has no batches (an empty dataset, or drop_last=True with fewer "
                          f"samples than batch_size). HINT: check the dataset and batch_size.")
    return loader


def batches_per_epoch(loader: Any, max_batches: int | None) -> int | None:
    """Batches in one pass: ``len(loader)`` capped by ``max_batches``; an endless loader gives ``max_batches`` or 1;
    None when the loader has no length (an epoch ends when it is exhausted)."""
    if loader is None:
        return 1
    if is_infinite(loader):
        return max_batches or 1
    try:
        n = len(loader)
    except TypeError:
        return max_batches
    return min(n, max_batches) if max_batches else n


def epoch_batches(loader: Any, start: int = 0, count: int | None = None) -> Iterable[Any]:
    """The batches of one pass after the first ``start`` ones (replayed: a prepared loader jumps instead, see
    ``skip_samples``), at most ``count`` of them. ``loader=None`` gives one ``None`` batch per epoch (qadence:
    ``loss_fn(model, None)``)."""
    if loader is None:
        return (None,)
    if not start and count is None:
        return loader
    return itertools.islice(loader, start, None if count is None else start + count)
