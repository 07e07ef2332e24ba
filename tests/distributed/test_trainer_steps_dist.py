"""The Trainer's step-based layer on real gloo processes: max_steps with accumulation, mid-epoch validation and
checkpoints then a crash and a bitwise resume, top-k after a resume, predict on 1/2/3 processes, trainer.log over
ranks, schedulers without warnings, and a terminal's Ctrl-C (SIGINT to the whole process group) stopping with a
checkpoint that resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from psutil_free import own_children
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer
from trainstack.callbacks import ModelCheckpoint
from trainstack.checkpoint import describe
from trainstack.errors import WorkerError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _loader(n=40, batch=4, shuffle=True):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=batch, shuffle=shuffle)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


def _fit(tmp_path, name, nprocs=2, val=None, **kw):
    model = _model(kw.pop("init_seed", 0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = kw.pop("scheduler", None)
    cfg = TrainConfig(**({"max_iter": 3, "log_folder": tmp_path / name, "verbose": False, "compute_setup": "cpu",
                          "backend": "gloo", "nprocs": nprocs, "seed": 5} | kw))
    trainer = Trainer(model, opt, cfg, scheduler=scheduler(opt) if scheduler else None,
                      scheduler_interval="step" if scheduler else "epoch")
    trainer.fit(_loader(), val)
    return trainer


def _rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _equal(a, b):
    for k, v in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v), k


class _CrashOnce(Callback):
    """Raise on rank 1 at one optimizer step, the first time only (a flag file survives the processes)."""

    def __init__(self, step, flag):
        super().__init__(on="optimizer_step")
        self.step, self.flag = step, flag

    def run_callback(self, trainer, config, writer):
        if trainer.global_step == self.step and trainer.accelerator.rank == 1 and not self.flag.exists():
            self.flag.touch()
            raise RuntimeError("simulated crash on rank 1")


def test_max_steps_with_accumulation_takes_exactly_that_many_optimizer_steps(tmp_path):
    # 40 samples on 2 ranks, batch 4: 5 batches per rank and epoch; accumulation 2: 3 optimizer steps per epoch
    trainer = _fit(tmp_path, "steps", max_iter=100, max_steps=7, gradient_accumulation_steps=2)
    assert trainer.global_step == 7 and trainer.current_epoch == 2  # stopped inside the third epoch
    info = describe(trainer.run_folder)
    assert info["step"] == 7 and info["batch"] == trainer.global_batch
    assert not own_children()


def test_mid_epoch_validation_and_checkpoints_then_a_crash_resume_bitwise(tmp_path):
    val = _loader(12, 4, shuffle=False)
    every = {"val_every_n_steps": 2, "checkpoint_every_n_steps": 2}
    reference = _fit(tmp_path, "ref", val=val, **every)
    steps = [r["step"] for r in _rows(reference.run_folder) if "val_loss" in r and "train_loss" not in r]
    assert {2, 4, 6, 8, 12, 14} <= set(steps), steps  # 5 steps per epoch: 5 and 15 are epoch ends
    with pytest.raises(WorkerError, match="simulated crash on rank 1"):
        _fit(tmp_path, "run", val=val, callbacks=[_CrashOnce(9, tmp_path / "crashed")], **every)
    assert describe(tmp_path / "run")["step"] == 8  # the newest checkpoint is mid-epoch (epoch 2 of 3)
    resumed = _fit(tmp_path, "run", val=val, resume="auto", init_seed=9,
                   callbacks=[_CrashOnce(9, tmp_path / "crashed")], **every)
    _equal(reference, resumed)
    assert resumed.global_step == reference.global_step == 15


def test_top_k_after_a_resume_on_two_processes_keeps_what_an_uninterrupted_run_keeps(tmp_path):
    val = _loader(12, 4, shuffle=False)

    def kept(folder):
        return sorted(p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith("best-"))

    top = {"val_every_n_steps": 2, "max_iter": 4}
    reference = _fit(tmp_path, "ref", val=val, callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2)], **top)
    with pytest.raises(WorkerError):
        _fit(tmp_path, "run", val=val, checkpoint_every_n_steps=4,
             callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2), _CrashOnce(11, tmp_path / "c")], **top)
    _fit(tmp_path, "run", val=val, checkpoint_every_n_steps=4, resume="auto",
         callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2), _CrashOnce(11, tmp_path / "c")], **top)
    assert len(kept(reference.run_folder)) == 2 and kept(tmp_path / "run") == kept(reference.run_folder)
    values = sorted(r["val_loss"] for r in _rows(reference.run_folder) if "val_loss" in r and "train_loss" not in r)
    best = describe(tmp_path / "run", "best")["monitor"]
    assert best == describe(reference.run_folder, "best")["monitor"] and f"{values[0]:.6g}" in best, (best, values)


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_predict_on_any_number_of_processes_equals_one_forward_in_dataset_order(tmp_path, nprocs):
    model = _model()
    data = _loader(11, 2, shuffle=True)  # 11 samples: 2 and 3 ranks cannot split them evenly
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      TrainConfig(nprocs=nprocs, compute_setup="cpu", log_folder=tmp_path, verbose=False))
    out = trainer.predict(data)
    model.eval()
    with torch.no_grad():
        expected = model(data.dataset.tensors[0])
    assert out.shape == (11, 1) and torch.allclose(out, expected, atol=1e-6)
    assert not own_children()


def _log_rank(trainer, config, writer):
    trainer.log("rank_value", float(trainer.accelerator.rank), sync_dist=True)
    trainer.log("rank_max", float(trainer.accelerator.rank), reduce="max", sync_dist=True)


def test_trainer_log_with_sync_dist_reduces_over_the_ranks(tmp_path):
    trainer = _fit(tmp_path, "log", log_every_n_steps=5, callbacks=[Callback(on="optimizer_step", callback=_log_rank)])
    rows = [r for r in _rows(trainer.run_folder) if "rank_value" in r]
    assert rows and all(r["rank_value"] == pytest.approx(0.5) and r["rank_max"] == 1.0 for r in rows), rows
    assert all("lr" in r for r in rows)  # the learning rate is logged by default


def test_a_step_scheduler_on_two_processes_counts_optimizer_steps_and_no_rank_warns(tmp_path, capfd):
    trainer = _fit(tmp_path, "sched", gradient_accumulation_steps=2, max_iter=2,
                   scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert trainer.global_step == 6 and trainer.scheduler.scheduler.last_epoch == 6
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 6)
    err = capfd.readouterr().err
    assert "lr_scheduler" not in err and "overridden" not in err, err[-2000:]


# ---------------------------------------------------------------------------------------------- Ctrl-C
_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from pathlib import Path
    from torch.utils.data import DataLoader, TensorDataset
    from trainstack import Callback, Trainer, TrainConfig

    OUT = Path(sys.argv[1])

    def slow(trainer, config, writer):
        time.sleep(0.05)
        if trainer.global_step >= 12 and trainer.accelerator.rank == 0:
            (OUT / "running").touch()
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))  # a long step: both Ctrl-Cs land inside it

    if __name__ == "__main__":
        g = torch.Generator().manual_seed(0)
        data = DataLoader(TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g)),
                          batch_size=4, shuffle=True)
        torch.manual_seed(int(sys.argv[3]))
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        cfg = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=int(sys.argv[2]), seed=3, log_folder=OUT / "run",
                          stop_check_every=1, resume="auto", hang_timeout=0,
                          callbacks=[Callback(on="optimizer_step", callback=slow)])
        Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg).fit(data)
        torch.save(model.state_dict(), OUT / "final.pt")
        print("FINISHED", flush=True)
""")


