"""Workloads and the systems under test. Each system trains the same model on the same data for a fixed
number of steps; a forward pre-hook on the model (identical in every system) records when each step starts,
and every process reports its peak RSS. Run through bench/run.py, never directly."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

WARMUP = 10
COUNT_FROM, COUNT_TO = 20, 70  # steps between which Python calls are counted (--count-calls)

WORKLOADS = {
    "tiny": {"dims": (32, 256, 256, 1), "batch": 64, "loss": "mse", "data": "tensor"},
    "mlp": {"dims": (512, 2048, 2048, 10), "batch": 256, "loss": "ce", "data": "tensor"},
    "classify": {"dims": (16 * 16, 128, 10), "batch": 64, "loss": "ce", "data": "dataset"},
}


class ImageDataset(Dataset):
    """A real map-style Dataset: per-sample __getitem__ with a (cheap) per-sample transform."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 1, 16, 16, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return (self.images[i] - 0.5) / 0.25, self.labels[i]


def make_model(name: str) -> nn.Module:
    dims = WORKLOADS[name]["dims"]
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Flatten()] if WORKLOADS[name]["data"] == "dataset" else []
    for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_loader(name: str, steps: int, nprocs: int) -> DataLoader:
    w = WORKLOADS[name]
    n = (steps + 1) * w["batch"] * nprocs
    if w["data"] == "dataset":
        ds: Dataset = ImageDataset(n)
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, w["dims"][0], generator=g)
        y = torch.randn(n, 1, generator=g) if w["loss"] == "mse" else torch.randint(0, w["dims"][-1], (n,), generator=g)
        ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=w["batch"], shuffle=True)


def loss_fn(name: str):
    return nn.functional.mse_loss if WORKLOADS[name]["loss"] == "mse" else nn.functional.cross_entropy


class StepClock:
    """Forward pre-hook: timestamps of every step on this rank, plus optional Python-call counting."""

    def __init__(self, count_calls: bool) -> None:
        self.times: list[float] = []
        self.opt_done: list[float] = []  # the end of the first and of the latest optimizer step
        self.count_calls = count_calls
        self.calls = 0

    def optimizer_step_done(self, optimizer, args, kwargs) -> None:  # noqa: ANN001
        """An optimizer step post-hook: when the first optimizer step (and the latest) ended."""
        now = time.perf_counter()
        self.opt_done = [self.opt_done[0] if self.opt_done else now, now]

    def _profile(self, frame, event, arg):  # noqa: ANN001
        if event == "call":
            self.calls += 1

    def __call__(self, module, args) -> None:  # noqa: ANN001
        self.times.append(time.perf_counter())
        if self.count_calls:
            if len(self.times) == COUNT_FROM:
                sys.setprofile(self._profile)
            elif len(self.times) == COUNT_TO:
                sys.setprofile(None)


def attach_clock(model: nn.Module, count_calls: bool, optimizer: torch.optim.Optimizer | None = None) -> StepClock:
    clock = StepClock(count_calls)
    model.register_forward_pre_hook(clock)
    if optimizer is not None:
        optimizer.register_step_post_hook(clock.optimizer_step_done)
    return clock


