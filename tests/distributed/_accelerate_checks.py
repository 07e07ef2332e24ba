"""Accelerate's behaviours, checked on trainstack with 2 processes -- the same behaviours Accelerate's own test
scripts check (test_script, test_sync, test_ops, test_distributed_data_loop), written here as our own checks.

Run under ``torchrun --nproc_per_node 2 _accelerate_checks.py`` or ``python _accelerate_checks.py --spawn``
(notebook_launcher); every process prints ``CHECK <name> ok`` or ``CHECK <name> FAIL <why>``."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, TensorDataset

from trainstack import Accelerator, PartialState
from trainstack.data_loader import SeedableRandomSampler, prepare_data_loader, skip_first_batches
from trainstack.local_sgd import LocalSGD
from trainstack.state import AcceleratorState, GradientState
from trainstack.utils import (
    DataLoaderConfiguration,
    DistributedOperationException,
    DistributedType,
    GradientAccumulationPlugin,
    broadcast,
    find_executable_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    set_seed,
    synchronize_rng_states,
)

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


class Line(nn.Module):
    """y = a * x + b: the smallest model whose result shows a different data order."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))
        self.b = nn.Parameter(torch.tensor(-0.3))

    def forward(self, x):
        return self.a * x + self.b


class Points(Dataset):
    def __init__(self, n, seed=7):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, generator=g)
        self.y = 2 * self.x + 3 + 0.1 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _same_everywhere(t):
    everyone = gather(t[None].clone())
    return all(torch.equal(everyone[i], t) for i in range(everyone.shape[0]))


# --------------------------------------------------------------------------------- 1: joined at construction
@check
def joined_before_prepare():
    acc = Accelerator()
    assert acc.gather(torch.tensor([acc.process_index])).tolist() == list(range(acc.num_processes))
    shared = Path(tempfile.gettempdir()) / f"ts-first-{os.environ.get('CHECK_RUN', 'x')}"
    with acc.main_process_first():
        if acc.is_main_process:
            time.sleep(0.3)
            shared.write_text("written by the main process")
        else:
            assert shared.read_text() == "written by the main process", "main_process_first was not first"
    acc.wait_for_everyone()
    if acc.is_main_process:
        shared.unlink()


# --------------------------------------------------------------------------------- 2: the loader's own order
def _train(acc, loader, model, steps_per_epoch_check=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if acc is not None:
        loader, model, optimizer = acc.prepare(loader, model, optimizer)
    for _ in range(3):
        for batch in loader:
            model.zero_grad()
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            (acc.backward(loss) if acc is not None else loss.backward())
            optimizer.step()
    return acc.unwrap_model(model) if acc is not None else model


def _loader(data, batch_size, generator, seedable=False):
    if seedable:
        return DataLoader(data, batch_size=batch_size, sampler=SeedableRandomSampler(data, generator=generator))
    return DataLoader(data, batch_size=batch_size, shuffle=True, generator=generator)


@check
def shuffled_loader_keeps_its_own_order():
    n = PartialState().num_processes
    data = Points(8 * 4 * n)
    for seedable in (False, True):
        for split in (False, True):
            generator = torch.Generator()
            set_seed(42)
            generator.manual_seed(42)
            alone = _train(None, _loader(data, 8 * n, generator, seedable), Line())
            acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split,
                                                                        use_seedable_sampler=seedable))
            loader = _loader(data, 8 * n if split else 8, generator, seedable)
            set_seed(42)
            generator.manual_seed(42)
            together = _train(acc, loader, Line())
            torch.testing.assert_close(together.a.detach(), alone.a.detach(), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(together.b.detach(), alone.b.detach(), atol=1e-6, rtol=1e-6)


@check
def sharded_batches_cover_the_data():
    state = PartialState()
    length = 32 * state.num_processes
    for split in (False, True):
        for shuffle in (False, True):
            dl = prepare_data_loader(DataLoader(range(length), batch_size=8, shuffle=shuffle), state.device,
                                     state.num_processes, state.process_index, put_on_device=True,
                                     split_batches=split)
            seen = torch.cat([gather(b) for b in dl]).tolist()
            assert (sorted(seen) if shuffle else seen) == list(range(length)), (split, shuffle, seen)


@check
def even_and_uneven_batches():
    n, me = PartialState().num_processes, PartialState().process_index
    for even, sizes in ((True, ([1, 1], [1, 1])), (False, ([1, 1], [1]))):
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even))
        dl = acc.prepare(DataLoader(TensorDataset(torch.arange(3)), batch_size=1))
        assert [len(b[0]) for b in dl] == sizes[me], (even, me)
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    model = acc.prepare(nn.Linear(1, 1))
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(3.0)), batch_size=1))
    seen = []
    with acc.join_uneven_inputs([model]):  # rank 0 runs one more backward than rank 1: Join shadows it
        for i, (x,) in enumerate(dl):
            model(x[:, None]).sum().backward()
            seen.append(i)
    assert seen == ([0, 1] if me == 0 else [0]) or n == 1


