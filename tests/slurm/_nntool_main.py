"""Seed 004's main.py (nntool + Accelerate) with only the imports changed; run by tests/slurm/test_nntool.py.

    python _nntool_main.py OUT_DIR LAUNCH_COMMAND
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Accelerator, set_seed
from trainstack.slurm import SlurmConfig, slurm_fn


@slurm_fn
def main(config: SlurmConfig) -> None:
    accelerator = Accelerator()
    set_seed(2024)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    training_dataloader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    for x, y in training_dataloader:  # your training loop here
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    out = Path(sys.argv[1])
    (out / f"rank{accelerator.process_index}").write_text(f"{accelerator.num_processes} {len(training_dataloader)}")


def square(x):
    return x * x


if __name__ == "__main__":
    slurm_config = SlurmConfig(
        mode="slurm",
        partition="",
        job_name="trainstack-test",
        tasks_per_node=1,
        cpus_per_task=1,
        gpus_per_node=0,
        processes_per_task=1,
        num_of_node=2,
        timeout_min=5,
        output_parent_path=sys.argv[1],
        use_distributed_env=True,
        distributed_launch_command=sys.argv[2],
    )
    job = main[slurm_config](slurm_config)
    print("JOB", job.job_id, flush=True)
