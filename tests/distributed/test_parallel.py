"""Models that outgrow one node, on real gloo processes: HSDP on a 2-D mesh equal to DDP (accumulation, clipping),
its process groups; sharded checkpoints resuming across HSDP -> FSDP -> DDP -> HSDP at 4, 2, 1 and 4 processes with
every sample of the epoch seen once, and bitwise on the same layout; activation checkpointing (same result, fewer
saved activations); the parallelize hook with a tensor-parallel plan equal to the plain model; clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _fsdp_train as ft
import pytest
import torch
from torch import nn

from trainstack import Callback, TrainConfig, Trainer
from trainstack.errors import ConfigError, Preempted

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _ids(prefix: Path) -> list[int]:
    return [i for path in sorted(prefix.parent.glob(prefix.name + "-rank*.jsonl"))
            for line in path.read_text().splitlines() for i in json.loads(line)]


def test_hsdp_with_activation_checkpointing_equals_ddp_and_replicates_across_its_first_dimension(tmp_path,
                                                                                                   monkeypatch):
    kw = {"gradient_accumulation_steps": 2, "grad_clip_norm": 0.5, "max_iter": 6}
    ddp = ft.fit(tmp_path / "ddp", 4, "ddp", **kw)
    monkeypatch.setenv("FSDP_MESH", str(tmp_path / "mesh"))
    hsdp = ft.fit(tmp_path / "hsdp", 4, "hsdp", hsdp_replicas=2, activation_checkpointing="full",
                  callbacks=[Callback(on="train_start", callback=ft.dump_mesh)], **kw)  # + AC on every Block
    diff = max((ddp.state_dict()[k] - v).abs().max().item() for k, v in hsdp.state_dict().items())
    assert diff < 1e-5, diff
    groups = {r: json.loads((tmp_path / f"mesh-rank{r}.json").read_text()) for r in range(4)}
    assert [groups[r]["dp_replicate"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # copies
    assert [groups[r]["dp_shard"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # one copy's shards


def _until(folder: Path, nprocs: int, strategy: str, stop_step: int, tmp_path: Path, monkeypatch, tag: str,
           **kw) -> None:
    stop = tmp_path / f"{tag}.STOP"
    monkeypatch.setenv("FSDP_STOP", str(stop))
    monkeypatch.setenv("FSDP_STOP_STEP", str(stop_step))
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / f"ids-{tag}"))
    with pytest.raises(Preempted):
        ft.fit(folder, nprocs, strategy, max_iter=1, checkpoint_format="sharded", stop_file=stop,
               callbacks=[Callback(on="train_batch_end", callback=ft.touch_stop_at_step_3)], **kw)
    stop.unlink()


def test_sharded_checkpoints_resume_across_strategies_and_world_sizes(tmp_path, monkeypatch):
    """HSDP(2x2) stops at step 2 (16 samples) -> FSDP(2) to step 5 (+12) -> DDP(1) to step 9 (+8) -> HSDP(2x2)
    finishes the epoch (+24): every one of the 60 samples once. The same stopped HSDP run resumed as HSDP equals
    an uninterrupted one bit for bit."""
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / "ids-ref"))
    reference = ft.fit(tmp_path / "ref", 4, "hsdp", hsdp_replicas=2, max_iter=1, checkpoint_format="sharded")
    folder = tmp_path / "run"
    _until(folder, 4, "hsdp", 2, tmp_path, monkeypatch, "a", hsdp_replicas=2)
    same = tmp_path / "same"
    shutil.copytree(folder, same)
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / "ids-same"))
    resumed = ft.fit(same, 4, "hsdp", hsdp_replicas=2, max_iter=1, checkpoint_format="sharded", resume="auto",
                     init=5)
    for k, v in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    _until(folder, 2, "fsdp", 5, tmp_path, monkeypatch, "b", resume="auto", init=6)
    _until(folder, 1, "ddp", 9, tmp_path, monkeypatch, "c", resume="auto", init=7)
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / "ids-d"))
    ft.fit(folder, 4, "hsdp", hsdp_replicas=2, max_iter=1, checkpoint_format="sharded", resume="auto", init=8)
    seen = {tag: _ids(tmp_path / f"ids-{tag}") for tag in "abcd"}
    assert [len(seen[t]) for t in "abcd"] == [16, 12, 8, 24], {t: len(v) for t, v in seen.items()}
    assert sorted(sum(seen.values(), [])) == list(range(ft.N_SAMPLES))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.1)) for _ in range(4))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the activations autograd keeps for the backward of one forward (saved-tensor hooks), and the
    gradient of the first weight after that backward."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).pow(2).mean()
    loss.backward()
    return saved[0], model.blocks[0][0].weight.grad.clone()


@pytest.mark.parametrize("policy", ["full", "selective", "callable"])
def test_activation_checkpointing_gives_the_same_gradients_and_keeps_fewer_activations(policy):
    from trainstack import Accelerator

    x = torch.randn(64, 32)
    plain_bytes, plain_grad = _saved_bytes(Blocks(), x)
    chosen = (lambda m: isinstance(m, nn.Sequential) and m is not None) if policy == "callable" else policy
    acc = Accelerator(compute_setup="cpu", activation_checkpointing=chosen, fsdp_blocks=("Sequential",))
    model = acc.prepare_model(Blocks())
    ac_bytes, ac_grad = _saved_bytes(model, x)
    assert torch.equal(ac_grad, plain_grad)  # recomputed with the same dropout masks (RNG restored)
    assert ac_bytes < (0.75 if policy == "selective" else 0.5) * plain_bytes, (ac_bytes, plain_bytes)
    assert list(model.state_dict()) == list(Blocks().state_dict())  # checkpoints keep their keys


def tp_plan(model: nn.Module, mesh, tp_mesh):
    """The worked example of docs/how-to/fsdp.md: the block's first Linear split by columns, the second by rows."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


