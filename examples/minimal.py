"""The smallest fully_shard training script: torchrun --nproc-per-node=2 examples/minimal.py"""

import torch
import torch.distributed as dist
from torch import nn

from fsdp2 import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)  # every rank builds the same model
model = nn.Sequential(
    *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)], nn.Linear(64, 64)
)
for layer in model:
    fully_shard(layer)  # each layer: one all-gather in forward, one reduction in backward
fully_shard(model)  # the root: everything left over
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # sees only this rank's shards

torch.manual_seed(dist.get_rank())  # but every rank reads different data
for step in range(60):
    x = torch.randn(32, 64)
    loss = (model(x) - x.sin()).pow(2).mean()  # learn sin, elementwise
    loss.backward()  # gradients are reduced and sharded like the parameters
    opt.step()
    opt.zero_grad()
    if step % 10 == 0 and dist.get_rank() == 0:
        print(f"step {step:2d}  loss {loss.item():.4f}")
print(
    f"rank {dist.get_rank()}: {model[0][0].weight.to_local().shape} of {model[0][0].weight.shape}"
)
dist.barrier()
dist.destroy_process_group()
