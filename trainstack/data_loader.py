"""Accelerate's ``accelerate.data_loader`` path: sharding a DataLoader the way Accelerate does -- each process
takes its share of the batches of the user's own loader, in the loader's own order (``prepare_data_loader``,
``DataLoaderShard``, ``BatchSamplerShard``, ``IterableDatasetShard``, ``SeedableRandomSampler``,
``skip_first_batches``). ``Accelerator.prepare`` uses it; the Trainer shards with ``trainstack.data``."""

from ._accelerate.loader import (
    BatchSamplerShard,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)

__all__ = ["prepare_data_loader", "skip_first_batches", "DataLoaderShard", "BatchSamplerShard",
           "IterableDatasetShard", "SeedableRandomSampler", "SkipBatchSampler", "get_sampler"]