def _regression() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.flip(1)), batch_size=8)


def test_a_tensor_parallel_plan_through_the_hook_equals_the_plain_model(tmp_path, capfd):
    plain, tp = _mlp(), _mlp()
    Trainer(plain, torch.optim.SGD(plain.parameters(), lr=0.1), TrainConfig(
        compute_setup="cpu", max_iter=2, log_folder=tmp_path / "plain", verbose=False), loss_fn="mse").fit(
        _regression())
    trained, _ = Trainer(tp, torch.optim.SGD(tp.parameters(), lr=0.1), TrainConfig(
        compute_setup="cpu", nprocs=2, max_iter=2, log_folder=tmp_path / "tp", verbose=False, strategy="fsdp",
        tensor_parallel_size=2, parallelize_fn=tp_plan), loss_fn="mse").fit(_regression())
    for (name, a), b in zip(plain.state_dict().items(), trained.state_dict().values(), strict=True):
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        assert torch.allclose(a, b, atol=1e-5), name
    said = capfd.readouterr()
    assert "redistributing" not in said.out + said.err  # the final gather's expected 2-step all_gather: not a warning


def test_clear_errors_for_layouts_that_cannot_be(tmp_path):
    from trainstack._runtime.parallel import plan_layout

    with pytest.raises(ConfigError, match=r"hsdp_replicas=3 does not divide the 4 data-parallel processes"):
        plan_layout("hsdp", 4, 1, 3, 1)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide the 4 processes"):
        plan_layout("fsdp", 4, 1, None, 3)
    assert plan_layout("hsdp", 8, 2, None, 1) == plan_layout("hsdp", 8, 1, 2, 1)  # default: one copy per node
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs parallelize_fn"):
        TrainConfig(strategy="fsdp", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"strategy='ddp': DDP cannot hold tensor-parallel"):
        TrainConfig(tensor_parallel_size=2, parallelize_fn=tp_plan)
    with pytest.raises(ConfigError, match=r"hsdp_replicas=2 only applies with strategy='hsdp'"):
        TrainConfig(strategy="fsdp", hsdp_replicas=2)
    with pytest.raises(ConfigError, match=r"activation_checkpointing='some' must be 'full', 'selective'"):
        TrainConfig(activation_checkpointing="some")

    def wrong_plan(model, mesh, tp_mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(model, tp_mesh, {"attention.wq": ColwiseParallel()})

    model = _mlp()
    with pytest.raises(ConfigError, match=r"parallelize_fn 'wrong_plan': its plan does not match the model: "
                                          r"Parallelize plan key 'attention.wq' could not be resolved.*'0', '1', '2'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainConfig(
            compute_setup="cpu", nprocs=2, max_iter=1, log_folder=tmp_path / "bad", verbose=False,
            strategy="fsdp", tensor_parallel_size=2, parallelize_fn=wrong_plan), loss_fn="mse").fit(_regression())


def test_fp8_where_it_cannot_run_is_a_clear_error_before_training(tmp_path):
    model = _mlp()
    with pytest.raises(ConfigError, match=r"mixed_precision='fp8' needs an NVIDIA GPU with float8 tensor cores "
                                          r".*this run is on cpu.*HINT: mixed_precision='bf16'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainConfig(
            compute_setup="cpu", max_iter=1, log_folder=tmp_path / "fp8", verbose=False, mixed_precision="fp8"),
            loss_fn="mse").fit(_regression())
    assert not any((tmp_path / "fp8").rglob("ckpt-*"))


def test_activation_checkpointing_under_compile_gives_the_plain_gradients():
    """The order torchtitan uses: checkpointing applied to the blocks before they are compiled."""
    from trainstack import Accelerator

    def plain() -> nn.Module:
        model = Blocks()
        for block in model.blocks:
            block[2].p = 0.0  # no dropout: inductor draws its own random numbers
        return model

    x = torch.randn(64, 32)
    _, expected = _saved_bytes(plain(), x)
    acc = Accelerator(compute_setup="cpu", activation_checkpointing="full", fsdp_blocks=("Sequential",), compile=True)
    _, got = _saved_bytes(acc.prepare_model(plain()), x)
    assert torch.allclose(got, expected, atol=1e-5)


def test_fp8_that_will_not_pay_is_said_before_the_run():
    """mixed_precision='fp8' warns where it would cost instead of pay: eager float8, small layers, nothing converted."""
    from trainstack._runtime.parallel import fp8_note

    assert fp8_note([(4096, 14336), (14336, 4096)], compiled=True) is None  # the 8B widths, compiled: it pays
    eager = fp8_note([(4096, 14336)], compiled=False)
    assert eager and "without compile" in eager and "0.56x" in eager and "compile=True" in eager
    small = fp8_note([(2048, 8192), (768, 768)], compiled=True)
    assert small and "largest Linear is 2048 wide" in small and "without compile" not in small
    assert "no Linear layer" in (fp8_note([], compiled=True) or "")