@check
def seedable_sampler_replays_an_epoch():
    set_seed(42)
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    dl = acc.prepare(DataLoader(Points(10), batch_size=2, shuffle=True))
    first = torch.cat([b["x"] for _ in range(3) for b in dl])
    set_seed(42)
    dl.set_epoch(0)
    again = torch.cat([b["x"] for _ in range(3) for b in dl])
    assert torch.equal(first, again)
    other = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=43))
    dl43 = other.prepare(DataLoader(Points(10), batch_size=2, shuffle=True))
    assert not torch.equal(first, torch.cat([b["x"] for _ in range(3) for b in dl43]))


@check
def custom_batch_sampler_is_kept():
    class Halves:
        batch_size = 8

        def __init__(self, n):
            self.n = n

        def __iter__(self):
            order = torch.randperm(self.n).tolist()
            yield from (order[i:i + 8] for i in range(0, self.n, 8))

        def __len__(self):
            return math.ceil(self.n / 8)

    state = PartialState()
    length = 32 * state.num_processes
    dl = prepare_data_loader(DataLoader(range(length), batch_sampler=Halves(length)))
    inner = getattr(dl.batch_sampler, "batch_sampler", dl.batch_sampler)
    assert isinstance(inner, Halves)


@check
def iterable_dataset_is_sharded():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(22)

    acc = Accelerator()
    dl = acc.prepare(DataLoader(Stream(), batch_size=4))
    seen = torch.cat([acc.gather(b) for b in dl]).tolist()
    assert set(seen) == set(range(22))


@check
def gather_for_metrics_counts_each_sample_once():
    acc = Accelerator()
    data = TensorDataset(torch.arange(22))
    for loader in (DataLoader(data, batch_size=4), DataLoader(data, batch_size=4, shuffle=True),
                   DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, False))):
        dl = acc.prepare(loader)
        seen = []
        for (x,) in dl:
            seen += acc.gather_for_metrics(x).tolist()
        assert sorted(seen) == list(range(22)), seen
        objects = []
        for (x,) in dl:
            objects += acc.gather_for_metrics([int(v) for v in x], use_gather_object=True)
        assert sorted(objects) == list(range(22))


