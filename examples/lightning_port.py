"""A Lightning-style training script with trainstack: a small CNN, validation every N steps, a per-step scheduler,
gradient accumulation, early stopping on ``val_acc``, the two best checkpoints, then predictions from the best one.
Synthetic data (no download). Every TrainConfig field is also a command-line option, and so is the script's own
``--lr`` (``TrainConfig.from_cli(options=...)``), so a sweep needs no parser:

    python examples/lightning_port.py                                   # 2 CPU processes
    python examples/lightning_port.py --max_steps 60 --gradient_accumulation_steps 1 --nprocs 1 --lr 1e-3
    trainstack submit --setup multi-gpu --gpus-per-node 4 --sweep lr=0.01,0.003 -- examples/lightning_port.py \
        --compute_setup auto
    trainstack submit --setup multi-gpu --cpu --procs-per-node 2 --sweep lr=0.01,0.003 -- examples/lightning_port.py

Under ``python`` the lines after ``fit()`` run once (in the launching process, with rank 0's weights); under
``torchrun`` or ``srun`` every rank runs them, so the report is printed where ``trainer.is_global_zero``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer
from trainstack.callbacks import EarlyStopping, ModelCheckpoint


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))  # 16 x 4 x 4
        self.head = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def bands(n: int, seed: int, classes: int = 4) -> TensorDataset:
    """16x16 noise images with a bright band whose row says the class."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = torch.rand(n, 1, 16, 16, generator=g) * 0.5
    for i, label in enumerate(labels.tolist()):
        images[i, 0, 4 * label: 4 * label + 2, :] += 1.0
    return TensorDataset(images, labels)


def loss_and_accuracy(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, dict]:
    """Lightning's training_step/validation_step in one: the loss, and metrics reported as train_acc/val_acc."""
    images, labels = batch
    logits = model(images)
    return F.cross_entropy(logits, labels), {"acc": (logits.argmax(1) == labels).float().mean()}


def main(argv: list[str] | None = None) -> None:
    config, opts = TrainConfig.from_cli(  # defaults here; the command line (and --config FILE) override them; --help
        argv, options={"lr": 3e-3}, nprocs=2, compute_setup="cpu", max_steps=120, max_iter=20,
        gradient_accumulation_steps=2, val_every_n_steps=20, log_every_n_steps=10, seed=0,
        log_folder="runs/lightning-port",
        callbacks=[EarlyStopping(monitor="val_acc", mode="max", patience=3),
                   ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=2, save_last=True)])
    train = DataLoader(bands(1024, seed=1), batch_size=32, shuffle=True)
    val = DataLoader(bands(256, seed=2), batch_size=64)
    model = SmallCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    trainer = Trainer(model, optimizer, config, loss_fn=loss_and_accuracy, scheduler_interval="step",
                      # Lightning's estimated_stepping_batches: the steps this run takes, for this world size
                      scheduler=lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total))
    trainer.fit(train, val)

    trainer.load_checkpoint("best")  # the weights with the highest val_acc, on every rank
    test = DataLoader(bands(200, seed=3), batch_size=64)
    logits = trainer.predict(test)  # every sample, in dataset order, whatever nprocs is (None on other ranks)
    if trainer.is_global_zero:
        accuracy = (logits.argmax(1) == test.dataset.tensors[1]).float().mean().item()
        print(f"best checkpoint: {trainer.checkpointer.named('best')}; test accuracy {accuracy:.3f} "
              f"on {len(logits)} samples")


if __name__ == "__main__":
    main()