def _start(tmp_path: Path, epochs: int, seed: int = 0, step_sleep: float = 0.0) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return subprocess.Popen([sys.executable, str(script), str(tmp_path), str(epochs), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "STEP_SLEEP": str(step_sleep)})


def _ctrl_c(proc: subprocess.Popen, flag: Path, times: int = 1) -> str:
    """Press Ctrl-C as a terminal does: SIGINT to the whole foreground process group, once training runs."""
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        for _ in range(times):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.3)
        out, _ = proc.communicate(timeout=90)
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _gone(pgid: int) -> bool:
    """No process of the run's process group is alive (workers, fork server)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(300)
def test_ctrl_c_in_a_terminal_stops_with_a_checkpoint_and_the_rerun_equals_an_uninterrupted_run(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    reference = _start(ref_dir, 3)
    out, _ = reference.communicate(timeout=200)
    assert reference.returncode == 0 and "FINISHED" in out, out[-3000:]
    proc = _start(run_dir, 3)
    out = _ctrl_c(proc, run_dir / "running")
    assert proc.returncode == 130, out[-3000:]
    assert "Ctrl-C: stopping at the next step boundary" in out and "Interrupted at epoch" in out, out[-3000:]
    assert "resume='auto'" in out and "Traceback" not in out and "FINISHED" not in out, out[-3000:]
    deadline = time.monotonic() + 10
    while not _gone(proc.pid):
        assert time.monotonic() < deadline, "processes of the interrupted run are still alive"
        time.sleep(0.1)
    (run_dir / "running").unlink()
    rerun = _start(run_dir, 3, seed=7)  # resume='auto': continues where Ctrl-C stopped it
    out, _ = rerun.communicate(timeout=200)
    assert rerun.returncode == 0 and "Resumed from" in out, out[-3000:]
    ref = torch.load(ref_dir / "final.pt", weights_only=True)
    got = torch.load(run_dir / "final.pt", weights_only=True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.timeout(200)
def test_a_second_ctrl_c_aborts_at_once_and_leaves_no_process(tmp_path):
    proc = _start(tmp_path, 1000, step_sleep=2.0)  # the first Ctrl-C waits for the step's end; the second does not
    started = time.monotonic()
    out = _ctrl_c(proc, tmp_path / "running", times=2)
    assert proc.returncode not in (0, 130) and "FINISHED" not in out, out[-3000:]
    assert "KeyboardInterrupt" in out, out[-3000:]
    deadline = time.monotonic() + 10
    while not _gone(proc.pid):
        assert time.monotonic() < deadline, "processes of the aborted run are still alive"
        time.sleep(0.1)
    assert time.monotonic() - started < 150


_OWN_LOOP = """
import sys, time, torch
from pathlib import Path
from trainstack import Accelerator

def train(acc, flag):
    model = acc.prepare(torch.nn.Linear(3, 1))
    for i in range(100000):
        if i == 3 and acc.is_main_process:
            Path(flag).touch()
        time.sleep(0.01)
        model(torch.randn(2, 3)).sum().backward()

if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    acc.distribute(train)(acc, sys.argv[1])
"""


@pytest.mark.timeout(200)
def test_ctrl_c_in_a_custom_loop_is_one_line_exit_130_and_no_process_left(tmp_path):
    """An Accelerator loop has no graceful stop of its own: a Ctrl-C ends every worker, says so in one line (not two
    KeyboardInterrupt tracebacks through trainstack's launcher) and exits 130."""
    script = tmp_path / "own.py"
    script.write_text(_OWN_LOOP)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "running")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = _ctrl_c(proc, tmp_path / "running")
    assert proc.returncode == 130 and "trainstack: interrupted (Ctrl-C): every worker stopped" in out, out[-3000:]
    assert "Traceback" not in out and len(out.strip().splitlines()) <= 3, out[-3000:]
    deadline = time.monotonic() + 10
    while not _gone(proc.pid):
        assert time.monotonic() < deadline, "processes of the interrupted loop are still alive"
        time.sleep(0.1)