# --------------------------------------------------------------------------------- 3: options and nested data
@check
def argparse_defaults_and_nested_collectives():
    acc = Accelerator(mixed_precision=None)  # every by_feature example's argparse default
    assert acc.mixed_precision == "no"
    me, n = acc.process_index, acc.num_processes
    t = torch.tensor([float(me)])
    gathered = acc.gather((t, {"k": t + 10}))
    assert gathered[0].tolist() == [float(i) for i in range(n)]
    assert gathered[1]["k"].tolist() == [10.0 + i for i in range(n)]
    assert acc.reduce(torch.tensor([1.0 + me, 5.0 - me]), "max").tolist() == [float(n), 5.0]
    assert acc.reduce({"v": torch.tensor([1.0 + me])}, "sum")["v"].item() == sum(1.0 + i for i in range(n))
    assert acc.reduce(torch.tensor([float(me)]), "min").item() == 0.0
    assert broadcast({"v": torch.tensor([float(me)])})["v"].item() == 0.0
    assert gather_object([me]) == list(range(n))
    folder = broadcast_folder(acc)
    os.environ.update({"MLFLOW_TRACKING_URI": f"file://{folder}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true",
                       "WANDB_MODE": "disabled"})
    if True:
        logged = Accelerator(log_with="all", project_dir=folder)
        logged.init_trackers("run")
        logged.log({"loss": 1.5}, step=1)
        logged.end_training()
        if logged.is_main_process:
            assert "1.5" in (Path(folder) / "run" / "metrics.jsonl").read_text()
        logged.wait_for_everyone()


@check
def operations_over_processes():
    state = PartialState()
    n, me = state.num_processes, state.process_index
    tensor = torch.arange(n) + 1.0 + n * me
    assert gather(tensor).tolist() == [float(i) for i in range(1, n * n + 1)]
    assert broadcast(tensor).tolist() == [float(i) for i in range(1, n + 1)]
    padded = pad_across_processes(torch.arange(n + 1) if me == 0 else torch.arange(n))
    assert padded.shape == (n + 1,)
    gather(torch.arange(12).view(4, 3).t())  # not contiguous: must not fail
    if n > 1:
        state.debug = True
        with contextlib.suppress(DistributedOperationException):
            reduce({"t": torch.zeros(1, 5) if me == 0 else torch.zeros(1, 2, 5)})
            raise AssertionError("mismatched shapes under debug were not named")
        state.debug = False


@check
def rng_states_are_synchronised():
    torch.manual_seed(PartialState().process_index)
    synchronize_rng_states(["torch"])
    assert _same_everywhere(torch.get_rng_state())
    generator = torch.Generator().manual_seed(100 + PartialState().process_index)
    synchronize_rng_states(["generator"], generator=generator)
    assert _same_everywhere(generator.get_state())


# --------------------------------------------------------------------------------- 4: the surface scripts use
@check
def state_and_process_helpers():
    acc = Accelerator()
    state = acc.state
    n, me = state.num_processes, state.process_index
    assert isinstance(state, AcceleratorState) and acc.gradient_state is not None
    assert acc.distributed_type == (DistributedType.MULTI_CPU if n > 1 else DistributedType.NO)
    assert acc.use_distributed == (n > 1) and acc.is_last_process == (me == n - 1)

    @acc.on_main_process
    def only_main():
        return "main"

    assert only_main() == ("main" if me == 0 else None)
    with acc.split_between_processes(list(range(2 * n - 1)), apply_padding=True) as mine:
        assert len(mine) == 2
    assert gather_object(mine)[: 2 * n - 1] == list(range(2 * n - 1))
    with acc.split_between_processes({"a": list(range(8)), "c": torch.arange(8)}) as share:
        assert share["a"] == list(range(8))[me * 8 // n:(me + 1) * 8 // n]
    assert acc.check_trigger() is False
    if acc.is_main_process:
        acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False


@check
def no_sync_and_trigger_sync_in_backward():
    acc = Accelerator()
    if acc.num_processes == 1:
        return
    model = acc.prepare(nn.Linear(2, 1))
    x = torch.full((4, 2), float(acc.process_index + 1))
    with acc.no_sync(model):
        model(x).sum().backward()
    local = model.module.weight.grad.clone()
    assert not _same_everywhere(local), "no_sync synchronised the gradients"
    model.zero_grad()
    losses = []
    with acc.no_sync(model):
        losses = [model(x).sum() for _ in range(2)]
    acc.backward(losses[0])
    with acc.trigger_sync_in_backward(model):
        acc.backward(losses[1])
    assert _same_everywhere(model.module.weight.grad), "the last backward did not synchronise"


@check
def accumulation_syncs_on_the_boundary_and_the_last_batch():
    plugin = GradientAccumulationPlugin(num_steps=2)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    model = acc.prepare(nn.Linear(1, 1))
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(10.0)[:, None]), batch_size=1))
    synced = []
    for i, (x,) in enumerate(dl):
        with acc.accumulate(model):
            acc.backward(model(x * (acc.process_index + 1)).sum())
            synced.append(acc.sync_gradients)
            assert acc.gradient_state.end_of_dataloader == (i == len(dl) - 1)
        model.zero_grad() if acc.sync_gradients else None
    assert synced == [(i + 1) % 2 == 0 or i == len(dl) - 1 for i in range(len(dl))]
    assert acc.gradient_state.active_dataloader is None
    GradientState._reset_state()


