"""One run, however often it is killed: SIGKILL at random moments (during a step, a checkpoint write, a metrics
write), then ``resume="auto"``, until the run ends; metrics.jsonl, the tracker run (MLflow file store, W&B offline,
TensorBoard event files) each hold exactly the uninterrupted run's rows, in one tracker run."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, ci_leaves_out

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
JOB = str(Path(__file__).with_name("_tracked_train.py"))
VOLATILE = {"time", "samples_per_s", "batches_per_s", "tokens_per_s", "eta_s", "data_wait", "optimizer_share", "mfu",
            "max_mem_gb", "_runtime", "_timestamp", "_step"}


def _env(tmp: Path, name: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": f"file://{tmp}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true",
            "MLFLOW_EXPERIMENT_NAME": name, "TRAINSTACK_PROGRESS": "0"}


def _start(folder: Path, tool: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, JOB, str(folder), tool], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def _killed_until_done(folder: Path, tool: str, env: dict[str, str], kills: int, seed: int) -> int:
    """Kill -9 (the whole process group: the tracker's helper processes too) at random moments after training
    started, ``kills`` times, then let it finish; the number of kills that landed."""
    rng, landed = random.Random(seed), 0
    for _ in range(kills):
        proc = _start(folder, tool, env)
        deadline = time.monotonic() + 120
        metrics = folder / "metrics.jsonl"
        before = metrics.stat().st_size if metrics.exists() else 0
        while proc.poll() is None and not (metrics.exists() and metrics.stat().st_size > before):
            assert time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        if proc.poll() is not None:
            _finish(proc)
            return landed
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        landed += 1
    _finish(_start(folder, tool, env))
    return landed


def _jsonl(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def _mlflow(tmp: Path, name: str) -> list[list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file://{tmp}/mlruns")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    return [sorted((m.step, m.value) for key in ("loss", "train_loss", "mse", "lr")
                   for m in client.get_metric_history(r.info.run_id, key)) for r in runs]


def _wandb_records(path: Path):
    """The records of a W&B ``.wandb`` file (a LevelDB log of protobuf records: 7-byte header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def _wandb(folder: Path) -> tuple[set[str], list[tuple[int, dict]]]:
    """(the run ids, the history as the W&B server merges the attempts: a resumed run's rows at a step it already
    has are dropped, new keys at its current step merge)."""
    def order(p: Path) -> tuple[str, int]:
        stamp, _, rest = p.parent.name.removeprefix("offline-run-").partition("-")
        return stamp, int(rest.rsplit("-", 1)[1]) if rest.count("-") else 0

    ids, rows = set(), {}
    for path in sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"), key=order):
        top = max(rows, default=-1)
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                step = rec.history.step.num
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
                if step > top or step == top:
                    rows.setdefault(step, {}).update({k: v for k, v in items.items() if k not in VOLATILE
                                                      and (step > top or k not in rows[step])})
    return ids, sorted(rows.items())


def _tensorboard(folder: Path) -> list[tuple[str, int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return sorted((tag, e.step, e.value) for tag in acc.Tags()["scalars"] if tag not in VOLATILE
                  and "samples_per_s" not in tag for e in acc.Scalars(tag))


@pytest.mark.parametrize("tool", [
    "mlflow", pytest.param("wandb", marks=ci_leaves_out("a tracker with a server-side run identity: mlflow")),
    pytest.param("tensorboard", marks=ci_leaves_out(
        "a tracker with a server-side run identity: mlflow and wandb; tensorboard's is its log folder"))])
def test_killed_and_resumed_runs_are_one_run_with_the_uninterrupted_history(tmp_path, tool, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    pytest.importorskip({"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}[tool])
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _finish(_start(reference, tool, _env(tmp_path, "reference")))
    landed = _killed_until_done(killed, tool, _env(tmp_path, "killed"), kills=3, seed=len(tool))
    assert landed >= 2, f"only {landed} kills landed before the run ended"
    assert _jsonl(killed) == _jsonl(reference)
    run_id = json.loads((killed / "run.json").read_text())["run_id"]
    if tool == "mlflow":
        runs, ref = _mlflow(tmp_path, "killed"), _mlflow(tmp_path, "reference")
        assert len(runs) == 1 and runs == ref, (len(runs), runs[0][:8], ref[0][:8])
    elif tool == "wandb":
        ids, history = _wandb(killed)
        assert ids == {run_id} and history == _wandb(reference)[1]
    else:
        assert _tensorboard(killed) == _tensorboard(reference)
