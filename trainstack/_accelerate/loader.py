"""Accelerate's way of sharding a DataLoader: the user's own batch sampler decides the order, and each process
takes its share of the batches it yields (or of each batch, ``split_batches``). The sampler's generator is
synchronised from process 0 at the start of every pass, so N processes see exactly the batches one process would
(the same model comes out of 1 process at batch size B*N and N processes at B).

``DataLoaderShard`` also keeps what a loop asks of its loader: which batch is the last (``end_of_dataloader``), how
many real samples the last global batch holds (``remainder``, for ``gather_for_metrics``), where a pass stands
(``state_dict``, ``save_state``), and a resumed pass starting ``n`` batches in without loading them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from .._runtime import loop as _loop
from ..errors import ConfigError
from .ops import send_to_device, synchronize_rng_states
from .state import GradientState, PartialState

__all__ = ["SeedableRandomSampler", "BatchSamplerShard", "IterableDatasetShard", "DataLoaderShard",
           "prepare_data_loader", "skip_first_batches", "SkipBatchSampler"]

# the DataLoader settings a prepared loader keeps (the sampling ones are replaced by the shard's batch sampler)
_KEPT = {"num_workers": 0, "collate_fn": None, "pin_memory": False, "timeout": 0, "worker_init_fn": None,
         "multiprocessing_context": None, "generator": None, "prefetch_factor": None, "persistent_workers": False,
         "pin_memory_device": "", "in_order": True}


class SeedableRandomSampler(RandomSampler):
    """A random sampler whose order is a function of (seed, epoch): every process draws the same permutation, and
    ``set_epoch(e)`` replays pass ``e``. The seed is ``data_seed``, else torch's initial seed."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class BatchSamplerShard(BatchSampler):
    """One process's batches of ``batch_sampler``: batch ``i`` of every ``num_processes`` consecutive ones, or
    with ``split_batches`` slice ``i`` of every batch. ``even_batches`` (default) completes the last group from the
    start of the pass so every process gets the same number of equal-sized batches (a collective never waits on a
    process that ran out); without it the last group is uneven and nothing is repeated. One process: the batches
    unchanged."""

    def __init__(self, batch_sampler: Any, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes, self.process_index = num_processes, process_index
        self.split_batches, self.even_batches = split_batches, even_batches
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)  # type: ignore[assignment]
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        self.skip = 0  # batches the next pass leaves out (a resumed pass), then back to 0
        if split_batches and (self.batch_size is None or self.batch_size % num_processes):
            raise ConfigError(f"split_batches=True needs a batch size that is a multiple of the number of processes "
                              f"({num_processes}); the batch sampler's is {self.batch_size}. HINT: use a batch size "
                              f"of {num_processes * max(1, (self.batch_size or 1) // num_processes)}, or "
                              f"split_batches=False (each process takes whole batches).")

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if self.split_batches or self.num_processes == 1:
            return n
        full, rest = divmod(n, self.num_processes)
        if not rest or self.drop_last:
            return full
        return full + 1 if self.even_batches or self.process_index < rest else full

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._split() if self.split_batches else self._whole()
        skip, self.skip = self.skip, 0
        for i, batch in enumerate(batches):
            if i >= skip:
                yield batch

    def _whole(self) -> Iterator[list[int]]:
        n, me, size = self.num_processes, self.process_index, self.batch_size
        if n == 1:
            yield from self.batch_sampler
            return
        first: list[Any] = []  # the pass's first batches, what an even last group is completed with
        group: list[Any] = []
        for batch in self.batch_sampler:
            if len(first) < n:
                first.append(list(batch))
            group.append(list(batch))
            if len(group) == n:
                if size is None or len(group[-1]) == size:
                    yield group[me]
                    group = []
                else:  # a short last batch closes the pass: complete it below
                    break
        if not group or self.drop_last:
            return
        if not self.even_batches:
            if me < len(group):
                yield group[me]
            return
        if size is None:  # batches of any length: whole batches from the start of the pass
            cycle = [first[i % len(first)] for i in range(n - len(group))]
            yield (group + cycle)[me]
            return
        flat = [i for b in group for i in b]
        filler = [i for b in first for i in b]
        need = n * size - len(flat)
        flat += (filler * math.ceil(need / len(filler)))[:need]
        yield flat[me * size:(me + 1) * size]

    def _split(self) -> Iterator[list[int]]:
        size, me = self.batch_size or 1, self.process_index
        part = size // self.num_processes
        first: list[int] = []
        last: list[int] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            first = first or batch
            if len(batch) == size:
                yield batch[part * me:part * (me + 1)]
            else:
                last = batch
        if not last or self.drop_last:
            return
        if not self.even_batches:
            if len(last) > part * me:
                yield last[part * me:part * (me + 1)]
            return
        need = size - len(last)
        last += (first * math.ceil(need / len(first)))[:need]
        yield last[part * me:part * (me + 1)]


