"""Trainer.fit on 2 real gloo processes: equivalence with 1 process, the model comes back, exact resume."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from psutil_free import own_children
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer
from trainstack.callbacks import EarlyStopping
from trainstack.checkpoint import Checkpointer
from trainstack.errors import Preempted, WorkerError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _loader(n=32, batch=8, shuffle=False):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=batch, shuffle=shuffle)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))


def _cfg(tmp_path, name, **kw):
    return TrainConfig(**({"max_iter": 3, "log_folder": tmp_path / name, "verbose": False, "compute_setup": "cpu",
                           "backend": "gloo"} | kw))


def test_fit_on_one_and_two_processes_agree_and_the_model_comes_back(tmp_path):
    m1, m2 = _model(), _model()
    initial = {k: v.clone() for k, v in m2.state_dict().items()}
    Trainer(m1, torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9), _cfg(tmp_path, "one")).fit(_loader(32, 8))
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(m2, opt2, _cfg(tmp_path, "two", nprocs=2))
    model, optimizer = trainer.fit(_loader(32, 4))
    assert model is m2 and optimizer is opt2
    assert any(not torch.equal(initial[k], v) for k, v in m2.state_dict().items())  # trained weights returned
    assert all(s.get("momentum_buffer") is not None for s in opt2.state.values())  # optimizer state returned
    diff = max((m1.state_dict()[k] - m2.state_dict()[k]).abs().max().item() for k in initial)
    assert diff < 1e-6, diff
    assert trainer.current_epoch == 3 and trainer.config.log_folder == tmp_path / "two"


def _interrupt(trainer, config, writer):
    if trainer.current_epoch == 3 and trainer.accelerator.rank == 1:
        raise RuntimeError("simulated failure on rank 1")


def _fit_two(tmp_path, name, shuffle=True, **kw):
    model = _model(seed=kw.pop("init_seed", 0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = _cfg(tmp_path, name, nprocs=2, max_iter=5, checkpoint_every=1, seed=1, **kw)
    Trainer(model, opt, cfg).fit(_loader(40, 4, shuffle=shuffle))
    return model


def test_exact_resume_on_two_processes(tmp_path):
    reference = _fit_two(tmp_path, "ref")
    with pytest.raises(WorkerError) as exc:
        _fit_two(tmp_path, "crash", callbacks=[Callback(on="train_epoch_end", callback=_interrupt)])
    assert exc.value.rank == 1 and "simulated failure on rank 1" in str(exc.value)
    assert not own_children()
    resumed = _fit_two(tmp_path, "crash", resume="auto", init_seed=7)
    for k, v in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def _crash_mid_epoch(trainer, config, writer):
    if trainer.global_step == 22 and trainer.accelerator.rank == 2:
        raise RuntimeError("simulated failure on rank 2")


def _fit_four(tmp_path, name, **kw):
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(240, 4, generator=g), torch.randn(240, 1, generator=g)),
                      batch_size=4, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    cfg = _cfg(tmp_path, name, nprocs=4, max_iter=2, checkpoint_every_n_steps=5, seed=1, **kw)
    Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg).fit(data)
    return model


@pytest.mark.timeout(300)
def test_exact_resume_mid_epoch_on_four_processes(tmp_path):
    """Four ranks: DDP's first step in a new process reduces gradients in the same bucket layout as the steps of
    the run it continues (with 3+ ranks the summation order depends on it), so the resumed run is bitwise equal."""
    reference = _fit_four(tmp_path, "ref")
    with pytest.raises(WorkerError):
        _fit_four(tmp_path, "crash", callbacks=[Callback(on="train_batch_end", callback=_crash_mid_epoch)])
    resumed = _fit_four(tmp_path, "crash", resume="auto")
    for k, v in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def test_early_stopping_on_diverging_ranks_stops_everyone(tmp_path):
    # each rank monitors its own (unreduced) train loss, so their decisions differ; all must stop together
    model = _model()
    stopper = EarlyStopping(on="train_epoch_end", monitor="train_loss", patience=1, min_delta=0.0)
    cfg = _cfg(tmp_path, "es", nprocs=2, max_iter=200, callbacks=[stopper])
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=5.0), cfg)  # lr too big: loss goes up
    trainer.fit(_loader(32, 4, shuffle=True))
    assert 1 < trainer.current_epoch < 200 and "EarlyStopping" in trainer.stop_reason


def test_test_metrics_do_not_count_padding_duplicates(tmp_path):
    model = _model()
    loader = _loader(n=11, batch=3)  # 11 samples on 2 ranks: a DistributedSampler would pad to 12
    one = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, "t1")).test(loader)
    two = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, "t2", nprocs=2)).test(loader)
    direct = nn.functional.mse_loss(model(loader.dataset.tensors[0]), loader.dataset.tensors[1]).item()
    assert one["test_loss"] == pytest.approx(direct, rel=1e-6)
    assert two["test_loss"] == pytest.approx(direct, rel=1e-6)


def _signal_rank1(trainer, config, writer):
    if trainer.accelerator.rank == 1 and trainer.global_step == 7:
        os.kill(os.getpid(), signal.SIGUSR2)  # only rank 1 hears it: the ranks must agree to stop together


def test_preemption_on_one_rank_stops_all_at_the_same_step_and_resumes_exactly(tmp_path):
    reference = _fit_two(tmp_path, "pref", stop_check_every=2)
    with pytest.raises(Preempted):
        _fit_two(tmp_path, "prun", stop_check_every=2,
                 callbacks=[Callback(on="train_batch_end", callback=_signal_rank1)])
    state = torch.load(Checkpointer(tmp_path / "prun").latest(), weights_only=True)
    assert state["global_step"] == 8 and len(state["rng"]) == 2  # next poll after the signal, on both ranks
    resumed = _fit_two(tmp_path, "prun", resume="auto", init_seed=3, stop_check_every=2)
    for k, v in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def _slow_batches(trainer, config, writer):
    import time

    time.sleep(0.05)
    if trainer.accelerator.rank == 0 and trainer.global_step == 5:
        os.kill(int(os.environ["TEST_LAUNCHER_PID"]), signal.SIGUSR2)  # the launching process, not the workers


def test_stop_signal_to_the_launching_process_is_relayed_to_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_LAUNCHER_PID", str(os.getpid()))  # (workers are forked by the fork server)
    with pytest.raises(Preempted):
        _fit_two(tmp_path, "relay", stop_check_every=1,
                 callbacks=[Callback(on="train_batch_end", callback=_slow_batches)])
    assert Checkpointer(tmp_path / "relay").latest() is not None
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL and not own_children()


def _record_dict_batches(model, batch):
    import json

    out = os.environ["SHARD_OUT"]
    rank = os.environ["RANK"]
    with open(f"{out}/rank{rank}.jsonl", "a") as fh:
        fh.write(json.dumps({k: v[0].reshape(-1).tolist() for k, v in batch.items()}) + "\n")
    (xa, ya), (xb, yb) = batch["a"], batch["b"]
    return nn.functional.mse_loss(model(xa), ya) + nn.functional.mse_loss(model(xb), yb)


def test_a_dict_of_loaders_is_sharded_per_loader_on_two_processes(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("SHARD_OUT", str(tmp_path))
    ids_a = torch.arange(16.0).reshape(-1, 1).repeat(1, 3)
    ids_b = (100 + torch.arange(12.0)).reshape(-1, 1).repeat(1, 3)
    loaders = {"a": DataLoader(TensorDataset(ids_a, torch.zeros(16, 1)), batch_size=2, shuffle=True),
               "b": DataLoader(TensorDataset(ids_b, torch.zeros(12, 1)), batch_size=2, shuffle=True)}
    model = _model()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), _cfg(tmp_path, "dict", nprocs=2, max_iter=1),
            loss_fn=_record_dict_batches).fit(loaders)
    seen = {0: {"a": set(), "b": set()}, 1: {"a": set(), "b": set()}}
    for rank in (0, 1):
        for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            for key in ("a", "b"):
                seen[rank][key].update(row[key][::3])
    # per rank: 3 steps (b has 6 samples per rank, batch 2); ranks never share a sample of either loader
    assert not seen[0]["a"] & seen[1]["a"] and not seen[0]["b"] & seen[1]["b"]
    assert len(seen[0]["b"] | seen[1]["b"]) == 12 and all(v >= 100 for v in seen[0]["b"] | seen[1]["b"])


@pytest.mark.timeout(120)
def test_an_endless_loader_on_two_processes_ends_each_epoch(tmp_path):
    from trainstack import to_dataloader

    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      _cfg(tmp_path, "endless", nprocs=2, max_iter=4, max_batches=2))
    trainer.fit(to_dataloader(torch.randn(32, 3), torch.randn(32, 1), batch_size=4, infinite=True))
    assert trainer.current_epoch == 4 and trainer.global_step == 8


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_during_a_sharded_save_names_the_cause_on_two_processes(tmp_path, asynchronous):
    from helpers import small_tmpfs


    with small_tmpfs(tmp_path / "small", "3M") as disk:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 300), nn.Tanh(), nn.Linear(300, 300), nn.Linear(300, 1))  # ~0.4 MB
        cfg = _cfg(disk, "run", nprocs=2, max_iter=20, checkpoint_every=1, checkpoint_format="sharded",
                   async_checkpoint=asynchronous)
        with pytest.raises(WorkerError, match="the disk is full") as exc:
            Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg).fit(_loader())
        assert "CheckpointError" in str(exc.value) and "The previous checkpoint is kept" in str(exc.value)
        checkpoints = Checkpointer(disk / "run")
        assert not list(checkpoints.folder.glob(".*tmp*"))  # the failed save's temp folder is gone
        assert checkpoints.load()[0]["epoch"] >= 1
    assert not own_children()


def test_closures_and_a_scheduler_sized_by_the_planned_steps_on_two_processes(tmp_path):
    """A LambdaLR over a local function and a lambda loss_fn reach the workers (by value); a scheduler factory
    gets the steps the run will take on 2 processes (32 samples / 2 ranks / batch 4 = 4 steps per epoch x 3), so
    a cosine ends at 0 on the last step."""
    import math

    def warmup_cosine(total):
        def f(step):
            return 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
        return f

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, opt, _cfg(tmp_path, "sched", nprocs=2),
                      loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                      scheduler=lambda o, total: torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(total)),
                      scheduler_interval="step", train_dataloader=_loader(32, 4))
    assert trainer.estimated_stepping_batches == 12
    trainer.fit()
    assert trainer.global_step == 12 and opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert trainer.is_global_zero
    m3 = _model()
    o3 = torch.optim.SGD(m3.parameters(), lr=0.1)
    local = torch.optim.lr_scheduler.LambdaLR(o3, warmup_cosine(12))  # a scheduler object holding a closure
    again = Trainer(m3, o3, _cfg(tmp_path, "local", nprocs=2), scheduler=local, scheduler_interval="step")
    again.fit(_loader(32, 4))
    assert again.global_step == 12 and o3.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


_PERSISTENT = """
import sys, torch
from pathlib import Path
from torch.utils.data import DataLoader, TensorDataset
from trainstack import TrainConfig, Trainer

