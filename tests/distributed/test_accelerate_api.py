"""HF Accelerate's everyday loop API on real gloo processes: seed 003's function under notebook_launcher with only
the import changed, accumulate (gradient syncs counted), gather_for_metrics on 1/2/3 processes, save_state/
load_state resuming bitwise mid-epoch, a prepared scheduler sized on the unsharded loader, bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from psutil_free import own_children
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Accelerator, notebook_launcher
from trainstack.errors import ConfigError
from trainstack.utils import GradientAccumulationPlugin

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]
device = "cpu"  # seed 003's evaluation loop reads a module-level `device`


# ---------------------------------------------------------------------------------------------- seed 003
class BasicNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.log_softmax(self.fc1(torch.flatten(x, 1)), dim=1)


def _mnist_like(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 1, 28, 28, generator=g) * 0.3
    for i, label in enumerate(labels.tolist()):
        images[i, 0, 2 + 2 * label: 4 + 2 * label, :] += 1.0
    return TensorDataset(images, labels)


def train_ddp_accelerate():
    """Seed 003's function; datasets.MNIST(...) replaced by synthetic data (no download here)."""
    accelerator = Accelerator(device_placement=True)
    train_dset, test_dset = _mnist_like(512, 0), _mnist_like(130, 1)
    train_loader = torch.utils.data.DataLoader(train_dset, shuffle=True, batch_size=64)
    test_loader = torch.utils.data.DataLoader(test_dset, shuffle=False, batch_size=64)
    model = BasicNet()
    optimizer = optim.AdamW(model.parameters(), lr=1e-3)
    train_loader, test_loader, model, optimizer = accelerator.prepare(train_loader, test_loader, model, optimizer)
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):  # noqa: B007  (the seed, verbatim)
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    print(f'Accuracy: {100. * correct / len(test_loader.dataset)}')
    return accelerator.num_processes, len(train_loader)


def test_seed_003_accelerate_function_runs_under_notebook_launcher(capfd):
    world, batches = notebook_launcher(train_ddp_accelerate, args=(), num_processes=2)
    assert world == 2 and batches == 4  # 512 samples, batch 64, half per process
    out = capfd.readouterr().out
    assert out.count("Accuracy: ") == 2, out  # the seed prints on every rank
    assert not own_children()


# ---------------------------------------------------------------------------------------------- accumulate
def _data(n=32):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _fit_accumulating(k, batch):
    accelerator = Accelerator(gradient_accumulation_steps=k)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    syncs = [0]

    def count(state, bucket):
        syncs[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, count)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return syncs[0], accelerator.step, weights


def test_accumulate_syncs_every_k_batches_and_equals_a_k_times_larger_batch():
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    syncs, steps, accumulated = acc.distribute(_fit_accumulating)(4, 2)  # 8 batches per rank: 2 windows
    assert syncs == 2 and steps == 2
    syncs, steps, large = Accelerator(nprocs=2, compute_setup="cpu").distribute(_fit_accumulating)(1, 8)
    assert syncs == 2 and steps == 2
    for name, value in large.items():
        assert torch.allclose(accumulated[name], value, atol=1e-6), name


# ---------------------------------------------------------------------------------------------- gather_for_metrics
def _predict_all():
    accelerator = Accelerator()
    ids = torch.arange(11.0).reshape(-1, 1)
    loader = accelerator.prepare(DataLoader(TensorDataset(ids), batch_size=2, shuffle=False))
    seen, labels = [], []
    for (x,) in loader:
        seen.append(accelerator.gather_for_metrics(x))
        labels += accelerator.gather_for_metrics([int(v) for v in x.flatten()])
    return torch.cat(seen).flatten().tolist(), labels


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_gather_for_metrics_returns_every_sample_exactly_once(nprocs):
    values, labels = Accelerator(nprocs=nprocs, compute_setup="cpu").distribute(_predict_all)()
    assert sorted(values) == [float(i) for i in range(11)]  # 11 samples on 2 or 3 ranks: padding dropped
    assert sorted(labels) == list(range(11))  # lists of objects too


# ---------------------------------------------------------------------------------------------- save/load state
def _train_with_state(folder, stop_after, resume):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    loader = DataLoader(_data(48), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume:
        accelerator.load_state(folder)
    seen = 0
    for _epoch in range(loader.epoch, 3):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            seen += 1
            if seen == stop_after:
                accelerator.save_state(folder)
                return None
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def test_save_state_then_load_state_resumes_a_custom_loop_bitwise_mid_epoch(tmp_path):
    reference = Accelerator(nprocs=2, compute_setup="cpu").distribute(_train_with_state)(tmp_path / "ref", -1, False)
    # 6 batches per rank and epoch, accumulation 2: batch 10 ends a window in the second epoch
    Accelerator(nprocs=2, compute_setup="cpu").distribute(_train_with_state)(tmp_path / "run", 10, False)
    assert (tmp_path / "run" / "checkpoints" / "state.pt").exists()
    resumed = Accelerator(nprocs=2, compute_setup="cpu").distribute(_train_with_state)(tmp_path / "run", -1, True)
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), name


# ---------------------------------------------------------------------------------------------- schedulers, precision
def _one_cycle():
    accelerator = Accelerator()
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(32), batch_size=4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=len(loader) * 2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for _ in range(2):
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return len(loader), scheduler.scheduler.last_epoch, scheduler.scheduler.total_steps


def test_a_scheduler_sized_on_the_unsharded_loader_ends_with_the_data_on_two_processes():
    per_rank, last, total = Accelerator(nprocs=2, compute_setup="cpu").distribute(_one_cycle)()
    assert per_rank == 4 and last == total == 16  # 8 optimizer steps per rank, the schedule stepped 2x each


def test_bf16_autocast_on_cpu_keeps_fp32_master_weights_and_outputs():
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    seen = []
    inner[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model = accelerator.prepare(inner)
    out = model(torch.randn(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with accelerator.autocast():
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"split_batches": True}, "DataLoaderConfiguration"),
    ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ({"log_with": "comet"}, "log_with='comet'"),
    ({"dispatch_batches": True}, "not supported"),
    ({"deepspeed_plugin": object()}, "DeepSpeed is not supported"),
    ({"gradient_accumulation_steps": 2, "gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=2)},
     "both given"),
    ({"rng_types": ["xla"]}, "'xla' is not a random generator"),
    ({"devices": 2}, "unknown keyword 'devices'"),
])
def test_bad_accelerate_keywords_are_clear(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        Accelerator(**kwargs)
