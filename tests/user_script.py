"""A user's own training script, as short as they write it: plain `Accelerator()`, nothing from scripts/.

tests/test_user_script_launch.py launches it with accelerate_configs/cpu_multi.yaml, as a user
would; every process appends "rank R of N <distributed type>" to the file named by argv[1]."""

import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
x, y = torch.randn(32, 8, device=accelerator.device), torch.randn(32, 1, device=accelerator.device)
for _ in range(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
line = f"rank {accelerator.process_index} of {accelerator.num_processes} {accelerator.distributed_type}"
print(line, flush=True)
with open(sys.argv[1], "a") as f:
    f.write(line + "\n")
accelerator.end_training()  # as Accelerate's examples end: the process group destroyed before exit
