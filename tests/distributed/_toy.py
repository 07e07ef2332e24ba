"""The toy run the fault-tolerance programs train (beside test_*.py, importable by them as scripts): 96 samples of
4 features shuffled in batches of 4, a small MLP with dropout (so an RNG restored wrong shows), rank 0 saving the
final parameters."""

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(96, 4, generator=g), torch.randn(96, 1, generator=g)), batch_size=4,
                      shuffle=True)


def model(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Dropout(0.1), nn.Linear(width, 1))


def final_saver(out: Path):
    """A train_end callback: rank 0 writes the final parameters to ``out/final.pt``."""
    def save_final(trainer, config, writer):
        if trainer.accelerator.rank == 0:
            torch.save(trainer.model.state_dict(), out / "final.pt")
    return save_final
