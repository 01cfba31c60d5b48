"""Tensor parallelism: shard the weights of chosen modules over one mesh dim (Megatron style).

``parallelize_module(model, mesh["tp"], plan)`` turns each planned module's parameters into
DTensors on the tensor-parallel mesh and hooks its inputs and outputs into the layouts the
style asks for. ``fully_shard`` then shards those DTensors again over a data-parallel dim.

Example:
    >>> from dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    >>> parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(),
    ...                                            "out": RowwiseParallel()})
"""

from dtensor.parallel.api import parallelize_module
from dtensor.parallel.loss import loss_parallel
from dtensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "parallelize_module",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "loss_parallel",
]
