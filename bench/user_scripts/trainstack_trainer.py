"""The same run as a trainstack user writes it: model, optimizer and data in the script, Trainer.fit with its
defaults (run folder, metrics.jsonl, a final checkpoint, the loss curve, the model handed back)."""

import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainstack import Callback, TrainConfig, Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _clock import first_step_ended, write  # noqa: E402
from raw_ddp import BATCH, MLP, data  # noqa: E402  # the same model and data


def loss(model: nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def clock(trainer, config, writer) -> None:  # noqa: ANN001
    trainer.optimizer.register_step_post_hook(first_step_ended)


def report(trainer, config, writer) -> None:  # noqa: ANN001
    if trainer.accelerator.rank == 0:
        write(sys.argv[2])


if __name__ == "__main__":
    world, out = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = MLP()
    config = TrainConfig(nprocs=world, compute_setup="cpu", max_iter=1, root_folder=os.path.join(out, "runs"),
                         verbose=os.environ.get("VERBOSE", "1") == "1",  # a user's run prints: the defaults
                         callbacks=[Callback(on="train_start", callback=clock),
                                    Callback(on="train_end", callback=report)])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), config, loss_fn=loss).fit(
        DataLoader(data(world), batch_size=BATCH, shuffle=True))
