"""``trainstack checkpoint export``: safetensors (one file, or shards with their index) equal to the consolidated
state dict, tied weights included; a Hugging Face folder ``from_pretrained`` loads with the same logits; no
half-written output; clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from trainstack import TrainConfig, Trainer
from trainstack.checkpoint import CheckpointError, consolidate, export

safetensors_torch = pytest.importorskip("safetensors.torch")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models do

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _lm_loss(model: nn.Module, batch) -> torch.Tensor:
    (ids,) = batch
    return nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 50), ids[:, 1:].reshape(-1))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("export") / "run"
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (64, 9))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)
    model = Tied()
    Trainer(model, torch.optim.AdamW(model.parameters(), 1e-2), TrainConfig(max_iter=1, log_folder=folder,
                                                                             verbose=False,
                                                                             export_final_model="safetensors"),
            loss_fn=_lm_loss).fit(loader)
    return folder


def test_the_run_exports_its_final_model_when_asked(run_folder):
    exported = safetensors_torch.load_file(str(run_folder / "export" / "model.safetensors"))
    assert exported.keys() == consolidate(run_folder).keys()  # the tied head kept once, as the export CLI does
    assert all(torch.equal(exported[k], v) for k, v in consolidate(run_folder).items())


def test_a_final_export_that_cannot_be_written_is_refused_before_training(tmp_path):
    from trainstack.errors import ConfigError

    with pytest.raises(ConfigError, match=r"export_final_model='onnx' must be 'safetensors', 'hf' or None"):
        TrainConfig(export_final_model="onnx")
    model = Tied()
    with pytest.raises(ConfigError, match=r"export_final_model='hf' needs a transformers model.*a Tied"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                TrainConfig(max_iter=1, log_folder=tmp_path / "run", verbose=False, export_final_model="hf"),
                loss_fn=_lm_loss).fit([(torch.randint(0, 50, (2, 9)),)])
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainstack", "checkpoint", "export", *args], capture_output=True,
                          text=True, timeout=120)


def test_safetensors_export_equals_the_consolidated_state_dict(run_folder, tmp_path):
    proc = _cli(str(run_folder), "-o", str(tmp_path / "st"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["model.safetensors"]
    loaded = safetensors_torch.load_file(tmp_path / "st" / "model.safetensors")
    expected = consolidate(run_folder)
    assert loaded.keys() == expected.keys() and "head.weight" in loaded  # the tied weight under both names
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_above_the_shard_size_the_weights_are_split_with_an_index(run_folder, tmp_path):
    files = export(run_folder, tmp_path / "sharded", max_shard_size="2KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {f.name for f in files} == {*shards, "model.safetensors.index.json"}
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        loaded.update(safetensors_torch.load_file(tmp_path / "sharded" / shard))
    expected = consolidate(run_folder)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_an_existing_output_is_kept_unless_forced_and_bad_sizes_are_named(run_folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="exists. HINT: choose a new folder, or pass --force"):
        export(run_folder, out)
    assert (out / "mine.txt").read_text() == "keep"
    with pytest.raises(CheckpointError, match="--max-shard-size: 'five' is not a size"):
        export(run_folder, tmp_path / "x", max_shard_size="five")
    for size in ("0", "0.5", "100"):  # each tensor a shard of its own: refused, not silently done
        with pytest.raises(CheckpointError, match=rf"--max-shard-size: '{size}' is \d+ byte\(s\): every tensor"):
            export(run_folder, tmp_path / "x", max_shard_size=size)
    export(run_folder, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # readable as its folder is
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = _cli(str(run_folder), "-o", str(blocker / "out"))
    assert proc.returncode != 0 and f"cannot write {blocker / 'out'}" in proc.stderr and "Traceback" not in \
        proc.stderr, proc.stderr
    proc = _cli(str(run_folder), "-o", str(tmp_path / "hf"), "--format", "hf")
    assert proc.returncode != 0 and "holds no Hugging Face model config: --format hf needs a checkpoint of a " \
                                    "transformers model" in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


def test_a_transformers_model_trained_by_trainstack_exports_to_a_folder_from_pretrained_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (32, 12))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)
    folder = tmp_path / "run"
    trained, _ = Trainer(model, torch.optim.AdamW(model.parameters(), 1e-3),
                         TrainConfig(max_iter=1, log_folder=folder, verbose=False, export_final_model="hf"),
                         loss_fn=lambda m, batch: m(input_ids=batch[0], labels=batch[0]).loss).fit(loader)
    proc = _cli(str(folder), "-o", str(tmp_path / "hf"), "--format", "hf")
    assert proc.returncode == 0, proc.stderr
    trained.eval()
    for exported in (tmp_path / "hf", folder / "export"):  # the CLI's, and the run's own at its end
        loaded = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
        with torch.no_grad():
            assert torch.equal(trained(input_ids=ids[:4]).logits, loaded(input_ids=ids[:4]).logits), exported
