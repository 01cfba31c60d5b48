"""fsdp2: per-parameter fully sharded data parallel (FSDP2-style ``fully_shard``).

Example:
    >>> from fsdp2 import fully_shard
    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
"""

from fsdp2.api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from fsdp2.auto import AutoPlan, auto_parallelize
from fsdp2.fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from fsdp2.recipe import parallelize_transformer

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "register_fsdp_forward_method",
    "parallelize_transformer",
    "auto_parallelize",
    "AutoPlan",
]
