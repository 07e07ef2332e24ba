"""Which tracker run a run folder writes into, and what its first row after a resume holds (the probe's F7, F8,
F9): the MLflow run is found by trainstack's run id (a copied folder gets an id of its own, a deleted trackers.json
loses nothing), a hostile run.json id is replaced, the first row after a resume averages the steps the
uninterrupted run's did, a tracker that fails while training is warned about and training goes on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer
from trainstack.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


def _fit(folder: Path, max_steps: int, tool: str = "jsonl", scale: float = 1.0, **kw) -> Trainer:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = DataLoader(TensorDataset(x, scale * x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    cfg = TrainConfig(max_steps=max_steps, max_iter=100, log_folder=folder, resume="auto", seed=0, verbose=False,
                      compute_setup="cpu", tracking_tool=tool, **kw)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg)
    trainer.fit(data)
    return trainer


def _rows(folder: Path) -> list[dict]:
    keep = ("step", "loss", "mse")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, (folder / "metrics.jsonl").read_text()
                                                           .splitlines()) if "loss" in r]


def test_the_first_row_after_a_resume_is_the_uninterrupted_runs(tmp_path):
    cadence = {"log_every_n_steps": 2, "checkpoint_every_n_steps": 3}  # a checkpoint inside an open log interval
    _fit(tmp_path / "whole", 6, **cadence)
    _fit(tmp_path / "parts", 3, **cadence)
    _fit(tmp_path / "parts", 6, **cadence)
    assert _rows(tmp_path / "parts") == _rows(tmp_path / "whole")


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "identity")
    return tmp_path / "mlruns"


def _mlflow_runs(name: str = "identity") -> dict[str, list[float]]:
    import mlflow

    client = mlflow.tracking.MlflowClient()
    experiment = client.get_experiment_by_name(name)
    out = {}
    for run in client.search_runs([experiment.experiment_id]):
        out[run.data.tags.get("trainstack.run_id")] = [m.value for m in client.get_metric_history(run.info.run_id,
                                                                                                    "loss")]
    return out


def test_a_copied_run_folder_and_a_lost_trackers_json_keep_each_runs_mlflow_history(tmp_path, mlflow_store):
    first = _fit(tmp_path / "d3", 16, "mlflow", log_every_n_steps=4)
    shutil.copytree(tmp_path / "d3", tmp_path / "d4")  # a branch of the run
    branch = _fit(tmp_path / "d4", 32, "mlflow", scale=10.0, log_every_n_steps=4)
    assert branch.run_id != first.run_id and json.loads((tmp_path / "d4/run.json").read_text())["run_id"] == \
        branch.run_id
    (tmp_path / "d3" / "trackers.json").unlink()  # lost: the run id still finds its MLflow run
    again = _fit(tmp_path / "d3", 32, "mlflow", log_every_n_steps=4)
    assert again.run_id == first.run_id
    runs = _mlflow_runs()
    assert set(runs) == {first.run_id, branch.run_id}, runs  # two MLflow runs, no third
    assert len(runs[first.run_id]) == 8 and len(runs[branch.run_id]) == 4  # the branch's own rows, past the copy
    assert max(runs[first.run_id]) < 100 < min(runs[branch.run_id])  # nothing of the branch in the original


def test_a_hostile_run_id_is_replaced(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"run_id": "a/b" + "x" * 300}))
    trainer = _fit(tmp_path / "run", 4)
    assert len(trainer.run_id) == 16 and "/" not in trainer.run_id


def test_an_unreachable_mlflow_server_is_a_clear_error_at_once(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import time

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"the MLflow server http://127.0.0.1:9 does not answer"):
        _fit(tmp_path / "run", 4, "mlflow")
    assert time.monotonic() - started < 30


def test_a_tracker_failing_mid_run_is_warned_about_and_training_goes_on(tmp_path, mlflow_store, capsys):
    class Breaks:
        def __call__(self, trainer, config, writer):
            if trainer.global_step == 4:
                shutil.rmtree(mlflow_store)  # the store vanishes (a full or unmounted disk)
                mlflow_store.write_text("not a folder")

    from trainstack import Callback

    trainer = _fit(tmp_path / "run", 12, "mlflow", log_every_n_steps=2,
                   callbacks=[Callback(on="optimizer_step", callback=Breaks())])
    out = capsys.readouterr().out
    assert trainer.global_step == 12 and "the MLflow tracker failed" in out and "training goes on" in out, out
    assert max(r["step"] for r in _rows(tmp_path / "run")) == 12


def test_a_row_an_earlier_attempt_sent_in_part_is_completed_never_repeated(tmp_path, mlflow_store):
    """An attempt killed inside a row's write (MLflow's file store writes one key after another), or a resumed
    attempt whose row at that step has a key more: only the keys MLflow does not hold at that step are sent.
    (In a process of its own: a run another test left active would be this one's.)"""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    program = tmp_path / "attempts.py"
    program.write_text(
        "import json, sys, mlflow\n"
        "from pathlib import Path\n"
        "from trainstack._runtime.writers import MLflowWriter, TrackerIds\n"
        "folder = Path(sys.argv[1])\n"
        "first = MLflowWriter(folder, TrackerIds(folder), 'run-a')\n"
        "first.write(None, {'loss': 1.0, 'lr': 0.1}, step=5)\n"
        "first.write(None, {'loss': 0.9}, step=10)  # killed here: lr of step 10 never sent\n"
        "mlflow.end_run()\n"
        "again = MLflowWriter(folder, TrackerIds(folder), 'run-a')\n"
        "again.write(None, {'loss': 1.0, 'lr': 0.1}, step=5)\n"
        "again.write(None, {'loss': 0.9, 'lr': 0.1, 'resumed': 1.0}, step=10)\n"
        "again.write(None, {'loss': 0.8, 'lr': 0.1}, step=15)\n"
        "mlflow.end_run()\n"
        "client = mlflow.tracking.MlflowClient()\n"
        "print(json.dumps({k: sorted((m.step, m.value) for m in client.get_metric_history(again.run.info.run_id, k))\n"
        "                  for k in ('loss', 'lr', 'resumed')}))\n")
    done = subprocess.run([sys.executable, str(program), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"loss": [[5, 1.0], [10, 0.9], [15, 0.8]],
                                                                 "lr": [[5, 0.1], [10, 0.1], [15, 0.1]],
                                                                 "resumed": [[10, 1.0]]}
