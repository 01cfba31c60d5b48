"""A small DeviceMesh tour.

Run: torchrun --standalone --nproc-per-node=2 examples/mesh_demo.py
"""

import os

import torch
import torch.distributed as dist

from device_mesh import init_device_mesh

world = int(os.environ.get("WORLD_SIZE", "1"))
mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
rank = mesh.get_rank()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t, group=mesh.get_group("tp"))  # sums 1 + 2 + ... over this rank's row
if rank == 0:
    print(f"{mesh!r}: sum over 'tp' = {t.item():.0f}")
dist.barrier()  # no rank tears gloo down while its peer still talks to it
dist.destroy_process_group()
