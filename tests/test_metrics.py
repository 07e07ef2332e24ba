"""Epoch sums and logged values: reduced over steps on the device, over ranks only when asked."""

from __future__ import annotations

import math

import pytest
import torch

from trainstack._train.metrics import EpochSums, MetricLog, nonfinite_loss
from trainstack.errors import ConfigError


def test_logged_values_are_reduced_over_the_interval_and_then_start_again():
    log = MetricLog()
    for v in (1.0, 2.0, 6.0):
        log.add("mean", torch.tensor(v))
        log.add("sum", v, reduce="sum")
        log.add("max", torch.tensor(v), reduce="max")
        log.add("min", v, reduce="min")
    assert isinstance(log.current()["mean"], torch.Tensor)  # no host sync until collected
    assert log.collect() == {"mean": 3.0, "sum": 9.0, "max": 6.0, "min": 1.0}
    assert log.collect() == {} and log.current() == {}


def test_only_values_logged_with_sync_dist_are_reduced_over_ranks_one_collective_per_kind():
    calls = []

    def reduce(values, op):
        calls.append((sorted(values), op))
        return {k: v * 10 for k, v in values.items()}

    log = MetricLog()
    log.add("a", 1.0, sync_dist=True)
    log.add("b", 2.0, reduce="max", sync_dist=True)
    log.add("c", 3.0, sync_dist=True)
    log.add("local", 4.0)
    assert log.collect(reduce) == {"a": 10.0, "b": 20.0, "c": 30.0, "local": 4.0}
    assert calls == [(["b"], "max"), (["a", "c"], "mean")]


@pytest.mark.parametrize("args, needle", [(("", 1.0), "non-empty"), (("x", torch.ones(2)), "shape (2,)"),
                                          (("x", "high"), "must be a number"), (("x", True), "must be a number"),
                                          (("x", 1.0, "median"), "reduce='median'")])
def test_bad_logged_values_name_the_fix(args, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        MetricLog().add(*args)


def test_epoch_sums_continue_a_resumed_epoch_and_flag_a_nonfinite_loss():
    sums = EpochSums({"loss_sum": torch.tensor(3.0), "sums": {"acc": torch.tensor(1.0)}})
    sums.add(torch.tensor(1.0), {"acc": torch.tensor(1.0)})
    means = sums.means("train", 2)
    assert float(means["train_loss"]) == 2.0 and float(means["train_acc"]) == 1.0
    assert nonfinite_loss({"train_loss": torch.tensor(math.nan)}) and not nonfinite_loss({"train_loss": 1.0})
