"""CUDA and NCCL paths on a real GPU: device placement, no host sync per step, exact resume with CUDA RNG, mixed
precision, the examples, doctor and nccl_check, and the clear errors of GPU-only mistakes."""

from __future__ import annotations

import sys
import time
import warnings

import pytest
import torch
from helpers import ROOT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Accelerator, Callback, TrainConfig, Trainer
from trainstack.checkpoint import Checkpointer
from trainstack.errors import LaunchError

pytestmark = [pytest.mark.timeout(300)]


def _model(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(dropout), nn.Linear(64, 1))


def _loader(n=256, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=batch, shuffle=True)


def _cfg(tmp_path, name, **kw):
    return TrainConfig(**({"max_iter": 4, "log_folder": tmp_path / name, "verbose": False, "compute_setup": "gpu",
                           "seed": 1, "checkpoint_every": 1} | kw))


def test_prepare_and_prepare_batch_on_cuda():
    acc = Accelerator(compute_setup="gpu", dtype=torch.float32)
    model = acc.prepare(nn.Linear(4, 2))
    assert next(model.parameters()).device.type == "cuda"
    x, labels = acc.prepare_batch((torch.randn(8, 4, dtype=torch.float64), torch.arange(8)))
    assert x.device.type == labels.device.type == "cuda"
    assert x.dtype == torch.float32 and labels.dtype == torch.int64  # integer labels are never cast
    loader = acc.prepare(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    assert loader.pin_memory  # pinned on CUDA: asynchronous copies


def test_a_batch_is_copied_beside_the_step_before_not_behind_it():
    """prepare_batch issues the host-to-GPU copy on a copy stream of its own: it completes while a long kernel still
    runs on the compute stream (the step before), without a host synchronisation, and the compute stream waits for
    it before using the batch."""
    from trainstack._runtime import placement

    acc = Accelerator(compute_setup="gpu", dtype=torch.float32)
    acc.prepare(nn.Linear(4, 4))
    host = (torch.randn(512, 1024).pin_memory(), torch.arange(512).pin_memory())
    acc.prepare_batch(host)  # the first call makes the copy stream (once per process: not a per-step cost)
    busy = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # ~0.1-0.5 s of fp32 matmuls queued on the compute stream: "the step before"
        busy = busy @ busy / 8192
    said: list[str] = []
    syncs = _syncs(lambda: acc.prepare_batch(host), said)
    moved = acc.prepare_batch(host)
    copy_stream = placement._STREAMS[torch.cuda.current_device()]
    deadline = time.monotonic() + 2
    while not copy_stream.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert copy_stream.query() and not torch.cuda.current_stream().query(), "the copy waited behind the compute"
    assert syncs == 0, said
    assert torch.equal(moved[0].cpu(), host[0]) and torch.equal(moved[1].cpu(), host[1])


def _syncs(run, said: list[str] | None = None) -> int:
    """Host synchronisations while ``run()`` runs, counted by torch's sync debug mode (one warning per sync);
    ``said`` collects the warnings counted, with where they came from."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # "called a synchronizing CUDA operation": one per sync; not the notice that turning the mode on prints
    counted = [w for w in caught if "called a synchronizing" in str(w.message)]
    if said is not None:
        said += [f"{w.filename}:{w.lineno}: {w.message}" for w in counted]
    return len(counted)


def _per_step(run, steps=60) -> float:
    """Syncs per step: the difference between ``steps`` steps and one step, so fixed start/end costs cancel."""
    return (_syncs(lambda: run(steps)) - _syncs(lambda: run(1))) / (steps - 1)


def test_no_host_sync_per_step_beyond_the_raw_loop(tmp_path):
    x, y = torch.randn(64 * 60, 16), torch.randn(64 * 60, 1)

    def raw(steps):
        model = _model(dropout=0.0).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(steps):
            xb, yb = x[64 * i:64 * i + 64].cuda(non_blocking=True), y[64 * i:64 * i + 64].cuda(non_blocking=True)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
        torch.cuda.synchronize()

    def accelerator(steps):
        acc = Accelerator(compute_setup="gpu")
        model = acc.prepare(_model(dropout=0.0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(steps):
            xb, yb = acc.prepare_batch((x[64 * i:64 * i + 64], y[64 * i:64 * i + 64]))
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
        torch.cuda.synchronize()

    runs = iter(range(10**6))

    def trainer(steps, precision):
        model = _model(dropout=0.0)
        cfg = _cfg(tmp_path, f"sync-{precision}-{next(runs)}", max_iter=1, checkpoint_every=0,
                   mixed_precision=precision, log_every_n_steps=0, log_every_seconds=0)
        Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, max_batches=steps).fit(
            DataLoader(TensorDataset(x, y), batch_size=64))

    counted = {"raw": _per_step(raw), "accelerator": _per_step(accelerator)}
    for precision in ("no", "bf16"):
        counted[f"trainer-{precision}"] = _per_step(lambda s, p=precision: trainer(s, p))
    print("host syncs per step:", counted)
    assert counted["accelerator"] <= counted["raw"] + 0.01
    assert counted["trainer-no"] <= counted["raw"] + 0.01 and counted["trainer-bf16"] <= counted["raw"] + 0.01


def test_live_lines_cost_one_host_sync_each_never_one_per_step(tmp_path):
    x, y = torch.randn(64 * 60, 16), torch.randn(64 * 60, 1)
    runs = iter(range(10**6))

    def trainer(steps, every):
        model = _model(dropout=0.0)
        cfg = _cfg(tmp_path, f"lines-{every}-{next(runs)}", max_iter=1, checkpoint_every=0, verbose=True,
                   log_every_n_steps=every, log_every_seconds=0)
        Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, max_batches=steps).fit(
            DataLoader(TensorDataset(x, y), batch_size=64))

    silent, lines = _per_step(lambda s: trainer(s, 0)), _per_step(lambda s: trainer(s, 10))
    print(f"host syncs per step: no lines {silent:.3f}, a line every 10 steps {lines:.3f}")
    assert lines - silent <= 1 / 10 + 0.01  # one sync per line (the interval's loss), none per step


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_exact_resume_on_cuda(tmp_path, precision):
    def run(name, crash_at=None, resume=None, init=0):
        callbacks = []
        if crash_at:
            def crash(trainer, config, writer):
                if trainer.current_epoch == crash_at:
                    raise KeyboardInterrupt("simulated crash")
            callbacks.append(Callback(on="train_epoch_end", callback=crash))
        model = _model(init)
        cfg = _cfg(tmp_path, name, mixed_precision=precision, callbacks=callbacks, resume=resume)
        Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg).fit(_loader())
        return model

    reference = run("ref")
    with pytest.raises(KeyboardInterrupt):
        run("cut", crash_at=3)
    assert Checkpointer(tmp_path / "cut").latest().name.startswith("ckpt-e00002")
    state = torch.load(Checkpointer(tmp_path / "cut").latest(), weights_only=True)
    assert state["rng"][0].get("cuda") is not None  # CUDA RNG states are saved ...
    resumed = run("cut", resume="auto", init=7)  # ... and restored (dropout on the GPU draws from them)
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_fit_returns_the_trained_model_with_fp32_master_weights(tmp_path):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    out, _ = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     _cfg(tmp_path, "ret", mixed_precision="bf16")).fit(_loader())
    assert out is model and all(p.dtype == torch.float32 for p in out.parameters())
    assert any(not torch.equal(b.to(p.device), p) for b, p in zip(before, out.parameters(), strict=True))


def test_nccl_backend_with_one_process():
    acc = Accelerator(nprocs=1, compute_setup="gpu", backend="nccl")

    def work(acc):
        model = acc.prepare(nn.Linear(4, 1))
        return acc.rank, acc.world_size, acc.backend, next(model.parameters()).device.type, \
            acc.all_reduce_dict({"x": torch.ones((), device=acc.device)})["x"].item()

    assert acc.distribute(work)(acc) == (0, 1, "nccl", "cuda", 1.0)


def test_more_processes_than_gpus_is_a_clear_error_on_every_path(tmp_path):
    n = torch.cuda.device_count() + 1
    with pytest.raises(LaunchError, match="one GPU per process"):
        _ = Accelerator(nprocs=n, compute_setup="gpu").plan
    model = _model()
    with pytest.raises(LaunchError, match="one GPU per process"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                _cfg(tmp_path, "many", nprocs=n, compute_setup="auto")).fit(_loader())


def test_notebook_fork_after_a_backward_is_explained(run_py):
    code = ("import torch\n"
            "torch.nn.Linear(2, 1)(torch.randn(3, 2)).sum().backward()  # starts autograd's device threads\n"
            "from trainstack import Accelerator\nfrom trainstack.errors import LaunchError\n"
            "try:\n    Accelerator(nprocs=2, compute_setup='cpu').distribute(print)('x')\n"
            "except LaunchError as exc:\n    print('LAUNCH-ERROR', exc)\n")
    out = run_py([sys.executable, "-c", code], timeout=120).stdout
    assert "LAUNCH-ERROR" in out and "autograd" in out and "restart the kernel" in out


def test_the_examples_on_the_gpu(run_py, tmp_path):
    """Seed 001 as shipped (nccl), and seed 000 with its documented "choose GPU" edit, on this machine's GPUs."""
    out = run_py([sys.executable, str(ROOT / "examples/train.py"), "--nprocs", "1", "--compute_setup", "gpu"],
                 cwd=tmp_path, timeout=240).stdout
    assert "epoch 50/50" in out and "nccl on cuda" in out
    gpus = torch.cuda.device_count()
    seed000 = (ROOT / "examples/accelerator_loop.py").read_text()
    for old, new in (('nprocs=4', f'nprocs={gpus}'), ('compute_setup="cpu"', 'compute_setup="gpu"'),
                     ('backend="gloo"', 'backend="nccl"')):
        assert old in seed000
        seed000 = seed000.replace(old, new)
    (tmp_path / "seed000_gpu.py").write_text(seed000)
    out = run_py([sys.executable, str(tmp_path / "seed000_gpu.py")], cwd=tmp_path, timeout=240,
                 env={"PYTHONUNBUFFERED": ""}).stdout
    assert "Epoch:  9" in out  # every rank prints; run_py checked the exit code
    out = run_py([sys.executable, str(ROOT / "examples/demo.py"), "--nprocs", "1", "--compute_setup", "gpu",
                  "--epochs", "3"], cwd=tmp_path, timeout=240).stdout
    assert "device=cuda:0" in out and "epoch   3/3" in out


def test_doctor_and_nccl_check_on_the_gpu(run_py):
    doctor = run_py([sys.executable, "-m", "trainstack", "doctor", "--compute-setup", "gpu"], timeout=120,
                    check=False)
    assert doctor.returncode == 0, doctor.stdout
    check = run_py([sys.executable, "-m", "trainstack.nccl_check", "--compute-setup", "gpu", "--nprocs",
                    str(min(torch.cuda.device_count(), 2))], timeout=180).stdout
    assert "nccl-check PASSED" in check


def test_fp8_trains_on_a_gpu_with_float8_tensor_cores(tmp_path):
    """mixed_precision='fp8' (torchao's float8 Linear layers, bf16 elsewhere) where the GPU has them."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no float8 tensor cores on this GPU (compute capability < 8.9)")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(512, 64)
    loader = DataLoader(TensorDataset(x, x.flip(1)), batch_size=64)
    trained, _ = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                         _cfg(tmp_path, "fp8", mixed_precision="fp8", max_iter=3), loss_fn="mse").fit(loader)
    assert any("Float8" in type(m).__name__ for m in trained.modules())
    assert all(torch.isfinite(p).all() for p in trained.parameters())


def test_fp8_with_fsdp_all_gathers_in_float8_where_torchao_offers_it(run_py, tmp_path):
    """FSDP2 + mixed_precision='fp8' over 2 processes needs 2 GPUs (the weights all-gathered in float8)."""
    pytest.importorskip("torchao")
    if torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs 2 GPUs with float8 tensor cores")
    program = tmp_path / "fp8_fsdp.py"
    program.write_text("""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainstack import TrainConfig, Trainer

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 256)
    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))

if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(1024, 256)
    cfg = TrainConfig(nprocs=2, compute_setup="gpu", strategy="fsdp", fsdp_blocks=("Block",), mixed_precision="fp8",
                      max_iter=2, log_folder="run", verbose=False)
    trained, _ = Trainer(model, torch.optim.AdamW(model.parameters(), 1e-3), cfg, loss_fn="mse").fit(
        DataLoader(TensorDataset(x, x), batch_size=64))
    assert all(torch.isfinite(p).all() for p in trained.parameters())
    print("FP8-FSDP-OK")
""")
    out = run_py([sys.executable, str(program)], cwd=tmp_path, timeout=240).stdout
    assert "FP8-FSDP-OK" in out