if __name__ == "__main__":
    folder, epochs = sys.argv[1], int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)
    val = DataLoader(data, batch_size=16, num_workers=1, persistent_workers=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    cfg = TrainConfig(max_iter=epochs, nprocs=2, compute_setup="cpu", log_folder=folder, checkpoint_every=1, seed=0,
                      resume="auto", verbose=False, val_every=1)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cfg, val_dataloader=val).fit(loader)
    torch.save(model.state_dict(), Path(folder) / "final.pt")
    print("fit returned", flush=True)
"""


@pytest.mark.timeout(300)
def test_persistent_loader_workers_end_with_the_run_and_an_epoch_end_resume_is_bitwise(tmp_path):
    """DataLoader(num_workers=2, persistent_workers=True) on 2 processes: the launcher's output ends with it (no
    loader worker outlives its rank holding the pipe), and a resume from an epoch-end checkpoint with dropout in
    the model equals the uninterrupted run bitwise."""
    import subprocess
    import sys

    script = tmp_path / "persistent.py"
    script.write_text(_PERSISTENT)

    def run(folder, epochs):
        proc = subprocess.Popen([sys.executable, str(script), str(folder), str(epochs)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # pipes, as `| tee` reads
        out, err = proc.communicate(timeout=180)  # returns only once every holder of the pipes is gone
        assert proc.returncode == 0 and "fit returned" in out, out[-2000:] + err[-3000:]
        deadline = time.monotonic() + 5  # a process in its last instant of exiting is no leftover
        while True:
            shown = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "-s", str(proc.pid)], capture_output=True,
                                   text=True).stdout.splitlines()
            alive = [line for line in shown if line.split()[1:2] and not line.split()[1].startswith("Z")]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not alive, f"processes of the run outlived it: {alive}"  # zombies await a reaper, nothing more

    run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    run(tmp_path / "b", 4)
    a = torch.load(tmp_path / "a" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a), {k: (a[k] - b[k]).abs().max().item() for k in a}
