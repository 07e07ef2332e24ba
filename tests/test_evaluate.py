"""Evaluation on one process (the multi-process equality is in tests/distributed): sample-weighted, not batch-weighted,
and batch events count the pass's batches."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Accelerator
from trainstack._train.evaluate import Evaluator, batch_size


def test_an_uneven_last_batch_weighs_by_its_samples():
    x = torch.arange(10, dtype=torch.float32).reshape(-1, 1)
    loader = DataLoader(TensorDataset(x, torch.zeros(10, 1)), batch_size=4)  # batches of 4, 4 and 2
    events = []

    def loss(model, batch):
        inputs, _ = batch
        return inputs.mean(), {"max": inputs.max()}

    evaluate = Evaluator(Accelerator(compute_setup="cpu"), loss, lambda e, i, lo, m: events.append((e, i)))
    out = evaluate("val", nn.Identity(), loader)
    assert abs(out["val_loss"] - 4.5) < 1e-9  # the mean of 0..9, not the mean of the three batch means
    assert abs(out["val_max"] - (3 * 4 + 7 * 4 + 9 * 2) / 10) < 1e-9
    assert [e for e in events if e[0] == "val_batch_end"] == [("val_batch_end", i) for i in (1, 2, 3)]


def test_batch_size_of_nested_batches():
    assert batch_size(torch.zeros(5, 3)) == 5 and batch_size(torch.tensor(1.0)) == 1
    assert batch_size({"x": [torch.zeros(7, 2)], "y": torch.zeros(7)}) == 7 and batch_size(None) == 1