@check
def save_state_resumes_mid_pass():
    acc = Accelerator()
    folder = broadcast_folder(acc)
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, shuffle=True))
    after = []
    for step, (x,) in enumerate(dl):
        if step == 2:
            acc.save_state(folder)
        if step > 2:
            after.append(x)
    acc.load_state(folder)
    resumed = [x for (x,) in dl]
    assert len(resumed) == len(after) and all(torch.equal(a, b) for a, b in zip(after, resumed, strict=True))
    acc.wait_for_everyone()


def broadcast_folder(acc):
    holder = [tempfile.mkdtemp(prefix="ts-state-") if acc.is_main_process else None]
    from trainstack.utils import broadcast_object_list

    broadcast_object_list(holder)
    return holder[0]


@check
def skip_first_batches_and_local_sgd():
    acc = Accelerator()
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(16.0)), batch_size=2))
    full = [x for (x,) in dl]
    skipped = [x for (x,) in skip_first_batches(dl, 2)]
    assert len(skipped) == len(full) - 2 and torch.equal(skipped[0], full[2])
    model = acc.prepare(nn.Linear(1, 1))
    with LocalSGD(acc, model, local_sgd_steps=2) as local_sgd:
        for _ in range(2):
            model(torch.full((2, 1), float(acc.process_index + 1))).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            model.zero_grad()
            local_sgd.step()
    assert _same_everywhere(model.module.weight.detach()), "LocalSGD did not average the parameters"


@check
def find_executable_batch_size_halves_on_out_of_memory():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def run(batch_size):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert run() == 16 and tried == [64, 32, 16]


@check
def a_reset_state_is_a_clear_error():
    AcceleratorState._reset_state()
    acc = Accelerator()
    AcceleratorState._reset_state()
    try:
        acc.prepare(nn.Linear(1, 1))
    except AttributeError as exc:
        assert "AcceleratorState._reset_state()" in str(exc)
    else:
        raise AssertionError("a reset state went unnoticed")
    AcceleratorState._reset_state()
    Accelerator()  # a new one describes the process again


@check
def pickled_accelerator_keeps_its_state():
    import pickle

    acc = Accelerator()
    acc.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    again = pickle.loads(pickle.dumps(acc))
    assert again.state.__dict__ == acc.state.__dict__


def _say(line: str) -> None:
    """Print the verdict and, where CHECK_RESULTS names a file, append it there as one write: two processes
    sharing a pipe can splice their lines (a rank's "ok" ran into the other's log line), a one-line O_APPEND
    write cannot be split."""
    print(line, flush=True)
    if os.environ.get("CHECK_RESULTS"):
        fd = os.open(os.environ["CHECK_RESULTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def main():
    failed = 0
    for fn in CHECKS:
        warnings.simplefilter("ignore")
        try:
            fn()
            _say(f"CHECK {fn.__name__} ok")
        except Exception as exc:  # noqa: BLE001  (every check reports; the test reads the lines)
            failed += 1
            why = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]
            _say(f"CHECK {fn.__name__} FAIL {why}")
            traceback.print_exc()
    return failed


if __name__ == "__main__":
    if "--spawn" in sys.argv:
        from trainstack import notebook_launcher

        sys.exit(1 if notebook_launcher(main, num_processes=2) else 0)
    sys.exit(1 if main() else 0)