class IterableDatasetShard(IterableDataset):
    """One process's samples of an iterable dataset: of every ``batch_size * num_processes`` consecutive samples
    (``batch_size`` with ``split_batches``) this process takes its contiguous slice; a short tail is completed
    from the first samples unless ``drop_last``."""

    def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False) -> None:
        if split_batches and batch_size > 1 and batch_size % num_processes:
            raise ConfigError(f"split_batches=True needs a batch size that is a multiple of the number of processes "
                              f"({num_processes}); got {batch_size}.")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.num_processes, self.process_index, self.split_batches = num_processes, process_index, split_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        per = self.batch_size * self.num_processes
        groups = len(self.dataset) // per if self.drop_last else math.ceil(len(self.dataset) / per)
        return groups * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        gen = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(gen, torch.Generator):
            gen.manual_seed(self.epoch)
        group = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        mine = (self.batch_size // self.num_processes) if self.split_batches else self.batch_size
        lo, hi = self.process_index * mine, (self.process_index + 1) * mine
        first: list[Any] | None = None
        current: list[Any] = []
        for item in self.dataset:
            current.append(item)
            if len(current) == group:
                yield from current[lo:hi]
                first = first or list(current)
                current = []
        if current and not self.drop_last:
            filler = first or list(current)
            while len(current) < group:
                current += filler
            yield from current[lo:hi]


class _WholeBatches(torch.utils.data.TensorDataset):
    """A TensorDataset that the loader indexes by a whole batch at once (one gather per tensor instead of a Python
    call and a collate per sample): the same batches, much less work per step."""

    def __getitems__(self, indices: Sequence[int]) -> Any:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return _Collated([t[idx] for t in self.tensors])


class _Collated(list[Any]):
    """A batch already in the form ``default_collate`` would give."""


def _collate_whole(batch: Any) -> Any:
    from torch.utils.data._utils.collate import default_collate

    return list(batch) if isinstance(batch, _Collated) else default_collate(batch)


class DataLoaderShard(DataLoader):
    """A DataLoader over this process's shard that moves each batch to ``device``, synchronises ``rng_types`` at the
    start of every pass, tells the loop which batch is the last, and can resume a pass mid-way."""

    def __init__(self, dataset: Any, device: torch.device | None = None, rng_types: list[str] | None = None,
                 synchronized_generator: torch.Generator | None = None, skip_batches: int = 0,
                 _drop_last: bool = False, _non_blocking: bool = False, place: Callable[[Any], Any] | None = None,
                 **kwargs: Any) -> None:
        if _fast_path(dataset, kwargs):  # whole batches at once: the same batches, the same generator draws
            dataset, kwargs = _WholeBatches(*dataset.tensors), {**kwargs, "collate_fn": _collate_whole}
        super().__init__(dataset, **kwargs)
        self.device, self.rng_types, self.synchronized_generator = device, rng_types, synchronized_generator
        self.skip_batches, self._drop_last, self._non_blocking = skip_batches, _drop_last, _non_blocking
        self.place = place
        self.gradient_state = GradientState()
        self.iteration = 0
        self.end_of_dataloader, self.remainder = False, -1
        self.position = 0  # batches of the current pass yielded so far
        self._pass_generator: torch.Tensor | None = None  # the synchronised generator at the pass's start
        self.heartbeat: Any = None

    @property
    def shard_sampler(self) -> Any:
        """The batch sampler this loader iterates (a ``BatchSampler`` given as ``sampler`` included)."""
        return self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        if self.synchronized_generator is not None:
            self._pass_generator = self.synchronized_generator.get_state()
        self._begin()
        self.set_epoch(self.iteration)
        skip, self.skip_batches = self.skip_batches, 0
        shard = self.shard_sampler
        skipped_in_sampler = 0
        if isinstance(shard, BatchSamplerShard) and skip:
            shard.skip, skipped_in_sampler, skip = skip, skip, 0
        state = _loop.STATE
        it = super().__iter__()
        self.position = skipped_in_sampler
        try:
            current = next(it)
        except StopIteration:
            self._end()
            return
        index = 0
        while True:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self._non_blocking)
            elif self.place is not None:
                current = self.place(current)
            try:
                upcoming = next(it)
            except StopIteration:
                upcoming = None
                self.end_of_dataloader = True
            if index >= skip:
                if state.pending is not None:  # load_state's RNG restore, after the new iterator's draws
                    pending, state.pending = state.pending, None
                    pending()
                state.batch_yielded(self.end_of_dataloader, 0)
                self.position += 1
                if self.heartbeat is not None:
                    self.heartbeat.step += 1
                yield current
                if self.heartbeat is not None:
                    self.heartbeat.beats += 1
            index += 1
            if upcoming is None:
                break
            current = upcoming
        self.iteration += 1
        self.position = 0
        state.end_of_loader = False
        self._end()

    def _begin(self) -> None:
        self.end_of_dataloader, self.remainder = False, -1
        if not self._drop_last:
            try:
                data: Any = self.dataset
                length = getattr(data, "total_dataset_length", None) or len(data)
                self.remainder = length % self.total_batch_size
            except TypeError:  # an iterable dataset without a length
                pass
        self.gradient_state._add_dataloader(self)

    def _end(self) -> None:
        self.gradient_state._remove_dataloader(self)

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch``'s order next (the sampler's and the dataset's ``set_epoch`` are called)."""
        self.iteration = epoch
        shard = self.shard_sampler
        for obj in (shard, getattr(shard, "sampler", None), getattr(getattr(shard, "batch_sampler", None),
                                                                    "sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                if obj is not shard:
                    return
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The pass under way, or the next one between passes (Accelerate's ``iteration``)."""
        return self.iteration

    @property
    def total_batch_size(self) -> int:
        shard = self.shard_sampler
        size = getattr(shard, "batch_size", None) or self.batch_size or 1
        return size if getattr(shard, "split_batches", False) else size * getattr(shard, "num_processes", 1)

    @property
    def total_dataset_length(self) -> int:
        data: Any = self.dataset
        return getattr(data, "total_length", None) or len(data)

    def get_sampler(self) -> Any:
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        shard = self.shard_sampler
        if isinstance(shard, BatchSamplerShard):
            shard.batch_sampler.sampler = sampler
        elif isinstance(shard, BatchSampler):
            shard.sampler = sampler

    # ---------------------------------------------------------------- where a pass stands
    def state_dict(self) -> dict[str, Any]:
        """The pass under way (``iteration``), the batches of it already yielded and the synchronised generator at
        its start: ``load_state_dict`` makes the next pass continue right after them."""
        state: dict[str, Any] = {"iteration": self.iteration, "position": self.position}
        if self._pass_generator is not None:
            state["generator"] = self._pass_generator.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = int(state.get("position", 0))
        self.iteration = int(state.get("iteration", 0))
        if position and position >= _length(self):  # the pass had ended: the next one starts afresh
            self.iteration, position = self.iteration + 1, 0
        self.skip_batches = position
        generator = state.get("generator")
        if position and generator is not None and self.synchronized_generator is not None:
            self.synchronized_generator.set_state(generator)
            if self.rng_types:  # the restored state is the pass's start: do not draw a new one over it
                self.rng_types = [r for r in self.rng_types if r != "generator"] + ["generator"]


def _kept_settings(dataloader: DataLoader) -> dict[str, Any]:
    """The loader's settings a prepared copy keeps (the sampling ones are the shard's)."""
    kwargs: dict[str, Any] = {k: getattr(dataloader, k, default) for k, default in _KEPT.items()
                              if hasattr(dataloader, k)}
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return kwargs


def _length(loader: DataLoader) -> float:
    """Batches per pass, or infinity for an iterable dataset without a length."""
    try:
        return len(loader)
    except TypeError:
        return math.inf


def _fast_path(dataset: Any, kwargs: dict[str, Any]) -> bool:
    from torch.utils.data import TensorDataset
    from torch.utils.data._utils.collate import default_collate

    return (type(dataset) is TensorDataset and kwargs.get("collate_fn") in (None, default_collate)
            and kwargs.get("batch_sampler") is not None)


def get_sampler(dataloader: Any) -> Any:
    """The sampler under a loader's batch sampler (or the loader's own)."""
    batch_sampler = dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else getattr(
        dataloader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None)


_NOT_SUPPORTED = {
    "dispatch_batches": "process 0 reading every batch and sending each process its share (dispatch_batches=True); "
                        "every process reads its own shard of the same order, with the same result. HINT: leave it "
                        "unset",
    "torch_device_mesh": "sharding data by a device mesh (tensor/context parallel ranks). HINT: prepare the loader "
                         "for the data-parallel ranks only",
}


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list[str] | None = None, dispatch_batches: bool | None = None,
                        even_batches: bool = True, slice_fn_for_dispatch: Any = None,
                        use_seedable_sampler: bool = False, data_seed: int | None = None,
                        non_blocking: bool = False, use_stateful_dataloader: bool = False,
                        torch_device_mesh: Any = None, pin_memory: bool = False) -> DataLoaderShard:
    """This process's share of ``dataloader`` (Accelerate's ``prepare_data_loader``); see the module docstring.
    ``pin_memory``: page-locked batches (asynchronous host-to-GPU copies) even if the loader did not ask."""
    _refuse(dataloader, dispatch_batches=dispatch_batches, torch_device_mesh=torch_device_mesh)
    state = PartialState()
    n = state.num_processes if num_processes is None else num_processes
    me = state.process_index if process_index is None else process_index
    dataset = dataloader.dataset
    sampler_is_batches = isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = dataloader.sampler if sampler_is_batches else dataloader.batch_sampler
    if split_batches:
        _check_split(dataloader.batch_size if dataloader.batch_size is not None
                     else getattr(batch_sampler, "batch_size", None), n)
    sampler = get_sampler(dataloader)
    synchronized = None
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        sampler = SeedableRandomSampler(data_source=sampler.data_source, replacement=sampler.replacement,
                                        num_samples=sampler._num_samples, generator=sampler.generator,
                                        data_seed=data_seed)
        if type(batch_sampler) is BatchSampler:  # a copy: the user's loader keeps its own sampler
            batch_sampler = BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    kwargs = _kept_settings(dataloader)
    kwargs["pin_memory"] = kwargs.get("pin_memory") or pin_memory
    if isinstance(dataset, IterableDataset):
        if n > 1:
            gen = getattr(dataset, "generator", None)
            synchronized = gen if isinstance(gen, torch.Generator) else None
            dataset = IterableDatasetShard(dataset, batch_size=dataloader.batch_size or 1,
                                           drop_last=dataloader.drop_last, num_processes=n, process_index=me,
                                           split_batches=split_batches)
        size = dataloader.batch_size // n if split_batches and dataloader.batch_size else dataloader.batch_size
        loader_args: dict[str, Any] = {"batch_size": size, "drop_last": dataloader.drop_last}
    else:
        if not use_seedable_sampler and hasattr(sampler, "generator"):
            if sampler.generator is None and n > 1:  # one order for every process: a generator synced from 0
                sampler.generator = torch.Generator()
                sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            synchronized = sampler.generator
        shard = BatchSamplerShard(batch_sampler, num_processes=n, process_index=me, split_batches=split_batches,
                                  even_batches=even_batches)
        # a BatchSampler given as the loader's sampler stays its sampler (the dataset takes lists of indices)
        loader_args = {"sampler": shard, "batch_size": dataloader.batch_size} if sampler_is_batches else {
            "batch_sampler": shard}
    if rng_types is not None and synchronized is None:
        rng_types = [r for r in rng_types if r != "generator"]
    prepared = DataLoaderShard(dataset, device=device if put_on_device else None, rng_types=rng_types,
                               synchronized_generator=synchronized, _drop_last=dataloader.drop_last,
                               _non_blocking=non_blocking, **loader_args, **kwargs)
    if isinstance(sampler, SeedableRandomSampler) and use_seedable_sampler:
        prepared.set_sampler(sampler)
    return prepared


def _refuse(dataloader: Any, **options: Any) -> None:
    for name, value in options.items():
        if value:
            raise ConfigError(f"prepare_data_loader({name}=...) is not supported by trainstack: "
                              f"{_NOT_SUPPORTED[name]}.")
    if not isinstance(dataloader, DataLoader):
        raise ConfigError(f"prepare_data_loader() takes a torch DataLoader, got {type(dataloader).__name__}.")


def _check_split(size: int | None, n: int) -> None:
    """``split_batches`` cuts every batch into ``n`` equal slices."""
    if size is None:
        raise ConfigError("split_batches=True needs a batch size: the DataLoader's batch_size is None and its "
                          "batch sampler has no batch_size attribute.")
    if size > 1 and size % n:
        raise ConfigError(f"split_batches=True needs a batch size that is a multiple of the number of processes "
                          f"({n}); the DataLoader's is {size}. HINT: use batch_size={n * max(1, size // n)}.")


class SkipBatchSampler(BatchSampler):
    """``batch_sampler`` without its first ``skip_batches`` batches."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        self.batch_sampler, self.skip_batches = batch_sampler, skip_batches

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip_batches


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """``dataloader`` whose next pass starts ``num_batches`` batches in (the skipped ones are not loaded); a
    prepared loader is the same object, a plain DataLoader a new one over the same data."""
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ConfigError(f"skip_first_batches(num_batches={num_batches!r}): must be an integer >= 0.")
    if isinstance(dataloader, DataLoaderShard):
        dataloader.skip_batches = num_batches
        return dataloader
    if hasattr(dataloader, "skip_batches") and callable(dataloader.skip_batches):  # trainstack's own loaders
        dataloader.skip_batches(num_batches)
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise ConfigError(f"skip_first_batches() takes a DataLoader, got {type(dataloader).__name__}.")
    if isinstance(dataloader.dataset, IterableDataset):
        raise ConfigError("skip_first_batches() of a plain DataLoader over an iterable dataset: prepare it first "
                          "(accelerator.prepare), or skip the batches in your loop.")
    kwargs = _kept_settings(dataloader)
    return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
                      **kwargs)