def report(out: Path, rank: int, clock: StepClock | None, checkpoint_s: float | None = None) -> None:
    record = {"rank": rank, "pid": os.getpid(), "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "t0_wall": time.time() - time.perf_counter()}
    if clock is not None:
        record.update(times=clock.times, calls=clock.calls, opt_done=clock.opt_done, checkpoint_s=checkpoint_s)
    (out / f"proc-{os.getpid()}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------- raw PyTorch (the 1.00 reference)
def _raw_worker(rank: int, world: int, name: str, steps: int, out: Path, count: bool, port: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = make_model(name)
    ddp = DDP(model)
    loader = make_loader(name, steps, world)
    loader = DataLoader(loader.dataset, batch_size=loader.batch_size,
                        sampler=DistributedSampler(loader.dataset, num_replicas=world, rank=rank, shuffle=True))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    clock = attach_clock(model, count and rank == 0, opt)
    lf = loss_fn(name)
    for x, y in loader:
        opt.zero_grad()
        lf(ddp(x), y).backward()
        opt.step()
    report(out, rank, clock if rank == 0 else None)
    dist.barrier()
    dist.destroy_process_group()
    # Its result written, the worker leaves without finalizing the interpreter: torch's gloo run-loop thread can
    # take the GIL during finalization and abort a finished process (SIGABRT; CI, under load, 2026-12-05) --
    # trainstack's own processes let it finish (pgsession.settle_at_exit); a raw loop has no such guard.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_raw(name: str, nprocs: int, steps: int, out: Path, count: bool) -> None:
    if nprocs == 1:
        model = make_model(name)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        clock = attach_clock(model, count, opt)
        lf = loss_fn(name)
        for x, y in make_loader(name, steps, 1):
            opt.zero_grad()
            lf(model(x), y).backward()
            opt.step()
        report(out, 0, clock)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_raw_worker, args=(nprocs, name, steps, out, count, port), nprocs=nprocs)
    report(out, -1, None)


# ---------------------------------------------------------------- trainstack Accelerator loop
def _acc_loop(name: str, steps: int, out: str, count: bool, accelerator) -> None:  # noqa: ANN001
    model = make_model(name)
    loader = make_loader(name, steps, accelerator.world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = attach_clock(model, count and accelerator.rank == 0, opt)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    lf = loss_fn(name)
    for batch in loader:
        x, y = accelerator.prepare_batch(batch)
        opt.zero_grad()
        lf(model(x), y).backward()
        opt.step()
    report(Path(out), accelerator.rank, clock if accelerator.rank == 0 else None)


def run_accelerator(name: str, nprocs: int, steps: int, out: Path, count: bool) -> None:
    from trainstack import Accelerator

    acc = Accelerator(nprocs=nprocs, compute_setup="cpu")
    acc.distribute(_acc_loop)(name, steps, str(out), count, acc)
    if nprocs > 1:
        report(out, -1, None)


# ---------------------------------------------------------------- HF Accelerate's spelling of the loop, on trainstack
def _hf_style_loop(name: str, steps: int, out: str, count: bool) -> None:
    from trainstack import Accelerator

    accelerator = Accelerator(cpu=True)  # Accelerate's keywords; joins the processes notebook_launcher started
    model = make_model(name)
    loader = make_loader(name, steps, accelerator.num_processes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = attach_clock(model, count and accelerator.process_index == 0, opt)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    lf = loss_fn(name)
    for x, y in loader:
        with accelerator.accumulate(model):
            opt.zero_grad()
            accelerator.backward(lf(model(x), y))
            opt.step()
    report(Path(out), accelerator.process_index, clock if accelerator.process_index == 0 else None)


def run_accelerator_hf(name: str, nprocs: int, steps: int, out: Path, count: bool) -> None:
    from trainstack import notebook_launcher

    notebook_launcher(_hf_style_loop, args=(name, steps, str(out), count), num_processes=nprocs)
    if nprocs > 1:
        report(out, -1, None)


# ---------------------------------------------------------------- trainstack Trainer.fit, default experience
class _Loss:
    def __init__(self, name: str) -> None:
        self.lf = loss_fn(name)

    def __call__(self, model, batch):  # noqa: ANN001
        x, y = batch
        return self.lf(model(x), y)


def _clock_start(trainer, config, writer) -> None:  # noqa: ANN001
    trainer.model._bench_clock = attach_clock(trainer.model, trainer._bench_count and trainer.accelerator.rank == 0,
                                              trainer.optimizer)


def _clock_end(trainer, config, writer) -> None:  # noqa: ANN001
    acc = trainer.accelerator
    report(Path(trainer._bench_out), acc.rank, trainer.model._bench_clock if acc.rank == 0 else None,
           trainer.checkpointer.last_save_seconds)  # the final checkpoint's write time


def run_trainer(name: str, nprocs: int, steps: int, out: Path, count: bool) -> None:
    from trainstack import Callback, TrainConfig, Trainer

    if not os.environ.get("TRAINSTACK_BENCH_NO_BAR"):  # the progress bar is part of the default experience
        os.environ["TRAINSTACK_PROGRESS"] = "1"
    model = make_model(name)
    cfg = TrainConfig(nprocs=nprocs, compute_setup="cpu", max_iter=1, print_every=1, root_folder=out / "runs",
                      callbacks=[Callback(on="train_start", callback=_clock_start),
                                 Callback(on="train_end", callback=_clock_end)])
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=_Loss(name))
    trainer._bench_out, trainer._bench_count = str(out), count
    trainer.fit(make_loader(name, steps, nprocs))
    if nprocs > 1:
        report(out, -1, None)


# ---------------------------------------------------------------- peers (pip install 'trainstack[bench]')
def _hf_worker(name: str, steps: int, out: str, count: bool) -> None:
    from accelerate import Accelerator as HFAccelerator

    acc = HFAccelerator(cpu=True)
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = attach_clock(model, count and acc.process_index == 0, opt)
    model, opt, loader = acc.prepare(model, opt, make_loader(name, steps, acc.num_processes))
    lf = loss_fn(name)
    for x, y in loader:
        opt.zero_grad()
        acc.backward(lf(model(x), y))
        opt.step()
    report(Path(out), acc.process_index, clock if acc.process_index == 0 else None)


def run_accelerate(name: str, nprocs: int, steps: int, out: Path, count: bool) -> None:
    from accelerate import notebook_launcher

    if nprocs == 1:
        _hf_worker(name, steps, str(out), count)
        return
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    notebook_launcher(_hf_worker, args=(name, steps, str(out), count), num_processes=nprocs)
    report(out, -1, None)


def _fabric_worker(fabric, name: str, steps: int, out: str, count: bool) -> None:  # noqa: ANN001
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = attach_clock(model, count and fabric.global_rank == 0, opt)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(make_loader(name, steps, fabric.world_size))
    lf = loss_fn(name)
    for x, y in loader:
        opt.zero_grad()
        fabric.backward(lf(model(x), y))
        opt.step()
    report(Path(out), fabric.global_rank, clock if fabric.global_rank == 0 else None)


def run_fabric(name: str, nprocs: int, steps: int, out: Path, count: bool) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=nprocs, strategy="ddp_spawn" if nprocs > 1 else "auto")
    fabric.launch(_fabric_worker, name, steps, str(out), count)
    if nprocs > 1:
        report(out, -1, None)


def _standard_loader(run):  # noqa: ANN001, ANN202
    """The same system with the TensorDataset fast path off: isolates the framework's own per-step overhead."""
    def wrapped(*args):  # noqa: ANN002, ANN202
        os.environ["TRAINSTACK_FAST_TENSOR_PATH"] = "0"
        return run(*args)
    return wrapped


def _no_watchdog(run):  # noqa: ANN001, ANN202
    """The same system with the hang watchdog thread off (heartbeats are attribute stores either way)."""
    def wrapped(*args):  # noqa: ANN002, ANN202
        os.environ["TRAINSTACK_HANG_TIMEOUT"] = "0"
        return run(*args)
    return wrapped


def _spawned(run):  # noqa: ANN001, ANN202
    """The same system with workers spawned from scratch (no preloaded fork server): the start-up before issue 18."""
    def wrapped(*args):  # noqa: ANN002, ANN202
        os.environ["TRAINSTACK_PRELOAD"] = "0"
        return run(*args)
    return wrapped


def _no_gc_freeze(run):  # noqa: ANN001, ANN202
    """The same system with Python's collector scanning everything loaded (TRAINSTACK_GC_FREEZE=0): start-up before
    trainstack froze torch's objects out of its sight."""
    def wrapped(*args):  # noqa: ANN002, ANN202
        os.environ["TRAINSTACK_GC_FREEZE"] = "0"
        return run(*args)
    return wrapped


def _log_lines(run):  # noqa: ANN001, ANN202
    """The same system as a Slurm log sees it: no progress bar, a live line every 50 steps (log_every_n_steps's
    default) and at least every 30 s -- the step-based logging's own cost."""
    def wrapped(*args):  # noqa: ANN002, ANN202
        os.environ["TRAINSTACK_PROGRESS"] = "0"
        os.environ["TRAINSTACK_BENCH_NO_BAR"] = "1"
        return run(*args)
    return wrapped


SYSTEMS = {"raw": run_raw, "accelerator": run_accelerator, "trainer": run_trainer, "accelerator-hf": run_accelerator_hf,
           "accelerator-std": _standard_loader(run_accelerator), "trainer-std": _standard_loader(run_trainer),
           "trainer-std-nowd": _no_watchdog(_standard_loader(run_trainer)),
           "trainer-lines": _log_lines(run_trainer),
           "accelerator-spawn": _spawned(run_accelerator), "trainer-spawn": _spawned(run_trainer),
           "trainer-nofreeze": _no_gc_freeze(run_trainer), "accelerator-nofreeze": _no_gc_freeze(run_accelerator),
           "accelerate": run_accelerate, "fabric": run_fabric}
PEER_MODULES = {"accelerate": "accelerate", "fabric": "lightning"}
