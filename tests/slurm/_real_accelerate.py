"""A loop written with the real `accelerate` package (not trainstack's): DDP on every process it launched, one
gather, the result written by the main process to $PROBE_OUT/accelerate.json."""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(2, 1)
data = TensorDataset(torch.randn(64, 2), torch.randn(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8, shuffle=True))
for x, y in loader:
    optimizer.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
ranks = accelerator.gather(torch.tensor([accelerator.process_index])).tolist()
weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().reshape(1, -1))
if accelerator.is_main_process:
    Path(os.environ["PROBE_OUT"], "accelerate.json").write_text(json.dumps({
        "module": Accelerator.__module__, "processes": accelerator.num_processes, "ranks": ranks,
        "same_weights": bool(torch.equal(weights[0], weights[-1])), "batches": len(loader),
        "type": str(accelerator.distributed_type)}))
accelerator.wait_for_everyone()
accelerator.end_training()
# end_training's destroy_process_group drops torch's reference, but the DDP model's reducer still holds the gloo
# group; it is freed during interpreter finalization, where gloo's worker threads can abort the finished process
# ("terminate called without an active exception", SIGABRT) under load. Every result is written: leave without it.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
